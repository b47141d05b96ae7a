"""Repetition, presence and frequency penalties on the tokens each row has seen, and on no other.

A penalty changes only the logits of tokens in the row's prompt or output (`nanovllm.layers.logit_controls`
keeps each row's distinct seen tokens as a list), so the kernel reads and writes those entries alone: a step costs
what the histories hold, not batch x vocabulary. One program per penalised row walks its list.

The arithmetic is the torch formula's, operation for operation (IEEE division, no fused multiply-add: the caller
launches with `enable_fp_fusion=False`), so the kernel's logits equal the torch path's bit for bit:
    x = x / repetition if x > 0 else x * repetition
    x = x - (frequency * count + presence * (count > 0))
with count the token's number of occurrences in the output (0 for a prompt-only token).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _penalties_kernel(logits, stride, rows, slots, repetition, presence, frequency, seen_tokens, seen_stride,
                      num_seen, counts, counts_stride, BLOCK: tl.constexpr):
    index = tl.program_id(0)
    row = tl.load(rows + index)
    slot = tl.load(slots + index)
    penalty = tl.load(repetition + index)
    present = tl.load(presence + index)
    frequent = tl.load(frequency + index)
    base = logits + row * stride
    for start in range(0, tl.load(num_seen + slot), BLOCK):
        lanes = start + tl.arange(0, BLOCK)
        valid = lanes < tl.load(num_seen + slot)
        token = tl.load(seen_tokens + slot * seen_stride + lanes, mask=valid, other=0).to(tl.int64)
        count = tl.load(counts + slot * counts_stride + token, mask=valid, other=0).to(tl.float32)
        x = tl.load(base + token, mask=valid, other=0.0)
        x = tl.where(x > 0.0, tl.math.div_rn(x, penalty), x * penalty)
        x = x - (frequent * count + present * (count > 0.0).to(tl.float32))
        tl.store(base + token, x, mask=valid)


def apply_history_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                            presence: torch.Tensor, frequency: torch.Tensor, seen_tokens: torch.Tensor,
                            num_seen: torch.Tensor, output_counts: torch.Tensor, block: int = 1024) -> None:
    """In place on float32 logits [batch, vocab] (unit stride along vocab): rows [n] and their history slots [n],
    penalties float32 [n]; seen_tokens int32 [slots, capacity] of which the first num_seen [slots] are a slot's
    distinct seen tokens; output_counts int32 [slots, vocab]."""
    if len(rows):
        _penalties_kernel[(len(rows),)](logits, logits.stride(0), rows, slots, repetition, presence, frequency,
                                        seen_tokens, seen_tokens.stride(0), num_seen, output_counts,
                                        output_counts.stride(0), BLOCK=block, num_warps=4, enable_fp_fusion=False)
