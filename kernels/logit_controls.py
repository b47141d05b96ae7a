"""The logit controls' per-step device work besides the penalties (`penalties.py`), one launch per op.

`nanovllm.layers.logit_controls` states each op's rule and runs the same ops in torch elsewhere; the kernels give
its results bit for bit. Each replaces several small torch ops (gathers, an accumulating index_put that sorts its
indices, a cat), whose launches cost a step more host time than their device work.

- `record_history`: after sampling, each staged row's token joins its slot's history (one program per row; the
  slots of one call are distinct, so no two programs touch the same state).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _record_kernel(sampled, rows, slots, output_counts, counts_stride, prompt_mask, mask_stride, seen_tokens,
                   seen_stride, num_seen, recent, window, output_lens, WINDOW_BLOCK: tl.constexpr):
    index = tl.program_id(0)
    token = tl.load(sampled + tl.load(rows + index))
    slot = tl.load(slots + index)
    count_at = output_counts + slot * counts_stride + token
    count = tl.load(count_at)
    in_prompt = tl.load(prompt_mask + slot * mask_stride + token)
    listed = tl.load(num_seen + slot)
    # written past the list's end whether new or not, as the torch path does; only a new token extends the list
    tl.store(seen_tokens + slot * seen_stride + listed, token.to(tl.int32))
    tl.store(num_seen + slot, listed + ((count == 0) & (in_prompt == 0)).to(tl.int32))
    tl.store(count_at, count + 1)
    lanes = tl.arange(0, WINDOW_BLOCK)
    tail = recent + slot * window
    shifted = tl.load(tail + lanes + 1, mask=lanes < window - 1, other=token)
    tl.debug_barrier()  # every old token is read before another thread writes over it
    tl.store(tail + lanes, shifted, mask=lanes < window)
    tl.store(output_lens + slot, tl.load(output_lens + slot) + 1)


def record_history(sampled: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, output_counts: torch.Tensor,
                   prompt_mask: torch.Tensor, seen_tokens: torch.Tensor, num_seen: torch.Tensor,
                   recent: torch.Tensor, output_lens: torch.Tensor) -> None:
    """Slot slots[i] (distinct) records token sampled[rows[i]]: a token in neither its output counts nor its
    prompt mask joins its seen list, its count grows, it enters the recent window (int64 [slots, window],
    contiguous) from the right, and the output length grows."""
    if len(slots):
        window = recent.shape[1]
        _record_kernel[(len(slots),)](sampled, rows, slots, output_counts, output_counts.stride(0), prompt_mask,
                                      prompt_mask.stride(0), seen_tokens, seen_tokens.stride(0), num_seen, recent,
                                      window, output_lens, WINDOW_BLOCK=triton.next_power_of_2(window),
                                      num_warps=1)
