"""The multi-LoRA kernels (kernels/lora.py, kernels/lora_dense.py): the slot-sorted layout checked by hand, the
torch reference (core/lora/layers.py `add_lora_torch`) against a gather-every-token formula, and the Triton
shrink/expand and the dense products against that reference on mixed batches: base-model rows (slot -1), slots
of several ranks zero-padded to the pool's rank, packed slices, empty segments, unsorted tokens, split-K. The
pools are stored as the layers store them (slot-second), every path reading their slot-first views.

Without CUDA the kernels run in Triton's interpreter on small shapes (float32, float16: the interpreter has no
bf16 tl.dot); `-m gpu` adds bf16 at Qwen3-8B's q|k|v shape and a CUDA-graph capture."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels.lora import LoRATiles, add_lora, sort_tokens_by_slot
from nanovllm.kernels.lora_dense import add_lora_dense, off_slot_mask
from nanovllm.lora.layers import add_lora_torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


class Pool:
    """A projection's adapter slots: `ranks[slot][slice]`, zero past each rank (as layers.py writes them)."""

    def __init__(self, ranks, widths, in_features, max_rank, dtype, seed):
        num_slots, num_slices = len(ranks), len(widths)
        starts = [0]
        for w in widths:
            starts.append(starts[-1] + w)
        self.starts, self.widths = starts, widths
        self.a = randn(num_slots, num_slices, max_rank, in_features, seed=seed, scale=in_features ** -0.5)
        self.b = randn(num_slots, starts[-1], max_rank, seed=seed + 1, scale=max_rank ** -0.5)
        for slot, slot_ranks in enumerate(ranks):
            for i, rank in enumerate(slot_ranks):
                self.a[slot, i, rank:] = 0
                self.b[slot, starts[i]:starts[i + 1], rank:] = 0
        # slot-second storage, slot-first views (as core/lora/layers.py keeps them)
        self.a = self.a.to(dtype).transpose(0, 1).contiguous().transpose(0, 1)
        self.b = self.b.to(dtype).transpose(0, 1).contiguous().transpose(0, 1)
        self.ranks = torch.tensor(ranks, dtype=torch.int32, device=DEVICE)
        self.starts_device = torch.tensor(starts, dtype=torch.int32, device=DEVICE)

    def kernel(self, y, x, slots, tiles=None, block_m=None):
        batch = sort_tokens_by_slot(slots, len(self.ranks), block_m)
        return add_lora(y, x, self.a, self.b, self.ranks, self.starts_device, max(self.widths), batch,
                        tiles)

    def dense(self, y, x, slots):
        off_slot = off_slot_mask(slots, torch.arange(len(self.ranks), device=DEVICE))
        return add_lora_dense(y, x, self.a, self.b, self.starts, off_slot)

    def reference(self, y, x, slots):
        return add_lora_torch(y, x, self.a, self.b, self.starts, slots)


def every_token_reference(y, x, pool, slots):
    """Each token through its slot's gathered matrices in float64: no grouping by slot, no loop."""
    keep = (slots >= 0).double()[:, None]
    gather = slots.clamp_min(0).long()
    a, b = pool.a.double()[gather], pool.b.double()[gather]
    out = y.double().clone()
    for i, (start, end) in enumerate(zip(pool.starts[:-1], pool.starts[1:])):
        s = torch.einsum("tk,trk->tr", x.double(), a[:, i])
        out[:, start:end] += keep * torch.einsum("tr,tnr->tn", s, b[:, start:end])
    return out


def segments(*runs):
    """Per-token slots from (slot, length) runs: prefill segments; a length of 0 is an empty segment."""
    return torch.cat([torch.full((n,), s, dtype=torch.int32) for s, n in runs]).to(DEVICE)


def relative_error(out, ref, base):
    """The error relative to the size of the update (the base output cancels)."""
    return ((out.double() - ref.double()).norm() / (ref.double() - base.double()).norm()).item()


def test_layout_by_hand():
    """Slots [1, -1, 1, 0, -1] of 2 slots, runs padded to 4 rows: base tokens 1, 4; slot 0: token 3; slot 1:
    tokens 0, 2; room for cdiv(5, 4) + min(3, 5) = 5 blocks, the last two unused."""
    batch = sort_tokens_by_slot(torch.tensor([1, -1, 1, 0, -1], device=DEVICE), max_loras=2, block_m=4)
    pad = 5
    assert batch.sorted_tokens.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, pad, pad]
    assert batch.block_group.tolist() == [0, 1, 2, -1, -1]
    assert batch.num_tokens == 5 and batch.block_m == 4


