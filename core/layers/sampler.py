"""Token sampling: greedy, or temperature + top-k + top-p + min-p followed by a Gumbel-max draw.

The rule is stated in `nanovllm.kernels.sampling` (the fused Triton kernel that runs on CUDA). `reference_sample`
below is the same rule in torch, with a full sort: it runs on the CPU and is the kernel's test oracle, drawing the
same tokens for the same seeds. The noise of token i is a counter-based hash of (request seed, output index, i), so
a request's tokens depend only on its own logits, seed and position — never on what else is in the batch, the batch
order, or the step loop."""
from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Protocol

import torch

from nanovllm.kernels.noise import gumbel_noise


class SamplingSettings(Protocol):
    """Per-row sampling settings of one step, on the logits' device (the runner's step inputs hold them)."""

    temperatures: torch.Tensor  # float32 [batch]; 0 = greedy
    top_k: torch.Tensor  # int64 [batch]; >= vocab size = off
    top_p: torch.Tensor  # float32 [batch]; 1 = off
    min_p: torch.Tensor  # float32 [batch]; 0 = off
    seeds: torch.Tensor  # int64 [batch]
    sample_positions: torch.Tensor  # int64 [batch]: index of the output token being drawn
    all_greedy: bool
    any_filter: bool  # some row has top-k, top-p or min-p on (the torch path skips its sort without)


def kept_thresholds(logits: torch.Tensor, t: SamplingSettings) -> torch.Tensor:
    """float32 [batch]: each row keeps the tokens with logit >= this (the kernel's rule, by a full sort)."""
    batch, vocab = logits.shape
    inv_t = 1.0 / t.temperatures.float()
    row_max = logits.max(dim=-1).values
    threshold = torch.where(t.min_p > 0, row_max + t.temperatures * torch.log(t.min_p), float("-inf"))
    topk_on = t.top_k < vocab
    topp_on = t.top_p < 1
    if not (topk_on.any() or topp_on.any()):
        return threshold
    values = logits.sort(dim=-1, descending=True).values
    weights = torch.exp((values - row_max.unsqueeze(1)) * inv_t.unsqueeze(1))
    finite = torch.isfinite(values).sum(dim=-1)
    k = torch.minimum(t.top_k, finite).clamp_min(1)
    tau_k = torch.where(topk_on, values.gather(1, (k - 1).unsqueeze(1)).squeeze(1), float("-inf"))
    in_top_k = values >= tau_k.unsqueeze(1)
    survivors = torch.where(topk_on, (weights * in_top_k).sum(dim=-1),
                            torch.exp((logits - row_max.unsqueeze(1)) * inv_t.unsqueeze(1)).sum(dim=-1))
    cumulative = torch.cumsum(weights, dim=-1)
    lanes = torch.arange(vocab, device=logits.device)
    reaching = (cumulative >= (t.top_p * survivors).unsqueeze(1)) & in_top_k
    first = torch.where(reaching, lanes, vocab).min(dim=-1).values
    last = torch.where(in_top_k & torch.isfinite(values), lanes, 0).max(dim=-1).values
    tau_p = torch.where(topp_on, values.gather(1, torch.minimum(first, last).unsqueeze(1)).squeeze(1),
                        float("-inf"))
    return torch.maximum(threshold, torch.maximum(tau_k, tau_p))


def reference_sample(logits: torch.Tensor, t: SamplingSettings) -> torch.Tensor:
    """The sampling rule in torch: logits [batch, vocab], any float dtype -> token ids int64 [batch]."""
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    logits = logits.float()
    inv_t = 1.0 / t.temperatures.float()
    scores = logits * inv_t.unsqueeze(1) + gumbel_noise(t.seeds, t.sample_positions, logits.shape[1])
    if t.any_filter:
        scores = scores.masked_fill(logits < kept_thresholds(logits, t).unsqueeze(1), float("-inf"))
    return torch.where(t.temperatures == 0, greedy, scores.argmax(dim=-1))


def _use_kernel(logits: torch.Tensor) -> bool:
    return logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


