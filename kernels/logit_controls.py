"""The logit controls' per-step device work besides the penalties (`penalties.py`), one launch per op.

`nanovllm.layers.logit_controls` states each op's rule and runs the same ops in torch elsewhere; the kernels give
its results bit for bit. Each replaces several small torch ops (gathers, an accumulating index_put that sorts its
indices, a cat), whose launches cost a step more host time than their device work.

- `record_history`: after sampling, each staged row's token joins its slot's history (one program per row; the
  slots of one call are distinct, so no two programs touch the same state).
- `batch_index_map`: the persistent row -> batch index map of a step (-1 for rows not in it), one program.
- The sparse controls are entry lists keyed by persistent row, mapped to the step's rows through that map inside
  the kernel; an entry of a row not in the step does nothing. Bans store -inf and store nothing else, so entries
  repeating a (row, token) with different verdicts ban it in any order. logit_bias adds atomically: its tokens
  are unique per row (dict keys), so each logit takes one addition, the torch path's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

ENTRY_BLOCK = 256  # entries per program
WORD_BLOCK = 128  # bad-word entries per program, each with its [window] prefix


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


@triton.jit(do_not_specialize=["num_batch_rows", "num_rows"])
def _batch_index_kernel(batch_rows, num_batch_rows, inverse, num_rows, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK)
    for start in range(0, num_rows, BLOCK):
        tl.store(inverse + start + lanes, -1, mask=start + lanes < num_rows)
    tl.debug_barrier()  # the -1s land before any thread writes a batch index over them
    for start in range(0, num_batch_rows, BLOCK):
        at = start + lanes
        valid = at < num_batch_rows
        tl.store(inverse + tl.load(batch_rows + at, mask=valid, other=0), at.to(tl.int64), mask=valid)


def batch_index_map(batch_rows: torch.Tensor, num_rows: int, block: int = 1024) -> torch.Tensor:
    """int64 [num_rows]: for each persistent row its index in `batch_rows` (distinct rows, but for a padded
    step's padding row, which holds no controls: any of its indices), or -1."""
    inverse = torch.empty(num_rows, dtype=torch.int64, device=batch_rows.device)
    _batch_index_kernel[(1,)](batch_rows, len(batch_rows), inverse, num_rows, BLOCK=block, num_warps=4)
    return inverse


@triton.jit
def _entry_rows(batch_index, rows, at, valid):
    """Batch row of each entry (its persistent row mapped through batch_index), and whether it acts: a valid
    entry of a row in the step."""
    row = tl.load(batch_index + tl.load(rows + at, mask=valid, other=0), mask=valid, other=-1)
    return row, valid & (row >= 0)


@triton.jit(do_not_specialize=["num_entries"])
def _bad_words_kernel(logits, stride, batch_index, rows, slots, prefixes, banned, num_entries, recent, window,
                      BLOCK: tl.constexpr, WINDOW_BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row, acts = _entry_rows(batch_index, rows, at, at < num_entries)
    slot = tl.load(slots + at, mask=acts, other=0)
    lanes = tl.arange(0, WINDOW_BLOCK)[None, :]
    read = acts[:, None] & (lanes < window)
    prefix = tl.load(prefixes + at[:, None] * window + lanes, mask=read, other=-1)  # -1: matches any token
    tail = tl.load(recent + slot[:, None] * window + lanes, mask=read, other=-1)
    match = tl.min(((tail == prefix) | (prefix < 0)).to(tl.int32), axis=1) == 1
    token = tl.load(banned + at, mask=acts, other=0)
    tl.store(logits + row * stride + token, float("-inf"), mask=acts & match)


def ban_bad_words(logits: torch.Tensor, batch_index: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                  prefixes: torch.Tensor, banned: torch.Tensor, recent: torch.Tensor) -> None:
    """Entries (persistent row, history slot, prefix int64 [window] right-aligned and -1 padded, banned token):
    -inf where the slot's recent tokens (int64 [slots, window]) end with the prefix. Both tables contiguous."""
    if len(rows):
        window = recent.shape[1]
        _bad_words_kernel[(triton.cdiv(len(rows), WORD_BLOCK),)](
            logits, logits.stride(0), batch_index, rows, slots, prefixes, banned, len(rows), recent, window,
            BLOCK=WORD_BLOCK, WINDOW_BLOCK=triton.next_power_of_2(window), num_warps=4)


@triton.jit(do_not_specialize=["num_entries"])
def _min_tokens_kernel(logits, stride, batch_index, rows, stop_ids, min_tokens, num_entries, output_lens,
                       BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row, acts = _entry_rows(batch_index, rows, at, at < num_entries)
    short = tl.load(output_lens + row, mask=acts, other=0) < tl.load(min_tokens + at, mask=acts, other=0)
    token = tl.load(stop_ids + at, mask=acts, other=0)
    tl.store(logits + row * stride + token, float("-inf"), mask=acts & short)


def ban_until_min_tokens(logits: torch.Tensor, batch_index: torch.Tensor, rows: torch.Tensor,
                         stop_ids: torch.Tensor, min_tokens: torch.Tensor, output_lens: torch.Tensor) -> None:
    """Entries (persistent row, stop token, min_tokens): -inf while the batch row's output_lens is below
    min_tokens."""
    if len(rows):
        _min_tokens_kernel[(triton.cdiv(len(rows), ENTRY_BLOCK),)](
            logits, logits.stride(0), batch_index, rows, stop_ids, min_tokens, len(rows), output_lens,
            BLOCK=ENTRY_BLOCK, num_warps=4)


@triton.jit(do_not_specialize=["num_entries"])
def _bias_kernel(logits, stride, batch_index, rows, tokens, biases, num_entries, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row, acts = _entry_rows(batch_index, rows, at, at < num_entries)
    token = tl.load(tokens + at, mask=acts, other=0)
    tl.atomic_add(logits + row * stride + token, tl.load(biases + at, mask=acts, other=0.0), mask=acts)


def add_logit_bias(logits: torch.Tensor, batch_index: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor,
                   biases: torch.Tensor) -> None:
    """Entries (persistent row, token, float32 bias): the bias added to the logit."""
    if len(rows):
        _bias_kernel[(triton.cdiv(len(rows), ENTRY_BLOCK),)](logits, logits.stride(0), batch_index, rows, tokens,
                                                             biases, len(rows), BLOCK=ENTRY_BLOCK, num_warps=4)
