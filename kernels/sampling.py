"""Fused sampling: temperature, top-k, top-p, min-p (any mix per row) and greedy rows.

The rule (the torch path `nanovllm.layers.sampler.reference_sample` states it the same way and is the oracle):

- temperature 0: the argmax of the raw logits (first index on ties).
- otherwise, on fp32 logits `x`, with `inv_t = 1 / temperature` and the row maximum `m`:
  * top-k (on when k < vocab): tau_k = the k-th largest logit; every token tied with it is kept too.
  * top-p (on when p < 1), over the top-k survivors renormalised: with w = exp((x - m) * inv_t) and M the mass of
    the top-k survivors, tau_p = the largest logit v with mass(x >= v) >= p * M.
  * min-p (on when min_p > 0): tau_min = m + temperature * log(min_p), i.e. p_i >= min_p * p_max.
  * the kept set is x >= max(tau_k, tau_p, tau_min); the token is the Gumbel-max winner over it:
    argmax of x * inv_t + g_i, first index on ties, with g_i = -log(-log(u_i)) and u_i a function of
    (row seed, output position, token id) only: `u_i = (2 * (h_i >> 9) + 1) / 2**24` with the 32-bit hash
    `h_i = mix32(row_key ^ (i * GOLDEN))`, `row_key = mix32(mix32(mix32(seed_lo ^ SALT) ^ seed_hi) ^ position)`.
    A seeded row's token therefore depends on its logits, seed and position only, never on the batch.

One program per row. How the kernels avoid sorting the vocabulary: after one pass for (max, finite min, softmax
mass) the kernel searches the threshold of the first active filter (count mode for top-k, mass mode for top-p) with
PIVOTS thresholds per pass over the row, narrowing [lo, hi) (lo satisfies the filter's target, hi does not). For a
top-k of at most CAP the first kernel tries first, with no search pass, a lo at or below the min(k, finite)-th
largest of the stats pass's per-lane maxima, with at most max(k, CAP / 4) lanes at or above it (found in registers;
the smallest finite logit when at most CAP are finite): when that many lanes hold a finite maximum, at least min(k,
finite) tokens lie at or above it, and for logits not laid out against the lanes not many more than lanes. Once at
least min(k, finite) and at most CAP tokens lie at or above lo (from that try, else from the search), it gathers
them (value, id) into a per-row scratch, sorts those in registers and finishes every threshold and the Gumbel-max
draw there: no further pass. Temperature-only rows take a single pass (draw over all), min-p-only rows two.

Rows with top-k > CAP or top-p without top-k, and top-k rows whose search still has more than CAP tokens at or
above lo (ties, or MAX_PASSES), are left by that first kernel to a second one, which every other row leaves at
once: the interval [lo, hi), once it holds at most CAP tokens, is sorted to place the threshold exactly, a second
search places top-p after top-k when both are on, and one last pass draws over the kept set. A row whose search
interval still holds more than CAP tokens after MAX_PASSES passes (thousands of distinct logits within a relative
width of 1e-9) keeps that whole interval. Two kernels rather than one: the rare path's registers would otherwise
bound the common path's passes.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import noise

# jit functions read module globals only as constexpr
MIX_A = tl.constexpr(noise.MIX_A)
MIX_B = tl.constexpr(noise.MIX_B)
GOLDEN = tl.constexpr(noise.GOLDEN)
SALT = tl.constexpr(noise.SALT)

# One program per row must keep its own loads in flight. The best of scripts/bench_sampler.py --sweep on the H100
# (2026-11-25, batch 256, vocab 151,936): 4096-logit blocks over 16 warps with 512-token gathers, top-k 50 +
# top-p 0.95 0.346 ms (8192 / 16 / 1024 before: 0.380), top-p alone 1.105 (1.248); within 0.02 ms of the best
# configuration in every mode timed. With the lane-maximum start (2026-11-26, H100): top-k 50 + top-p 0.95 at batch
# 256, 0.20-0.22 ms for logits of std 1, 3 and 6 (docs/BENCHMARKS.md).
DEFAULT_CAP = 512
DEFAULT_BLOCK = 4096
DEFAULT_WARPS = 16
PIVOTS = 8
MAX_PASSES = 12


@triton.jit
def _mix32(x):
    x = x ^ (x >> 16)
    x = x * tl.full([], MIX_A, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full([], MIX_B, tl.uint32)
    return x ^ (x >> 15)


@triton.jit
def _row_key(seed, position):
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    key = _mix32(seed_lo ^ tl.full([], SALT, tl.uint32))
    key = _mix32(key ^ seed_hi)
    return _mix32(key ^ (position & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _gumbel(row_key, token):
    bits = _mix32(row_key ^ (token.to(tl.uint32) * tl.full([], GOLDEN, tl.uint32)))
    uniform = ((bits >> 9).to(tl.float32) * 2.0 + 1.0) * (1.0 / 16777216.0)
    return -tl.log(-tl.log(uniform))


@triton.jit
def _load(base, start, vocab, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    return tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32), cols


@triton.jit
def _first_best(best, best_id, vocab):
    """The largest of per-lane bests and, on ties, the smallest id: each lane kept its first best, and a lane's
    ids only grow."""
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_id, vocab), axis=0).to(tl.int64)


@triton.jit
def _take_better(score, cols, best, best_id):
    take = score > best
    return tl.where(take, score, best), tl.where(take, cols, best_id)


@triton.jit
def _argmax_pass(base, vocab, BLOCK: tl.constexpr):
    # Per-lane running bests, reduced across the program once at the end: a reduction per block would cost a
    # barrier and a shared-memory round trip per block, which bounds a pass more than its loads.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        best, best_id = _take_better(x, cols, best, best_id)
    return _first_best(best, best_id, vocab)


@triton.jit
def _draw_pass(base, vocab, tau, inv_t, row_key, BLOCK: tl.constexpr):
    """Gumbel-max winner over the tokens with x >= tau."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        score = tl.where(x >= tau, x * inv_t + _gumbel(row_key, cols), float("-inf"))
        best, best_id = _take_better(score, cols, best, best_id)
    return _first_best(best, best_id, vocab)


