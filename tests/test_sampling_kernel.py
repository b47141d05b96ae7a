"""The fused sampling kernels draw the same tokens as the torch path (`reference_sample`) for the same seeds, on
every kind of logits scripts/bench_sampler.py times (normal, zipf, all equal, ties in bf16, peaked, flat, huge
magnitudes, few finite, a mixed batch), and they take their bounded path for every row.

Without CUDA the kernels run in Triton's interpreter on small shapes: 4096 logits over 256 lanes with the narrow
path up to top-k 128, so the scratch (2048 slots) holds half the row and the wide rows' sample brackets are as wide,
in sample ranks, as at the real shape (0.3 * NARROW)."""
import importlib.util
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from nanovllm.kernels import sampling  # noqa: E402
from nanovllm.kernels.sampling import fused_sample  # noqa: E402
from nanovllm.layers.sampler import reference_sample  # noqa: E402
from nanovllm.runner.inputs import SamplingTensors  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
VOCAB, BLOCK, NARROW = 4096, 256, 128
CONFIG = dict(block=BLOCK, narrow=NARROW)
# (temperature, top_k, top_p, min_p); top_k None = off. Top-k <= NARROW takes the narrow path, the rest the wide one.
SETTINGS = [
    (0.0, None, 1.0, 0.0), (1.0, None, 1.0, 0.0), (1.0, None, 1.0, 0.1), (0.7, 1, 1.0, 0.0), (1.1, 2, 0.6, 0.0),
    (1.0, 5, 0.8, 0.05), (0.7, 50, 1.0, 0.0), (0.8, 50, 0.95, 0.0), (0.9, 128, 0.9, 0.0), (1.0, 300, 1.0, 0.3),
    (1.0, 700, 0.99, 0.0), (1.2, 1500, 1.0, 0.0), (0.6, None, 0.3, 0.0), (2.0, None, 0.5, 0.0),
    (1.3, None, 0.9, 0.0), (0.8, None, 0.95, 0.0), (1.0, None, 0.99, 0.02), (0.9, None, 0.999, 0.0),
]


def tensors(settings, vocab=VOCAB, seeds=None, positions=None):
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


def run_kernel(logits, t, **config):
    return fused_sample(logits, t.temperatures, t.top_k, t.top_p, t.min_p, t.seeds, t.sample_positions,
                        **(config or CONFIG))


def run_stages(logits, t, block=BLOCK, narrow=NARROW):
    """(`out` after the first kernel, whether the wide kernel's search finished each row, the tokens)."""
    batch, vocab = logits.shape
    slots = sampling.scratch_slots(vocab, block, narrow)
    out = torch.empty(batch, dtype=torch.int64, device=DEVICE)
    scratch = torch.empty(batch, slots, dtype=torch.int64, device=DEVICE)
    counters = torch.zeros(batch, 4, dtype=torch.int32, device=DEVICE)
    args = (logits, logits.stride(0), out, t.temperatures, t.top_k, t.top_p, t.min_p, t.seeds, t.sample_positions,
            scratch, counters, vocab, slots)
    config = dict(BLOCK=block, CHUNK=sampling.CHUNK, PIVOTS=sampling.PIVOTS, num_warps=sampling.DEFAULT_WARPS)
    sampling._sample_kernel[(batch,)](*args, NARROW=min(narrow, block), **config)
    first = out.clone()
    sampling._sample_wide_kernel[(batch,)](*args, SEARCH_PIVOTS=sampling.PIVOTS_SEARCH, SEARCH_CAP=sampling.SEARCH_CAP,
                                           MAX_PASSES=sampling.MAX_PASSES, **config)
    return first, counters[:, 3] == 1, out