# (temperature, top_k (0: off), top_p, min_p) of the warm-up rows: every path of the fused sampler
_WARM_UP_ROWS = [(0.0, 0, 1.0, 0.0), (0.8, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.05), (0.8, 50, 0.95, 0.0),
                 (0.7, 1000, 1.0, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 40, 0.8, 0.1)]


def warm_up_rows(device: torch.device, vocab_size: int) -> SamplingSettings:
    """Sampling settings of the warm-up batch (seeded rows), one per path of the sampler."""
    columns = list(zip(*_WARM_UP_ROWS))
    n = len(_WARM_UP_ROWS)
    return SimpleNamespace(
        temperatures=torch.tensor(columns[0], dtype=torch.float32, device=device),
        top_k=torch.tensor([k if 0 < k < vocab_size else vocab_size for k in columns[1]], dtype=torch.int64,
                           device=device),
        top_p=torch.tensor(columns[2], dtype=torch.float32, device=device),
        min_p=torch.tensor(columns[3], dtype=torch.float32, device=device),
        seeds=torch.arange(n, dtype=torch.int64, device=device), sample_positions=torch.zeros(n, dtype=torch.int64,
                                                                                             device=device),
        all_greedy=False, any_filter=True)


def warm_up_logits(device: torch.device, vocab_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[rows, vocab] logits of the warm-up batch: a fixed spread of values, as a model's logits lie."""
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(len(_WARM_UP_ROWS), vocab_size, generator=generator) * 3).to(device=device, dtype=dtype)


def warm_up_sampling(device: torch.device, vocab_size: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Run once everything a step's sampling can launch, on a small batch, so that Triton compiles it at engine
    start rather than inside the first job that needs it: the fused sampler on logits of the model's dtype and on
    float32 ones (what the logit controls hand it), the logit controls and penalties on float32 logits with the
    history update, and the logprobs of the model's dtype, and a structured-output mask. On the CPU the same
    entry points run their torch paths. Returns what each call produced, for a caller or a test to check: the
    tokens per logits dtype, the controlled logits, the logprobs and the masked logits."""
    from nanovllm.kernels.token_bitmask import apply_token_bitmask, bitmask_width
    from nanovllm.layers.logit_controls import warm_up_controls
    from nanovllm.layers.logprobs import compute_logprobs

    settings = warm_up_rows(device, vocab_size)
    results = {}
    for logits_dtype in dict.fromkeys((dtype, torch.float32)):
        results[f"tokens_{str(logits_dtype).removeprefix('torch.')}"] = sample(
            warm_up_logits(device, vocab_size, logits_dtype), settings)
    logits = warm_up_logits(device, vocab_size, torch.float32)
    warm_up_controls(logits)
    results["controlled_logits"] = logits
    raw = warm_up_logits(device, vocab_size, dtype)
    results["logprobs"] = compute_logprobs(raw, raw.argmax(dim=-1), 5).logprobs
    # A structured-output mask as narrow as a tokenizer's (one word short of the vocabulary), on row 1 only.
    masked = warm_up_logits(device, vocab_size, dtype)
    bitmask = torch.full((2, max(bitmask_width(vocab_size) - 1, 1)), -1, dtype=torch.int32, device=device)
    apply_token_bitmask(masked, bitmask, torch.tensor([-1, 1], dtype=torch.int64, device=device))
    results["masked_logits"] = masked
    return results


def sample(logits: torch.Tensor, t: SamplingSettings) -> torch.Tensor:
    """logits: [batch, vocab], any float dtype -> token ids int64 [batch]: the fused kernel on CUDA, the torch
    path elsewhere. Greedy rows take the argmax of the logits as they are (widening is exact, so it picks the same
    token as the float32 copy)."""
    if t.all_greedy:
        return logits.argmax(dim=-1)
    if _use_kernel(logits):
        from nanovllm.kernels.sampling import fused_sample
        return fused_sample(logits, t.temperatures, t.top_k, t.top_p, t.min_p, t.seeds, t.sample_positions)
    return reference_sample(logits, t)
