"""The fused sampling kernel draws the same tokens as the torch path (`reference_sample`) for the same seeds.

Without CUDA the kernel runs in Triton's interpreter on small shapes; a small `cap` sends rows down the kernel's
large-kept-set path (exact threshold inside an interval, second search, final draw pass) as well."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels.sampling import fused_sample  # noqa: E402
from nanovllm.layers.sampler import reference_sample  # noqa: E402
from nanovllm.runner.inputs import SamplingTensors  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB = 1000
# (temperature, top_k, top_p, min_p); top_k None = off
SETTINGS = [
    (0.0, None, 1.0, 0.0), (1.0, None, 1.0, 0.0), (0.7, 50, 1.0, 0.0), (1.3, None, 0.9, 0.0),
    (1.0, 5, 0.8, 0.05), (0.9, 100, 0.95, 0.0), (1.0, None, 1.0, 0.1), (1.0, 700, 0.99, 0.0),
    (0.5, 20, 1.0, 0.0), (1.0, 1, 1.0, 0.0), (2.0, None, 0.5, 0.0), (1.0, None, 0.97, 0.02),
    (0.8, 50, 0.95, 0.0), (1.0, 300, 1.0, 0.3), (0.6, None, 0.3, 0.0), (1.1, 2, 0.6, 0.0),
]


def tensors(settings, vocab, seeds=None, positions=None):
    n = len(settings)
    columns = list(zip(*settings))
    return SamplingTensors(
        temperatures=torch.tensor(columns[0], dtype=torch.float32, device=DEVICE),
        top_k=torch.tensor([vocab if k is None else k for k in columns[1]], dtype=torch.int64, device=DEVICE),
        top_p=torch.tensor(columns[2], dtype=torch.float32, device=DEVICE),
        min_p=torch.tensor(columns[3], dtype=torch.float32, device=DEVICE),
        seeds=(torch.arange(n, dtype=torch.int64) * 7919 - 5 if seeds is None else seeds).to(DEVICE),
        sample_positions=(torch.arange(n, dtype=torch.int64) if positions is None else positions).to(DEVICE),
        all_greedy=False, any_filter=True)


def run_kernel(logits, t, **kwargs):
    return fused_sample(logits, t.temperatures, t.top_k, t.top_p, t.min_p, t.seeds, t.sample_positions, **kwargs)


@pytest.mark.parametrize("cap", [64, 16])
def test_kernel_equals_torch_path_fp32(cap):
    logits = torch.randn(len(SETTINGS), VOCAB, generator=torch.Generator().manual_seed(cap)).mul_(2).to(DEVICE)
    t = tensors(SETTINGS, VOCAB)
    assert run_kernel(logits, t, cap=cap, block=256).tolist() == reference_sample(logits, t).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_torch_path_half_with_ties_and_banned_tokens(dtype):
    """Integer-valued logits (many ties at every threshold) and -inf tokens, as logit controls leave them; row
    3 keeps only 5 finite tokens under top-k 50."""
    generator = torch.Generator().manual_seed(3)
    logits = torch.randint(-6, 7, (len(SETTINGS), VOCAB), generator=generator).to(dtype)
    logits[:, 100:160] = float("-inf")
    logits[2, :] = float("-inf")
    logits[2, torch.randperm(VOCAB, generator=generator)[:5]] = torch.randn(5, generator=generator).to(dtype)
    logits = logits.to(DEVICE)
    t = tensors(SETTINGS, VOCAB)
    assert run_kernel(logits, t, cap=32, block=256).tolist() == reference_sample(logits, t).tolist()


def test_kernel_tokens_do_not_depend_on_the_batch():
    """A seeded row draws the same token alone, at another batch index, and beside other rows."""
    generator = torch.Generator().manual_seed(11)
    logits = torch.randn(6, VOCAB, generator=generator).to(DEVICE)
    settings = [SETTINGS[i] for i in (2, 3, 4, 5, 7, 12)]
    seeds = torch.tensor([5, 6, 7, 8, 9, 10])
    positions = torch.tensor([3, 0, 9, 4, 4, 1])
    together = run_kernel(logits, tensors(settings, VOCAB, seeds, positions), cap=64, block=256)
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    shuffled = run_kernel(logits[order.to(DEVICE)], tensors([settings[i] for i in order], VOCAB, seeds[order],
                                                            positions[order]), cap=64, block=256)
    alone = run_kernel(logits[3:4], tensors(settings[3:4], VOCAB, seeds[3:4], positions[3:4]), cap=64, block=256)
    assert shuffled.tolist() == together[order.to(DEVICE)].tolist()
    assert alone.item() == together[3].item()
    moved = run_kernel(logits[3:4], tensors(settings[3:4], VOCAB, seeds[3:4], positions[3:4] + 1), cap=64,
                       block=256)
    other_draws = {run_kernel(logits[3:4], tensors(settings[3:4], VOCAB, seeds[3:4] + s, positions[3:4]), cap=64,
                              block=256).item() for s in range(1, 6)}
    assert len(other_draws | {moved.item(), alone.item()}) > 1  # the seed and the position do move the draw


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernel_equals_torch_path_at_real_shape(dtype):
    vocab, rows = 151936, 64
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(rows)]
    logits = (torch.randn(rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3)
    logits = logits.to(dtype)
    t = tensors(settings, vocab)
    kernel = run_kernel(logits, t)
    reference = reference_sample(logits, t)
    # float32 rounding of exp/log sums may move a knife-edge boundary token; tokens agree all but never
    assert (kernel == reference).float().mean().item() >= 63 / 64, (kernel, reference)


def test_a_row_with_every_token_banned_gets_token_0_on_every_path():
    """Logit controls can leave a row all -inf: every path answers 0, as the torch path's argmax does (the top-k
    path once returned an id past the vocabulary)."""
    settings = [(0.0, None, 1.0, 0.0), (0.8, None, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (0.8, 5, 0.9, 0.0),
                (0.8, None, 0.9, 0.0), (0.8, None, 1.0, 0.1)]
    logits = torch.full((len(settings), VOCAB), float("-inf"), device=DEVICE)
    t = tensors(settings, VOCAB)
    assert run_kernel(logits, t, cap=64, block=256).tolist() == reference_sample(logits, t).tolist() == [0] * 6


@pytest.mark.parametrize("config", [dict(cap=16, block=64), dict(cap=64, block=256), dict(cap=256, block=1024)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_top_k_rows_with_ties_banned_tokens_and_few_finite(config, dtype):
    """Integer-valued logits: ties at the k-th value (more than `cap` send the row to the wide kernel); banned
    tokens; rows with fewer finite tokens than k, with one finite token, and with none; the top tied across the
    row."""
    settings = [(0.8, 1, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (1.0, 8, 0.9, 0.0), (1.3, 16, 0.5, 0.2), (0.7, 50, 1.0, 0.0),
                (1.0, 64, 0.95, 0.0), (0.9, None, 1.0, 0.0), (0.9, 4, 1.0, 0.0), (0.9, 4, 0.8, 0.0),
                (0.9, None, 1.0, 0.0), (0.9, 3, 1.0, 0.0), (0.9, None, 1.0, 0.0), (0.8, 2, 0.9, 0.05)]
    generator = torch.Generator().manual_seed(5)
    logits = torch.randint(-40, 41, (len(settings), VOCAB), generator=generator).to(torch.float32) / 4
    logits[:, 300:420] = float("-inf")
    logits[6:8, :] = float("-inf")  # a few finite tokens, spread over the row
    logits[6:8, torch.tensor([3, 250, 251, 990])] = torch.tensor([1.0, 2.0, 2.0, -1.0])
    logits[8, :] = float("-inf")
    logits[8, 700] = 0.5  # a single finite token
    logits[9:11, :] = float("-inf")  # every token banned
    logits[11, :] = 7.0  # every token tied: the noise alone decides
    logits[12, 5:900:7] = 11.0  # the top tied across the row
    t = tensors(settings, VOCAB)
    logits = logits.to(dtype).to(DEVICE)
    assert run_kernel(logits, t, **config).tolist() == reference_sample(logits, t).tolist()


def test_first_kernel_finishes_every_untied_top_k_row_within_cap():
    """A top-k row of distinct logits with k <= cap is finished by the first kernel: its search runs until the
    kept set fits in cap, not merely until the search interval does (which left rows to the wide kernel, a
    second kernel as slow as the first)."""
    from nanovllm.kernels import sampling

    cap, rows = 16, 48
    settings = [(0.8, 4 + row % 12, 0.9 if row % 2 else 1.0, 0.0) for row in range(rows)]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(21)).mul_(3).to(DEVICE)
    t = tensors(settings, VOCAB)
    out = torch.full((rows,), -1, dtype=torch.int64, device=DEVICE)
    scratch = torch.empty(rows, cap, dtype=torch.int64, device=DEVICE)
    counters = torch.zeros(rows, 4, dtype=torch.int32, device=DEVICE)
    sampling._sample_kernel[(rows,)](logits, VOCAB, out, t.temperatures, t.top_k, t.top_p, t.min_p, t.seeds,
                                     t.sample_positions, scratch, counters, VOCAB, BLOCK=256, PIVOTS=sampling.PIVOTS,
                                     CAP=cap, MAX_PASSES=sampling.MAX_PASSES)
    assert out.tolist() == reference_sample(logits, t).tolist()


def test_first_kernel_falls_back_to_the_search_when_lane_maxima_mislead():
    """The first kernel's first try starts at the k-th largest per-lane maximum. Rows laid out against the
    lanes (block 64: lane j holds ids j, j + 64, ...) make that try gather too many tokens (the top of the row
    in one lane) or too few (every finite token in three lanes); the search over the row then finishes them."""
    block, cap = 64, 16
    settings = [(0.8, 2, 1.0, 0.0), (0.9, 3, 0.9, 0.0), (1.0, 8, 1.0, 0.0), (1.0, 10, 0.8, 0.0), (0.7, 5, 1.0, 0.0)]
    logits = torch.randn(len(settings), VOCAB, generator=torch.Generator().manual_seed(4))
    lane0 = torch.arange(0, VOCAB, block)
    for row in (0, 1):  # 16 tokens of lane 0 above every other lane's maximum: 17 or more at the 2nd/3rd lane max
        logits[row, lane0] = 50 + 0.1 * torch.arange(len(lane0), dtype=torch.float32)
        logits[row, 1] = 45.0
    for row in (2, 3):  # 48 finite tokens in lanes 0-2: the k-th lane maximum does not exist
        finite = torch.cat([lane0, lane0 + 1, lane0 + 2])
        values = logits[row, finite].clone()
        logits[row] = float("-inf")
        logits[row, finite] = values
    logits = logits.to(DEVICE)
    t = tensors(settings, VOCAB)
    assert run_kernel(logits, t, cap=cap, block=block).tolist() == reference_sample(logits, t).tolist()