def load_bench():
    """scripts/bench_sampler.py, which defines the kinds of logits it times (the same ones are tested here)."""
    path = Path(__file__).resolve().parent.parent / "scripts" / "bench_sampler.py"
    spec = importlib.util.spec_from_file_location("bench_sampler", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = load_bench()
KINDS = BENCH.SYNTHETIC


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_samples_as_the_torch_path_on_its_bounded_path(kind):
    """Every setting on one kind (bf16 where it holds the values, else float32; scripts/bench_sampler.py times the
    same kinds at the real shape): the kernels' tokens are the torch path's, and no row needs the search fallback
    (the brackets hold on every kind)."""
    generator = torch.Generator().manual_seed(KINDS.index(kind))
    logits = BENCH.logits_of_kind(kind, len(SETTINGS), VOCAB, generator).to(DEVICE, BENCH.kind_dtype(kind))
    t = tensors(SETTINGS)
    _, searched, out = run_stages(logits, t)
    assert out.tolist() == reference_sample(logits, t).tolist()
    assert not searched.any(), [SETTINGS[i] for i in searched.nonzero()]


def test_a_mixed_batch_samples_as_the_torch_path():
    """Rows of every kind and setting in one batch, float32 and bf16."""
    rows = 32
    logits = BENCH.mixed_logits(rows, VOCAB, torch.Generator().manual_seed(99))
    settings = [SETTINGS[(5 * row) % len(SETTINGS)] for row in range(rows)]  # every setting, every kind
    t = tensors(settings)
    for dtype in (torch.float32, torch.bfloat16):
        x = logits.to(dtype).to(DEVICE)
        assert run_kernel(x, t).tolist() == reference_sample(x, t).tolist()


def test_a_missed_bracket_falls_back_to_the_search():
    """A wide row whose sample misleads its bracket (every logit but the sampled ones is high) is finished by the
    exact search, with the torch path's token."""
    settings = [(1.0, None, 0.9, 0.0), (0.8, 900, 1.0, 0.0)]
    logits = torch.randn(len(settings), VOCAB, generator=torch.Generator().manual_seed(3))
    lanes = torch.arange(VOCAB) % BLOCK
    sampled = (torch.arange(VOCAB) // BLOCK) == lanes % (VOCAB // BLOCK)  # the sample's positions
    logits[:, ~sampled] += 6.0  # the sample sees only low logits: it places both thresholds too low
    logits = logits.to(DEVICE)
    t = tensors(settings)
    _, searched, out = run_stages(logits, t)
    assert searched.all()
    assert out.tolist() == reference_sample(logits, t).tolist()


def test_kernel_tokens_do_not_depend_on_the_batch():
    """A seeded row draws the same token alone, at another batch index, and beside other rows."""
    generator = torch.Generator().manual_seed(11)
    logits = (torch.randn(6, VOCAB, generator=generator) * 2).to(DEVICE)
    settings = [SETTINGS[i] for i in (4, 7, 10, 13, 15, 9)]
    seeds = torch.tensor([5, 6, 7, 8, 9, 10])
    positions = torch.tensor([3, 0, 9, 4, 4, 1])
    together = run_kernel(logits, tensors(settings, seeds=seeds, positions=positions))
    order = torch.tensor([4, 1, 5, 0, 3, 2])
    shuffled = run_kernel(logits[order.to(DEVICE)], tensors([settings[i] for i in order], seeds=seeds[order],
                                                            positions=positions[order]))
    alone = run_kernel(logits[3:4], tensors(settings[3:4], seeds=seeds[3:4], positions=positions[3:4]))
    assert shuffled.tolist() == together[order.to(DEVICE)].tolist()
    assert alone.item() == together[3].item()
    other_draws = {run_kernel(logits[3:4], tensors(settings[3:4], seeds=seeds[3:4] + s, positions=positions[3:4])
                              ).item() for s in range(1, 5)}
    assert len(other_draws | {alone.item()}) > 1  # the seed does move the draw


def test_a_row_with_every_token_banned_gets_token_0_on_every_path():
    """Logit controls can leave a row all -inf: every path answers 0, as the torch path's argmax does."""
    settings = [(0.0, None, 1.0, 0.0), (0.8, None, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (0.8, 5, 0.9, 0.0),
                (0.8, None, 0.9, 0.0), (0.8, None, 1.0, 0.1), (0.8, 900, 1.0, 0.0)]
    logits = torch.full((len(settings), VOCAB), float("-inf"), device=DEVICE)
    t = tensors(settings)
    assert run_kernel(logits, t).tolist() == reference_sample(logits, t).tolist() == [0] * len(settings)


def test_top_k_rows_laid_out_against_the_lanes():
    """The narrow path's bound holds however the logits lie: the top of each row in one lane (ids j, j + 256,
    ...) makes the k-th largest lane maximum low, and every token above it is still gathered; rows whose finite
    logits all lie in three lanes have fewer than k finite lane maxima."""
    settings = [(0.8, 2, 1.0, 0.0), (0.9, 3, 0.9, 0.0), (1.0, 8, 1.0, 0.0), (1.0, 10, 0.8, 0.0), (0.7, 100, 1.0, 0.0)]
    logits = torch.randn(len(settings), VOCAB, generator=torch.Generator().manual_seed(4))
    lane0 = torch.arange(0, VOCAB, BLOCK)
    for row in (0, 1, 4):
        logits[row, lane0] = 50 + 0.1 * torch.arange(len(lane0), dtype=torch.float32)
        logits[row, 1] = 45.0
    for row in (2, 3):
        finite = torch.cat([lane0, lane0 + 1, lane0 + 2])
        values = logits[row, finite].clone()
        logits[row] = float("-inf")
        logits[row, finite] = values
    logits = logits.to(DEVICE)
    t = tensors(settings)
    first, _, out = run_stages(logits, t)
    assert (first >= 0).all()  # the first kernel finished every row
    assert out.tolist() == reference_sample(logits, t).tolist()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_kernel_equals_torch_path_at_real_shape(dtype):
    vocab, rows = 151936, 64
    settings = [SETTINGS[i % len(SETTINGS)] for i in range(rows)]
    logits = (torch.randn(rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3)
    logits = logits.to(dtype)
    t = tensors(settings, vocab)
    kernel = run_kernel(logits, t, block=sampling.DEFAULT_BLOCK)
    reference = reference_sample(logits, t)
    # float32 rounding of exp/log sums may move a knife-edge boundary token; tokens agree all but never
    assert (kernel == reference).float().mean().item() >= 63 / 64, (kernel, reference)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["normal", "zipf", "ties_bf16"])
def test_top_p_rows_at_real_shape_stay_on_the_bounded_path(kind):
    """The rows of the GPU test below that take the wide kernel's sampled bracket (top-p without top-k), at the
    real shape: a top-heavy row whose min-p threshold lies far above its top-p threshold, a threshold far down a
    Zipf tail (p 0.999), and low-precision logits whose threshold falls in a tie group of thousands of tokens all
    once took the exact search."""
    vocab = 151936
    every = SETTINGS * 4
    logits = BENCH.logits_of_kind(kind, len(every), vocab, torch.Generator().manual_seed(1))
    rows = [i for i, (_, k, p, _) in enumerate(every) if k is None and p < 1]
    logits = logits[rows].to(DEVICE, BENCH.kind_dtype(kind))
    t = tensors([every[i] for i in rows], vocab, seeds=torch.tensor(rows) * 7919 - 5, positions=torch.tensor(rows))
    _, searched, out = run_stages(logits, t, block=sampling.DEFAULT_BLOCK, narrow=sampling.NARROW_K)
    assert not searched.any(), [every[rows[i]] for i in searched.nonzero()]
    assert (out == reference_sample(logits, t)).float().mean().item() >= 23 / 24


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_every_kind_at_real_shape_on_its_bounded_path(kind):
    """Every setting on every kind at the real shape (vocab 151,936, the default blocks): the torch path's tokens
    but for knife-edge rounding (the kernels sum masses in another order), and no row needs the exact search."""
    vocab = 151936
    settings = SETTINGS * 4
    logits = BENCH.logits_of_kind(kind, len(settings), vocab, torch.Generator().manual_seed(1))
    logits = logits.to("cuda", BENCH.kind_dtype(kind))
    t = tensors(settings, vocab)
    _, searched, out = run_stages(logits, t, block=sampling.DEFAULT_BLOCK, narrow=sampling.NARROW_K)
    assert not searched.any(), [settings[i] for i in searched.nonzero()]
    assert (out == reference_sample(logits, t)).float().mean().item() >= 70 / 72