@triton.jit
def _stats_pass(base, vocab, inv_t, BLOCK: tl.constexpr, WITH_MASS: tl.constexpr):
    """(max, smallest finite logit, number of finite logits, sum of exp((x - max) * inv_t) or 0 without
    WITH_MASS, the per-lane maxima [BLOCK]), one online pass with per-lane accumulators."""
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    finite = tl.zeros([BLOCK], dtype=tl.int32)
    lane_mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x, _ = _load(base, start, vocab, BLOCK)
        new_max = tl.maximum(lane_max, x)
        if WITH_MASS:
            shift = tl.where(new_max > float("-inf"), new_max, 0.0)  # a lane of banned (-inf) tokens only so far
            lane_mass = lane_mass * tl.exp((lane_max - shift) * inv_t) + tl.exp((x - shift) * inv_t)
        lane_max = new_max
        is_finite = x > float("-inf")
        lane_min = tl.minimum(lane_min, tl.where(is_finite, x, float("inf")))
        finite += is_finite.to(tl.int32)
    row_max = tl.max(lane_max, axis=0)
    shift = tl.where(row_max > float("-inf"), row_max, 0.0)
    mass = tl.sum(lane_mass * tl.exp((lane_max - shift) * inv_t), axis=0)
    return row_max, tl.min(lane_min, axis=0), tl.sum(finite, axis=0), mass, lane_max


@triton.jit
def _pick(vector, index, lanes):
    return tl.sum(tl.where(lanes == index, vector, 0), axis=0)


@triton.jit
def _count_above(x, pivots, counts):
    """Add each token's membership above each pivot into per-(lane, pivot) counts [len(x), PIVOTS]."""
    return counts + (x[:, None] >= pivots[None, :]).to(tl.int32)


@triton.jit
def _count_and_mass_above(x, pivots, row_max, inv_t, counts, masses):
    """(count, mass) above each pivot of one block, reduced across the program at once (per-lane mass
    accumulators beside the counts would not fit in the registers)."""
    above = x[:, None] >= pivots[None, :]
    counts += tl.sum(above.to(tl.int32), axis=0)
    masses += tl.sum(tl.where(above, tl.exp((x - row_max) * inv_t)[:, None], 0.0), axis=0)
    return counts, masses