def test_torch_reference_matches_every_token_formula():
    pool = Pool([[8, 4, 0], [2, 8, 8], [8, 8, 8]], [12, 6, 6], in_features=20, max_rank=8, dtype=torch.float32, seed=0)
    slots = torch.tensor([2, -1, 0, 0, 1, -1, 2, 1, 0], device=DEVICE)
    x, y = randn(9, 20, seed=5), randn(9, 24, seed=6)
    ref = every_token_reference(y, x, pool, slots)
    out = pool.reference(y.clone(), x, slots)
    assert relative_error(out, ref, y) < 1e-6
    assert torch.equal(out[slots < 0], y[slots < 0])


# Slot ranks per case; the pool's rank is the last field. Slot 1 has no adapter on its second slice (rank 0).
MIXED_RANKS = [[16, 8, 16], [4, 0, 16], [16, 16, 16], [1, 2, 3]]
CASES = {
    # decode: one token per row, slots in row order (unsorted), base rows between them
    "decode": (lambda: torch.randint(-1, 4, (37,), generator=torch.Generator().manual_seed(0)).to(DEVICE),
               MIXED_RANKS, [24, 8, 8], 40, 16, None),
    "decode-split-k": (lambda: torch.randint(-1, 4, (37,), generator=torch.Generator().manual_seed(1)).to(DEVICE),
                       MIXED_RANKS, [24, 8, 8], 100, 16, LoRATiles(block_r=16, block_k=16, block_n=16, split_k=3)),
    # prefill segments of several adapters and the base model, an empty segment, one slot over several blocks
    "prefill-segments": (lambda: segments((1, 20), (-1, 7), (0, 0), (2, 33), (0, 5), (3, 0)),
                         MIXED_RANKS, [24, 8, 8], 40, 16, None),
    # an unpacked projection; rank 256 pool with slots of rank 200 and 17: several rank tiles, a partial one
    "rank-256": (lambda: segments((0, 5), (-1, 3), (1, 9)), [[200], [17]], [30], 24, 256, None),
    "all-base": (lambda: segments((-1, 19)), MIXED_RANKS, [24, 8, 8], 40, 16, None),
    "one-token": (lambda: segments((2, 1)), MIXED_RANKS, [24, 8, 8], 40, 16, None),
}


def check_against_reference(case, dtype, tolerance, path):
    """`path` ("kernel" or "dense") on a case's pool and slots against the torch reference."""
    make_slots, ranks, widths, in_features, max_rank, tiles = CASES[case]
    slots = make_slots()
    pool = Pool(ranks, widths, in_features, max_rank, dtype, seed=3)
    x = randn(len(slots), in_features, seed=7, dtype=dtype)
    y = randn(len(slots), sum(widths), seed=8, dtype=dtype)
    out = pool.kernel(y.clone(), x, slots, tiles) if path == "kernel" else pool.dense(y.clone(), x, slots)
    ref = pool.reference(y.clone(), x, slots)
    base = slots < 0
    assert torch.equal(out[base], y[base])  # base-model rows are not touched
    if not base.all():
        assert relative_error(out, ref, y) < tolerance


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.float16, 5e-3)], ids=["fp32", "fp16"])
@pytest.mark.parametrize("case", CASES)
def test_kernels_match_torch_reference(case, dtype, tolerance):
    check_against_reference(case, dtype, tolerance, "kernel")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_dense_update_matches_torch_reference(case, dtype, tolerance):
    """The dense products on the same pools (torch ops: on the CPU in bf16 too)."""
    check_against_reference(case, dtype, tolerance, "dense")


def test_dense_update_keeps_one_slots_overflow_from_other_tokens():
    """Every token is multiplied by every slot's A: a product that overflows in one slot (inf) must reach neither
    the base-model rows nor the other adapters' (0 * inf would be NaN)."""
    pool = Pool([[4], [4]], [6], in_features=8, max_rank=4, dtype=torch.float16, seed=0)
    pool.a[1, 0, 0] = 60000.0  # x @ A of slot 1 overflows float16
    slots = torch.tensor([0, -1, 1], device=DEVICE)
    x = torch.ones(3, 8, dtype=torch.float16, device=DEVICE)
    y = torch.zeros(3, 6, dtype=torch.float16, device=DEVICE)
    out = pool.dense(y.clone(), x, slots)
    assert torch.isfinite(out[:2]).all() and torch.equal(out[1], y[1])
    assert relative_error(out[:1], pool.reference(y.clone(), x, slots)[:1], y[:1]) < 5e-3


