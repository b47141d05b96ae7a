"""Logprobs of the raw distribution in two short kernels: each token's log_softmax and rank, and the row's top tokens.

A row is cut into segments of SEGMENT logits, one program each, so that a batch of rows keeps every SM busy (one
program per row leaves most of the GPU waiting on the latency of its loads). A segment's program writes its
partials: maximum, mass relative to it, how many of its logits are >= the row's token's, and its `num_top` best
tokens as slots (`order_keys.py`: a logit and its id in one int64 whose order is larger logit, then smaller id, so
one max reduction takes each). One program per row then combines them: the row maximum and mass give log Z; the
ranks add up; the row's best `num_top` lie among the segments' bests, since a token beaten inside its segment by
`num_top` others is beaten by as many in the row. Ties order by id, as a stable descending sort does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.order_keys import NO_KEY, slot_key, slot_parts

SEGMENT = 1024  # logits per program of the first kernel, one warp each: its reductions need no barrier
SEGMENT_WARPS = 1
# Most top tokens a call may ask for (the partials are laid out for this many): each costs every segment a
# reduction, so past a few a radix top-k over the row (torch.topk) is faster.
MAX_TOP = 8


@triton.jit
def _take_best(slots, num_top, MAX_TOP: tl.constexpr):
    """The num_top largest of int64 slots (`order_keys.slot_key`: larger value, then smaller id, first) as a
    [MAX_TOP] vector, NO_KEY past num_top: one max reduction per token taken."""
    index = tl.arange(0, MAX_TOP)
    top = tl.full([MAX_TOP], NO_KEY, tl.int64)
    for i in range(num_top):
        best = tl.max(slots, axis=0)
        top = tl.where(index == i, best, top)
        slots = tl.where(slots == best, NO_KEY, slots)  # slots are distinct: only the one taken
    return top


# One compile for every num_top (1 included) and for token ids at any offset (a prompt's chunk of them).
@triton.jit(do_not_specialize=["token_ids", "num_top"])
def _segment_kernel(logits, stride, token_ids, seg_max, seg_mass, seg_rank, seg_slots, vocab, num_top, num_segments,
                    SEGMENT: tl.constexpr, MAX_TOP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    segment = tl.program_id(1)
    base = logits + row * stride
    chosen = tl.load(base + tl.load(token_ids + row)).to(tl.float32)
    cols = segment * SEGMENT + tl.arange(0, SEGMENT)
    valid = cols < vocab
    x = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32)
    top = tl.max(x, axis=0)
    mass = tl.sum(tl.exp(x - tl.where(top > float("-inf"), top, 0.0)), axis=0)  # a segment of -inf only: 0
    out = row * num_segments + segment
    tl.store(seg_max + out, top)
    tl.store(seg_mass + out, mass)
    tl.store(seg_rank + out, tl.sum((valid & (x >= chosen)).to(tl.int32), axis=0))
    if num_top > 0:
        best = _take_best(tl.where(valid, slot_key(x, cols), NO_KEY), num_top, MAX_TOP)
        tl.store(seg_slots + out * MAX_TOP + tl.arange(0, MAX_TOP), best)


@triton.jit(do_not_specialize=["token_ids", "num_top"])
def _combine_kernel(logits, stride, token_ids, seg_max, seg_mass, seg_rank, seg_slots, out_logprob, out_rank,
                    out_log_z, top_ids, top_logprobs, num_top, num_segments, SEGMENTS: tl.constexpr,
                    MAX_TOP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    segments = tl.arange(0, SEGMENTS)
    valid = segments < num_segments
    partial = row * num_segments + segments
    tops = tl.load(seg_max + partial, mask=valid, other=float("-inf"))
    row_max = tl.max(tops, axis=0)
    shift = tl.where(row_max > float("-inf"), row_max, 0.0)
    masses = tl.load(seg_mass + partial, mask=valid, other=0.0)
    log_z = shift + tl.log(tl.sum(tl.where(masses > 0.0, masses * tl.exp(tops - shift), 0.0), axis=0))
    chosen = tl.load(logits + row * stride + tl.load(token_ids + row)).to(tl.float32)
    tl.store(out_logprob + row, chosen - log_z)
    tl.store(out_log_z + row, log_z)
    tl.store(out_rank + row, tl.sum(tl.load(seg_rank + partial, mask=valid, other=0), axis=0).to(tl.int64))
    if num_top > 0:
        lanes = tl.arange(0, MAX_TOP)
        slots = tl.load(seg_slots + partial[:, None] * MAX_TOP + lanes[None, :],
                        mask=valid[:, None] & (lanes[None, :] < num_top), other=NO_KEY)
        _, values, ids = slot_parts(_take_best(tl.reshape(slots, [SEGMENTS * MAX_TOP]), num_top, MAX_TOP))
        keep = lanes < num_top
        tl.store(top_ids + row * num_top + lanes, ids, mask=keep)
        tl.store(top_logprobs + row * num_top + lanes, values - log_z, mask=keep)


def logprobs_and_top(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int, segment: int = SEGMENT,
                     num_warps: int = SEGMENT_WARPS) -> tuple[torch.Tensor, ...]:
    """logits [rows, vocab] (unit stride along vocab), token_ids int64 [rows], 0 <= num_top <= MAX_TOP ->
    (float32 logprob of each token under log_softmax of the float32 logits, int64 rank, int64 top ids
    [rows, num_top] most likely first, float32 their logprobs, float32 each row's log Z), with no float32 copy
    of the logits."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "logits must be contiguous along the vocabulary"
    assert 0 <= num_top <= min(MAX_TOP, vocab), num_top
    device = logits.device
    logprob = torch.empty(rows, dtype=torch.float32, device=device)
    rank = torch.empty(rows, dtype=torch.int64, device=device)
    log_z = torch.empty(rows, dtype=torch.float32, device=device)
    top_ids = torch.empty(rows, num_top, dtype=torch.int64, device=device)
    top_logprobs = torch.empty(rows, num_top, dtype=torch.float32, device=device)
    if rows == 0:
        return logprob, rank, top_ids, top_logprobs, log_z
    num_segments = triton.cdiv(vocab, segment)
    count = rows * num_segments
    # maxima, masses and ranks (int32 bits) in one buffer whose rows start 16-byte aligned whatever the count:
    # Triton compiles a variant per pointer alignment, which the batch's row count would otherwise pick
    seg_max, seg_mass, seg_rank = torch.empty(3, -(-count // 4) * 4, dtype=torch.float32, device=device)[:, :count]
    seg_rank = seg_rank.view(torch.int32)
    seg_slots = torch.empty(count if num_top else 0, MAX_TOP, dtype=torch.int64, device=device)
    _segment_kernel[(rows, num_segments)](logits, logits.stride(0), token_ids, seg_max, seg_mass, seg_rank, seg_slots,
                                          vocab, num_top, num_segments, SEGMENT=segment, MAX_TOP=MAX_TOP,
                                          num_warps=num_warps)
    _combine_kernel[(rows,)](logits, logits.stride(0), token_ids, seg_max, seg_mass, seg_rank, seg_slots, logprob,
                             rank, log_z, top_ids, top_logprobs, num_top, num_segments,
                             SEGMENTS=triton.next_power_of_2(num_segments), MAX_TOP=MAX_TOP, num_warps=4)
    return logprob, rank, top_ids, top_logprobs, log_z