@triton.jit
def _pivots(lo, top, lanes, PIVOTS: tl.constexpr):
    """PIVOTS thresholds spread over (lo, top], the last one top itself."""
    pivots = lo + (top - lo) * ((lanes + 1).to(tl.float32) / PIVOTS)
    return tl.where(lanes == PIVOTS - 1, top, pivots)


@triton.jit
def _narrow(pivots, counts, masses, reached, lo, hi, count_lo, count_hi, mass_lo, mass_hi, PIVOTS: tl.constexpr):
    """[lo, hi) narrowed to the last pivot that reaches the target and the first that does not, with the (count,
    mass) at or above each: the weight falls as the pivot rises, so a prefix of the pivots reaches it."""
    lanes = tl.arange(0, PIVOTS)
    num_valid = tl.sum(reached.to(tl.int32), axis=0)
    if num_valid > 0:
        lo = _pick(pivots, num_valid - 1, lanes)
        count_lo = _pick(counts, num_valid - 1, lanes)
        mass_lo = _pick(masses, num_valid - 1, lanes)
    if num_valid < PIVOTS:
        hi = _pick(pivots, num_valid, lanes)
        count_hi = _pick(counts, num_valid, lanes)
        mass_hi = _pick(masses, num_valid, lanes)
    return lo, hi, count_lo, count_hi, mass_lo, mass_hi


@triton.jit
def _search(base, vocab, row_max, inv_t, lo, count_lo, mass_lo, target, BY_MASS: tl.constexpr,
            TRACK_MASS: tl.constexpr, INTERVAL: tl.constexpr, BLOCK: tl.constexpr, PIVOTS: tl.constexpr,
            CAP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Narrow [lo, hi) around the largest threshold v with W(x >= v) >= target (W: the token count, or the mass
    when BY_MASS), from a lo that reaches the target, until at most CAP tokens lie at or above lo, or (with
    INTERVAL, for a caller that sorts the interval) within [lo, hi). Returns lo, hi and the (count, mass) at or
    above each; hi = +inf (count 0) when all of x >= lo fits in CAP. Stops early when lo reaches the top (more
    than CAP tokens tied at lo). Without TRACK_MASS (a count search whose caller needs no mass) the masses are
    not computed and returned as 0."""
    hi = tl.full([], float("inf"), tl.float32)
    count_hi = tl.full([], 0, tl.int32)
    mass_hi = tl.full([], 0.0, tl.float32)
    lanes = tl.arange(0, PIVOTS)
    passes = 0
    top = tl.minimum(hi, row_max)
    SUB: tl.constexpr = BLOCK // 4
    while (count_lo > CAP) & ((count_lo - count_hi > CAP) | (not INTERVAL)) & (lo < top) & (passes < MAX_PASSES):
        pivots = _pivots(lo, top, lanes, PIVOTS)
        # four loads in flight before the first is used: one program per row must hide memory latency itself
        if TRACK_MASS:
            counts = tl.zeros([PIVOTS], dtype=tl.int32)
            masses = tl.zeros([PIVOTS], dtype=tl.float32)
            for start in range(0, vocab, BLOCK):
                x0, _ = _load(base, start, vocab, SUB)
                x1, _ = _load(base, start + SUB, vocab, SUB)
                x2, _ = _load(base, start + 2 * SUB, vocab, SUB)
                x3, _ = _load(base, start + 3 * SUB, vocab, SUB)
                counts, masses = _count_and_mass_above(x0, pivots, row_max, inv_t, counts, masses)
                counts, masses = _count_and_mass_above(x1, pivots, row_max, inv_t, counts, masses)
                counts, masses = _count_and_mass_above(x2, pivots, row_max, inv_t, counts, masses)
                counts, masses = _count_and_mass_above(x3, pivots, row_max, inv_t, counts, masses)
        else:  # per-lane counts, reduced once (see _argmax_pass)
            lane_counts = tl.zeros([SUB, PIVOTS], dtype=tl.int32)
            for start in range(0, vocab, BLOCK):
                x0, _ = _load(base, start, vocab, SUB)
                x1, _ = _load(base, start + SUB, vocab, SUB)
                x2, _ = _load(base, start + 2 * SUB, vocab, SUB)
                x3, _ = _load(base, start + 3 * SUB, vocab, SUB)
                lane_counts = _count_above(x0, pivots, lane_counts)
                lane_counts = _count_above(x1, pivots, lane_counts)
                lane_counts = _count_above(x2, pivots, lane_counts)
                lane_counts = _count_above(x3, pivots, lane_counts)
            counts = tl.sum(lane_counts, axis=0)
            masses = tl.zeros([PIVOTS], dtype=tl.float32)
        if BY_MASS:
            reached = masses >= target
        else:
            reached = counts.to(tl.float32) >= target
        lo, hi, count_lo, count_hi, mass_lo, mass_hi = _narrow(pivots, counts, masses, reached, lo, hi, count_lo,
                                                               count_hi, mass_lo, mass_hi, PIVOTS)
        top = tl.minimum(hi, row_max)
        passes += 1
    if count_lo <= CAP:
        hi = tl.full([], float("inf"), tl.float32)
        count_hi = tl.full([], 0, tl.int32)
        mass_hi = tl.full([], 0.0, tl.float32)
    return lo, hi, count_lo, count_hi, mass_lo, mass_hi


NO_KEY = tl.constexpr(-9223372036854775808)  # below every key


@triton.jit
def _sort_key(values, ids):
    """int64 keys of (fp32 value, token id): key order == value order, then id descending (the smaller id first
    in a descending sort or a max)."""
    bits = values.to(tl.int32, bitcast=True)
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order == float order
    return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))


@triton.jit
def _from_key(keys):
    """(values, ids) of _sort_key's keys."""
    ordered = (keys >> 32).to(tl.int32)
    values = tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)
    return values, 0xFFFFFFFF - (keys & 0xFFFFFFFF)


