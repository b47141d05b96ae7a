"""The fused MoE (kernels/fused_moe.py): the expert-sorted layout checked by hand, the per-expert torch loop
against a gather-every-pair formula, and the grouped Triton GEMMs against that loop on uneven expert loads
(experts with no tokens, one expert with every token, one expert over several row blocks, one token).

Without CUDA the kernels run in Triton's interpreter on small shapes (fp32); `-m gpu` adds bf16 at
Qwen3-30B-A3B's shape and a CUDA-graph capture of the layer."""
import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels.fused_moe import MoeTiles, align_by_expert, fused_moe
from nanovllm.layers.moe import moe_experts_torch, select_experts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def every_pair_reference(x, w13, w2, topk_weights, topk_ids):
    """Each (token, slot) pair through its expert with gathered weights, in float64: no sorting, no loop."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    inter = w13.shape[1] // 2
    gate_up = torch.einsum("th,tkih->tki", x, w13[topk_ids])
    hidden = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    return torch.einsum("tki,tkhi,tk->th", hidden, w2[topk_ids], topk_weights.double())


@pytest.mark.parametrize("use_kernel", [False, True])
def test_layout_by_hand(use_kernel):
    """Pairs (token*2 + slot) of ids [[2, 0], [2, 3], [0, 2]] sorted by expert, runs padded to 4 rows:
    expert 0: pairs 1, 4; expert 2: pairs 0, 2, 5; expert 3: pair 3; expert 1 has none."""
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    blocks = align_by_expert(ids, num_experts=4, block_m=4, use_kernel=use_kernel)
    pad = 6
    assert blocks.sorted_pairs.tolist()[:12] == [1, 4, pad, pad, 0, 2, 5, pad, 3, pad, pad, pad]
    assert set(blocks.sorted_pairs.tolist()[12:]) <= {pad}
    # room for cdiv(6, 4) + min(4, 6) = 6 blocks; the three past the last run are unused
    assert blocks.block_expert.tolist() == [0, 2, 3, -1, -1, -1]


@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "block_m", "case"), [
    (1, 8, 128, 16, "random"),  # a decode step: 8 experts of 128, one block each
    (50, 2, 6, 16, "random"),  # several chunks of the kernel's 64 pairs; experts not a power of two
    (70, 2, 8, 16, "skewed"),  # empty experts, one expert over several blocks
    (100, 1, 8, 32, "one-expert-takes-all"),
])
def test_align_kernel_gives_the_torch_layout(num_tokens, top_k, num_experts, block_m, case):
    ids = _uneven_loads(num_tokens, num_experts, top_k, case).to(DEVICE)
    kernel = align_by_expert(ids, num_experts, block_m, use_kernel=True)
    torch_ops = align_by_expert(ids, num_experts, block_m, use_kernel=False)
    assert torch.equal(kernel.sorted_pairs, torch_ops.sorted_pairs)
    assert torch.equal(kernel.block_expert, torch_ops.block_expert)


def test_torch_loop_matches_every_pair_formula():
    x, w13, w2 = randn(9, 24, seed=0), randn(5, 2 * 20, 24, seed=1, scale=0.3), randn(5, 24, 20, seed=2, scale=0.3)
    weights, ids = select_experts(randn(9, 5, seed=3), 2, renormalize=False)
    ref = every_pair_reference(x, w13, w2, weights, ids)
    assert relative_error(moe_experts_torch(x, w13, w2, weights, ids), ref) < 1e-6


def _uneven_loads(num_tokens: int, num_experts: int, top_k: int, case: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens)
    if case == "random":
        return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    if case == "one-expert-takes-all":  # every token picks expert 5 (slot 0); the rest only experts 1 and 2
        others = torch.randint(1, 3, (num_tokens, top_k - 1), generator=gen)
        return torch.cat([torch.full((num_tokens, 1), 5), others], dim=1) if top_k > 1 else torch.full(
            (num_tokens, 1), 5)
    if case == "skewed":  # experts 0 and last never picked; expert 3 picked by most tokens
        ids = torch.stack([torch.randperm(num_experts - 2, generator=gen)[:top_k] + 1 for _ in range(num_tokens)])
        ids[: 3 * num_tokens // 4, 0] = 3
        ids[: 3 * num_tokens // 4, 1:] = torch.where(ids[: 3 * num_tokens // 4, 1:] == 3, 4,
                                                      ids[: 3 * num_tokens // 4, 1:])
        return ids
    raise ValueError(case)


@pytest.mark.parametrize(("num_tokens", "top_k", "case", "tiles"), [
    (1, 2, "random", MoeTiles(16, 32, 32)),  # a decode step of one token: two experts, two row blocks
    (13, 2, "random", MoeTiles(16, 32, 32)),
    (13, 2, "skewed", MoeTiles(16, 64, 32)),  # empty experts; n tile past the intermediate size (masked)
    (40, 1, "one-expert-takes-all", MoeTiles(16, 32, 32)),  # one expert, three row blocks, the rest idle
    (40, 3, "one-expert-takes-all", MoeTiles(32, 32, 16)),
])
def test_grouped_gemms_match_the_torch_loop(num_tokens, top_k, case, tiles):
    num_experts, hidden, inter = 8, 48, 40  # not multiples of the tiles: K and N tails are masked
    x = randn(num_tokens, hidden, seed=1)
    w13 = randn(num_experts, 2 * inter, hidden, seed=2, scale=0.2)
    w2 = randn(num_experts, hidden, inter, seed=3, scale=0.2)
    ids = _uneven_loads(num_tokens, num_experts, top_k, case).to(DEVICE)
    weights = torch.rand(num_tokens, top_k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = fused_moe(x, w13, w2, weights, ids, tiles)
    assert out.shape == (num_tokens, hidden) and out.dtype == x.dtype
    ref = moe_experts_torch(x, w13, w2, weights, ids)
    assert relative_error(out, ref) < 1e-5
    assert relative_error(out.cpu(), every_pair_reference(x, w13, w2, weights, ids).cpu()) < 1e-5


def test_default_tiles_follow_the_batch():
    from nanovllm.kernels.fused_moe import choose_tiles

    assert choose_tiles(8, 128).block_m == 16  # decode: one token's 8 pairs
    assert choose_tiles(256 * 8, 128).block_m == 16  # 16 pairs per expert on average
    assert choose_tiles(8192 * 8, 128).block_m == 64  # a prefill chunk


# ---- GPU: bf16 at Qwen3-30B-A3B's shape, CUDA graphs ----------------------------------------------------------

QWEN3_30B = dict(num_experts=128, top_k=8, hidden=2048, inter=768)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 16, 256, 2048])
def test_bf16_at_qwen3_30b_shape(num_tokens):
    e, k, h, i = (QWEN3_30B[n] for n in ("num_experts", "top_k", "hidden", "inter"))
    x = randn(num_tokens, h, seed=0, dtype=torch.bfloat16)
    w13 = randn(e, 2 * i, h, seed=1, dtype=torch.bfloat16, scale=0.03)
    w2 = randn(e, h, i, seed=2, dtype=torch.bfloat16, scale=0.03)
    weights, ids = select_experts(randn(num_tokens, e, seed=3), k, renormalize=True)
    assert relative_error(fused_moe(x, w13, w2, weights, ids), moe_experts_torch(x, w13, w2, weights, ids)) < 1e-2


@pytest.mark.gpu
def test_layer_captures_in_a_cuda_graph():
    """No host synchronisation anywhere in the layer: a captured graph replays new routings correctly."""
    e, k, h, i = 16, 4, 256, 128
    x = randn(24, h, seed=0, dtype=torch.bfloat16)
    w13 = randn(e, 2 * i, h, seed=1, dtype=torch.bfloat16, scale=0.05)
    w2 = randn(e, h, i, seed=2, dtype=torch.bfloat16, scale=0.05)
    logits = randn(24, e, seed=3)
    run = lambda: fused_moe(x, w13, w2, *select_experts(logits, k, renormalize=True))  # noqa: E731
    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    logits.copy_(randn(24, e, seed=4))
    graph.replay()
    expected = moe_experts_torch(x, w13, w2, *select_experts(logits, k, renormalize=True))
    assert relative_error(out, expected) < 1e-2
