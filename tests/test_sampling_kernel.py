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
from nanovllm.layers.sampler import SamplingTensors, reference_sample  # noqa: E402

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