@triton.jit
def _gather_sorted(base, vocab, lo, hi, scratch_row, counter, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """The tokens with lo <= x < hi, sorted by logit descending then id ascending: (values, ids, lane is filled,
    their count), valid when the count is at most CAP. Each chosen token takes a scratch slot from an atomic
    counter (zero before the call): the order the slots are taken in does not matter, the sort restores one."""
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        chosen = (x >= lo) & (x < hi)
        slot = tl.atomic_add(counter + tl.zeros_like(cols), 1, mask=chosen, sem="relaxed")
        tl.store(scratch_row + slot, _sort_key(x, cols), mask=chosen & (slot < CAP))
    tl.debug_barrier()
    filled = tl.atomic_add(counter, 0, sem="relaxed")  # read at the L2, where the increments are
    lanes = tl.arange(0, CAP)
    keys = tl.load(scratch_row + lanes, mask=lanes < filled, other=NO_KEY)
    values, ids = _from_key(tl.sort(keys, descending=True))
    return values, ids, lanes < filled, filled


@triton.jit
def _first_reaching(values, cumulative, target, filled, lanes, CAP: tl.constexpr):
    """The value at the first filled lane whose cumulative weight reaches target (the last filled lane if
    rounding leaves every lane short)."""
    first = tl.min(tl.where((cumulative >= target) & filled, lanes, CAP), axis=0)
    last = tl.max(tl.where(filled, lanes, 0), axis=0)
    return _pick(values, tl.minimum(first, last), lanes)


@triton.jit
def _row_settings(temperatures, top_k, top_p, min_p, seeds, positions, row, vocab):
    temperature = tl.load(temperatures + row)
    inv_t = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(temperature == 0.0, 1.0, temperature))
    k = tl.load(top_k + row)
    p = tl.load(top_p + row)
    return (temperature, inv_t, k, p, tl.load(min_p + row), _row_key(tl.load(seeds + row), tl.load(positions + row)),
            k < vocab, p < 1.0)