def test_dense_update_pays_for_small_pools_only():
    from nanovllm.kernels.lora_dense import DENSE_MAX_EXTRA, dense_extra_flops

    # Qwen3-8B's q|k|v with 8 slots: rank 16 and 64 add 9 % and 38 % of its FLOPs, rank 256 150 %.
    extra = [dense_extra_flops(8, 3, rank, 4096, 6144) for rank in (16, 64, 256)]
    assert [round(e, 3) for e in extra] == [0.094, 0.375, 1.5]
    assert [e <= DENSE_MAX_EXTRA for e in extra] == [True, True, False]


def test_empty_batch():
    pool = Pool(MIXED_RANKS, [24, 8, 8], 40, 16, torch.float32, seed=0)
    y = torch.empty(0, 40, device=DEVICE)
    assert pool.kernel(y, torch.empty(0, 40, device=DEVICE), torch.empty(0, dtype=torch.int32, device=DEVICE)) is y


@pytest.mark.parametrize("block_m", [16, 32])
def test_block_height_does_not_change_the_result(block_m):
    slots = segments((1, 20), (-1, 7), (2, 33), (0, 5))
    pool = Pool(MIXED_RANKS, [24, 8, 8], 40, 16, torch.float32, seed=4)
    x, y = randn(len(slots), 40, seed=1), randn(len(slots), 40, seed=2)
    out = pool.kernel(y.clone(), x, slots, block_m=block_m)
    assert relative_error(out, pool.reference(y.clone(), x, slots), y) < 1e-5


def test_default_tiles_follow_the_batch():
    from nanovllm.kernels.lora import choose_block_m, choose_tiles

    assert choose_block_m(8, max_loras=8) == 16  # decode: one token per row
    assert choose_block_m(256, max_loras=8) == 32  # 28 tokens per slot on average
    assert choose_block_m(8192, max_loras=8) == 64  # a prefill chunk
    # Qwen3-8B's q|k|v at rank 16: one decode row (2 blocks) splits K 8 ways, 256 rows (17 blocks) 5 ways, a
    # prefill chunk of 8192 tokens (137 blocks) not at all; rank 256 takes 4 tiles of 64.
    assert [choose_tiles(blocks, 3, 16, 4096).split_k for blocks in (2, 17, 137)] == [8, 5, 1]
    assert choose_tiles(2, 3, 256, 4096).block_r == 64


# ---- GPU: bf16 at Qwen3-8B's shape, CUDA graphs ---------------------------------------------------------------

QWEN3_8B_QKV = dict(widths=[4096, 1024, 1024], in_features=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 2048])
@pytest.mark.parametrize("max_rank", [16, 64])
def test_bf16_at_qwen3_8b_shape(num_tokens, max_rank):
    ranks = [[max_rank] * 3, [max_rank // 2] * 3, [8, 0, 8]] + [[max_rank] * 3] * 5
    pool = Pool(ranks, QWEN3_8B_QKV["widths"], QWEN3_8B_QKV["in_features"], max_rank, torch.bfloat16, seed=0)
    slots = torch.randint(-1, 8, (num_tokens,), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    x = randn(num_tokens, 4096, seed=1, dtype=torch.bfloat16)
    y = randn(num_tokens, 6144, seed=2, dtype=torch.bfloat16)
    out = pool.kernel(y.clone(), x, slots)
    if (slots >= 0).any():
        assert relative_error(out, pool.reference(y.clone(), x, slots), y) < 2e-2


@pytest.mark.gpu
def test_captures_in_a_cuda_graph():
    """No host synchronisation: a graph captured once replays new slot assignments correctly."""
    pool = Pool(MIXED_RANKS * 2, [256, 64, 64], 512, 16, torch.bfloat16, seed=0)
    slots = torch.full((64,), -1, dtype=torch.int32, device=DEVICE)
    x = randn(64, 512, seed=1, dtype=torch.bfloat16)
    base = randn(64, 384, seed=2, dtype=torch.bfloat16)
    y = base.clone()
    pool.kernel(y, x, slots)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(base)
        pool.kernel(y, x, slots)
    for seed in range(3):
        slots.copy_(torch.randint(-1, 8, (64,), generator=torch.Generator().manual_seed(seed)))
        graph.replay()
        assert relative_error(y, pool.reference(base.clone(), x, slots), base) < 2e-2
