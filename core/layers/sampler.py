"""Token sampling: greedy, or temperature + top-k + top-p + min-p followed by an exponential race.

The race picks argmax(p_i / E_i) with E_i ~ Exp(1), which draws i with probability p_i. The E_i come from a
counter-based hash of (request seed, output index, vocabulary index), so a request's tokens depend only on its
own seed and position — never on what else is in the batch, the batch order, or the step loop."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from nanovllm.runner.step_buffers import SEQS, buffer

_MASK64 = (1 << 64) - 1


def _signed(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser: a bijection of 64-bit words with good avalanche (int64 arithmetic wraps)."""
    x = x ^ _shift_right(x, 30)
    x = x * _MIX1
    x = x ^ _shift_right(x, 27)
    x = x * _MIX2
    return x ^ _shift_right(x, 31)


def exponential_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) samples of shape [batch, vocab], a pure function of (seed, position, vocabulary index)."""
    row_keys = _mix(seeds * _GOLDEN + positions)
    vocab = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix(row_keys.unsqueeze(1) + vocab * _GOLDEN)
    # In (0, 1): the top value, (2^24 - 0.5) / 2^24, rounds to 1.0 in float32 and would give a noise of 0, so a
    # token of probability 0 (filtered or masked out) would race 0 / 0 = NaN, which argmax picks.
    uniform = ((_shift_right(bits, 40).to(torch.float32) + 0.5) * (1.0 / (1 << 24))).clamp_max_(1 - 2 ** -24)
    return -torch.log(uniform)


@dataclass
class SamplingTensors:
    """Per-row sampling settings of one step, already on the device."""

    temperatures: torch.Tensor = buffer(torch.float32, SEQS)  # [batch]; 0 = greedy
    top_k: torch.Tensor = buffer(torch.int64, SEQS)  # [batch]; vocab size = off
    top_p: torch.Tensor = buffer(torch.float32, SEQS)  # [batch]; 1 = off
    min_p: torch.Tensor = buffer(torch.float32, SEQS)  # [batch]; 0 = off
    seeds: torch.Tensor = buffer(torch.int64, SEQS)  # [batch]
    sample_positions: torch.Tensor = buffer(torch.int64, SEQS)  # [batch]: index of the output token being drawn
    all_greedy: bool
    any_filter: bool


def filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Softmax at each row's temperature, then top-k, top-p (on the top-k renormalised mass) and min-p masks."""
    probs = torch.softmax(logits / t.temperatures.clamp_min(1e-5).unsqueeze(1), dim=-1)
    if not t.any_filter:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[1], device=probs.device)
    drop = rank.unsqueeze(0) >= t.top_k.unsqueeze(1)
    kept = sorted_probs.masked_fill(drop, 0.0)
    mass_before = (kept.cumsum(dim=-1) - kept) / kept.sum(dim=-1, keepdim=True)
    drop |= mass_before >= t.top_p.unsqueeze(1)  # the most likely token always survives (its mass_before is 0)
    drop |= sorted_probs < t.min_p.unsqueeze(1) * sorted_probs[:, :1]
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))


def sample(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """logits: [batch, vocab], any float dtype -> token ids int64 [batch]. Greedy rows take the argmax of the
    logits as they are (widening is exact, so it picks the same token); the rest is computed in float32."""
    greedy = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy
    logits = logits.float()
    probs = filtered_probs(logits, t)
    raced = (probs / exponential_noise(t.seeds, t.sample_positions, logits.shape[1])).argmax(dim=-1)
    return torch.where(t.temperatures == 0, greedy, raced)