@triton.jit
def _finish_sorted(values, ids, filled, row_max, inv_t, k_target, p, tau, topp_on, row_key, vocab,
                   CAP: tl.constexpr):
    """Every token that can be kept, sorted (filled lanes first, by logit descending then id ascending), top-k on:
    place top-k, then top-p among its survivors, and draw."""
    lanes = tl.arange(0, CAP)
    weights = tl.where(filled, tl.exp((values - row_max) * inv_t), 0.0)
    tau_k = _first_reaching(values, (lanes + 1).to(tl.float32), k_target, filled, lanes, CAP)
    if topp_on:
        survivors = tl.sum(tl.where(values >= tau_k, weights, 0.0), axis=0)
        tau = tl.maximum(tau, _first_reaching(values, tl.cumsum(weights, axis=0), p * survivors,
                                              filled & (values >= tau_k), lanes, CAP))
    tau = tl.maximum(tau, tau_k)
    score = tl.where(filled & (values >= tau), values * inv_t + _gumbel(row_key, ids), float("-inf"))
    best = tl.max(score, axis=0)
    token = tl.min(tl.where((score == best) & filled, ids, vocab), axis=0).to(tl.int64)
    return tl.where(token == vocab, 0, token)  # every token banned: 0, as the other paths' argmax gives


WIDE = tl.constexpr(-2)  # the token of a row the first kernel leaves to the second (more than CAP kept tokens)


@triton.jit
def _threshold_in_registers(x, target, limit, PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """lo by the count search of _search over values in registers: at most the target-th largest of x when at
    least `target` values are finite (else the smallest finite value), so x >= lo holds its top `target` with
    every tie; the search stops once at most `limit` (>= target) values lie at or above lo (more: ties, or
    MAX_PASSES). No finite value: +inf."""
    finite = x > float("-inf")
    lo = tl.min(tl.where(finite, x, float("inf")), axis=0)
    count_lo = tl.sum(finite.to(tl.int32), axis=0)
    top = tl.max(tl.where(finite, x, float("-inf")), axis=0)
    hi = tl.full([], float("inf"), tl.float32)
    count_hi = tl.full([], 0, tl.int32)
    no_mass = tl.full([], 0.0, tl.float32)
    masses = tl.zeros([PIVOTS], dtype=tl.float32)
    lanes = tl.arange(0, PIVOTS)
    passes = 0
    while (count_lo > limit) & (lo < top) & (passes < MAX_PASSES):
        pivots = _pivots(lo, top, lanes, PIVOTS)
        counts = tl.sum((x[:, None] >= pivots[None, :]).to(tl.int32), axis=0)
        lo, hi, count_lo, count_hi, _, _ = _narrow(pivots, counts, masses, counts >= target, lo, hi, count_lo,
                                                   count_hi, no_mass, no_mass, PIVOTS)
        top = tl.minimum(hi, top)
        passes += 1
    return lo


@triton.jit
def _sample_kernel(logits, stride, out, temperatures, top_k, top_p, min_p, seeds, positions, scratch, counters,
                   vocab, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CAP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Rows with a top-k up to CAP (with or without top-p and min-p), temperature-only, min-p-only and greedy
    rows; the others (top-k > CAP, top-p without top-k, a top-k search left with more than CAP tokens) are marked
    WIDE for _sample_wide_kernel. Kept lean, with
    count searches only: its registers bound the speed of every pass."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on = _row_settings(
        temperatures, top_k, top_p, min_p, seeds, positions, row, vocab)
    token = tl.full([], -1, tl.int64)
    if temperature == 0.0:
        token = _argmax_pass(base, vocab, BLOCK)
    else:
        tau = tl.full([], float("-inf"), tl.float32)
        if topk_on & (k <= CAP):  # top-p (if on) is placed among the top-k survivors once they are in registers
            row_max, row_min, finite, mass, lane_max = _stats_pass(base, vocab, inv_t, BLOCK, False)
            if minimum_p > 0.0:
                tau = row_max + temperature * tl.log(minimum_p)
            k_target = tl.minimum(k, finite).to(tl.float32)  # a k past the unbanned tokens keeps them all
            # The first try starts at most CAP / 4 lanes (k_target if more) down the lane maxima, found in registers:
            # when k_target lanes hold a finite maximum, at least k_target tokens lie at or above it, and about as
            # many as lanes unless the logits are laid out against the lanes, which leaves room under CAP. (Stopping
            # at CAP lanes gathered more than CAP tokens for some rows: 0.21 or 0.57 ms at batch 256 depending on
            # the logits.) When every finite token fits in CAP (a row most logit controls or a grammar banned),
            # it starts at the smallest of them.
            target = k_target.to(tl.int32)
            lo = _threshold_in_registers(lane_max, target, tl.maximum(target, CAP // 4), PIVOTS, MAX_PASSES)
            lo = tl.where(finite <= CAP, row_min, lo)
            scratch_row = scratch + row * CAP
            values, ids, kept, count = _gather_sorted(base, vocab, lo, float("inf"), scratch_row, counters + row * 4,
                                                      BLOCK, CAP)
            if (count < k_target) | (count > CAP):  # else the search over the row
                lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
                    base, vocab, row_max, inv_t, row_min, finite, mass, k_target, False, False, False, BLOCK, PIVOTS,
                    CAP, MAX_PASSES)
                if count_lo <= CAP:
                    values, ids, kept, count = _gather_sorted(base, vocab, lo, hi, scratch_row, counters + row * 4 + 3,
                                                              BLOCK, CAP)
                else:
                    token = tl.full([], WIDE, tl.int64)
            if token == -1:
                token = _finish_sorted(values, ids, kept, row_max, inv_t, k_target, p, tau, topp_on, row_key, vocab,
                                       CAP)
        elif topk_on | topp_on:  # a kept set that may exceed CAP: the second kernel's
            token = tl.full([], WIDE, tl.int64)
        elif minimum_p > 0.0:
            row_max = tl.full([], float("-inf"), tl.float32)
            for start in range(0, vocab, BLOCK):
                x, _ = _load(base, start, vocab, BLOCK)
                row_max = tl.maximum(row_max, tl.max(x, axis=0))
            tau = row_max + temperature * tl.log(minimum_p)
        if token == -1:
            token = _draw_pass(base, vocab, tau, inv_t, row_key, BLOCK)
    tl.store(out + row, token)


@triton.jit
def _sample_wide_kernel(logits, stride, out, temperatures, top_k, top_p, min_p, seeds, positions, scratch,
                        counters, vocab, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CAP: tl.constexpr,
                        MAX_PASSES: tl.constexpr):
    """The rows _sample_kernel marked WIDE (every other row returns at once): a kept set of more than CAP
    tokens. The search interval [lo, hi) holding at most CAP tokens is sorted to place the threshold exactly
    (else, after MAX_PASSES passes, the whole interval is kept), a second search places top-p after top-k when
    both are on, and one last pass draws over the kept set."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(out + row) == WIDE:
        base = logits + row * stride
        temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on = _row_settings(
            temperatures, top_k, top_p, min_p, seeds, positions, row, vocab)
        row_max, row_min, finite, total, _lane_max = _stats_pass(base, vocab, inv_t, BLOCK, True)
        tau = tl.full([], float("-inf"), tl.float32)
        if minimum_p > 0.0:
            tau = row_max + temperature * tl.log(minimum_p)
        k_target = tl.minimum(k, finite).to(tl.float32)
        lanes = tl.arange(0, CAP)
        scratch_row = scratch + row * CAP
        counter = counters + row * 4
        if topk_on:
            lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
                base, vocab, row_max, inv_t, row_min, finite, total, k_target, False, True, True, BLOCK, PIVOTS, CAP,
                MAX_PASSES)
        else:
            lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
                base, vocab, row_max, inv_t, row_min, finite, total, p * total, True, True, True, BLOCK, PIVOTS, CAP,
                MAX_PASSES)
        threshold = lo  # more than CAP tokens still in [lo, hi) after MAX_PASSES: keep them all
        count_kept = count_lo
        survivors = mass_lo
        if count_lo - count_hi <= CAP:  # the exact threshold, inside the interval
            values, ids, filled, _ = _gather_sorted(base, vocab, lo, hi, scratch_row, counter + 1, BLOCK, CAP)
            weights = tl.where(filled, tl.exp((values - row_max) * inv_t), 0.0)
            if topk_on:
                threshold = _first_reaching(values, (count_hi + lanes + 1).to(tl.float32), k_target, filled,
                                            lanes, CAP)
            else:
                threshold = _first_reaching(values, mass_hi + tl.cumsum(weights, axis=0), p * total, filled,
                                            lanes, CAP)
            kept = filled & (values >= threshold)
            count_kept = count_hi + tl.sum(kept.to(tl.int32), axis=0)
            survivors = mass_hi + tl.sum(tl.where(kept, weights, 0.0), axis=0)
        if topk_on & topp_on:  # top-p inside the top-k survivors: a second search, up from tau_k
            lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
                base, vocab, row_max, inv_t, threshold, count_kept, survivors, p * survivors, True, True, True,
                BLOCK, PIVOTS, CAP, MAX_PASSES)
            tau_k = threshold
            threshold = lo
            if count_lo - count_hi <= CAP:
                values, ids, filled, _ = _gather_sorted(base, vocab, lo, hi, scratch_row, counter + 2, BLOCK, CAP)
                weights = tl.where(filled, tl.exp((values - row_max) * inv_t), 0.0)
                threshold = _first_reaching(values, mass_hi + tl.cumsum(weights, axis=0), p * survivors,
                                            filled, lanes, CAP)
            threshold = tl.maximum(threshold, tau_k)
        tau = tl.maximum(tau, threshold)
        tl.store(out + row, _draw_pass(base, vocab, tau, inv_t, row_key, BLOCK))


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *, cap: int = DEFAULT_CAP,
                 block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_WARPS) -> torch.Tensor:
    """logits [batch, vocab] fp32/bf16/fp16 (unit stride along vocab) -> token ids int64 [batch]. Per-row
    settings: temperatures f32 (0 = greedy), top_k int (>= vocab = off), top_p f32 (1 = off), min_p f32
    (0 = off), seeds and positions int64. No host synchronisation; `cap` and `block` are powers of two."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "logits must be contiguous along the vocabulary"
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    scratch = torch.empty(batch, cap, dtype=torch.int64, device=logits.device)
    counters = torch.zeros(batch, 4, dtype=torch.int32, device=logits.device)  # one per gather of a row
    args = (logits, logits.stride(0), out, temperatures, top_k, top_p, min_p, seeds, positions, scratch, counters,
            vocab)
    config = dict(BLOCK=block, PIVOTS=PIVOTS, CAP=cap, MAX_PASSES=MAX_PASSES, num_warps=num_warps)
    _sample_kernel[(batch,)](*args, **config)
    _sample_wide_kernel[(batch,)](*args, **config)
    return out


@triton.jit
def _logprob_stats_kernel(logits, stride, token_ids, out_logprob, out_rank, vocab, BLOCK: tl.constexpr):
    """Per row: log_softmax(x)[token] in float32 and the token's rank, the number of tokens whose logit is >= its
    own (1 = the most likely), in one online pass."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    token = tl.load(token_ids + row)
    chosen = tl.load(base + token).to(tl.float32)
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_mass = tl.zeros([BLOCK], dtype=tl.float32)
    lane_rank = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):  # per-lane accumulators, reduced once (see _argmax_pass)
        x, _ = _load(base, start, vocab, BLOCK)
        new_max = tl.maximum(lane_max, x)
        shift = tl.where(new_max > float("-inf"), new_max, 0.0)
        lane_mass = lane_mass * tl.exp(lane_max - shift) + tl.exp(x - shift)
        lane_max = new_max
        lane_rank += (x >= chosen).to(tl.int32)
    row_max = tl.max(lane_max, axis=0)
    mass = tl.sum(lane_mass * tl.exp(lane_max - tl.where(row_max > float("-inf"), row_max, 0.0)), axis=0)
    rank = tl.sum(lane_rank, axis=0)
    tl.store(out_logprob + row, chosen - row_max - tl.log(mass))
    tl.store(out_rank + row, rank.to(tl.int64))


def logprob_stats(logits: torch.Tensor, token_ids: torch.Tensor,
                  block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] (unit stride along vocab), token_ids int64 [rows] -> (float32 logprob of each token
    under log_softmax of the logits, int64 rank), without materialising a float32 copy of the logits."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1, "logits must be contiguous along the vocabulary"
    logprob = torch.empty(rows, dtype=torch.float32, device=logits.device)
    rank = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows:
        _logprob_stats_kernel[(rows,)](logits, logits.stride(0), token_ids, logprob, rank, vocab, BLOCK=block,
                                       num_warps=8)
    return logprob, rank
