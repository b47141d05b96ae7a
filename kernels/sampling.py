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

The split path (rows with top-k <= SLOTS, with or without top-p and min-p, in batches of SPLIT_MIN_BATCH to
SPLIT_MAX_BATCH rows) reads the logits once, spread over many programs per row. The first kernel, grid (rows,
chunks), loads a chunk of CHUNK logits into registers; for a top-k row it finds, by a count search over those
registers, a threshold at or below the chunk's min(k, finite)-th largest logit with at most SLOTS tokens at or above
it, and writes those (sort keys: value, then id) and their count. The row's top-k with ties lies in the union of the
chunks' (a token the chunk's threshold drops has k larger tokens in its chunk alone), and that union holds the row
maximum and, when fewer than k tokens are finite, every finite token: so k_target = min(k, candidates). The second
kernel, one program per row, sorts the row's candidates in registers (first narrowed to at most FINISH_SORT holding
the top-k with ties, by the same count search, when that many suffice) and finishes as the per-row path does below
(same helpers). A chunk with more than SLOTS tokens tied at its threshold (or MAX_PASSES) marks its row WIDE, for
the wide kernel below.

The per-row path, one program per row, takes every other row (every row when `slots` is 0). How it avoids
sorting the vocabulary: after one pass for (max, finite min, softmax mass) the kernel searches the threshold of the
first active filter (count mode for top-k, mass mode for top-p) with PIVOTS thresholds per pass over the row,
narrowing [lo, hi) (lo satisfies the filter's target, hi does not). For a top-k of at most CAP the first kernel,
as soon as at most CAP tokens lie at or above lo, gathers them (value, id) into a per-row scratch, sorts those in
registers and finishes every threshold and the Gumbel-max draw there: no further pass. Temperature-only rows take
a single pass (draw over all), min-p-only rows two.

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

from nanovllm.layers import noise

# jit functions read module globals only as constexpr
MIX_A = tl.constexpr(noise.MIX_A)
MIX_B = tl.constexpr(noise.MIX_B)
GOLDEN = tl.constexpr(noise.GOLDEN)
SALT = tl.constexpr(noise.SALT)

# One program per row must keep its own loads in flight. The best of scripts/bench_sampler.py --sweep on the H100
# (2026-11-25, batch 256, vocab 151,936): 4096-logit blocks over 16 warps with 512-token gathers, top-k 50 +
# top-p 0.95 0.346 ms (8192 / 16 / 1024 before: 0.380), top-p alone 1.105 (1.248); within 0.02 ms of the best
# configuration in every mode timed.
DEFAULT_CAP = 512
DEFAULT_BLOCK = 4096
DEFAULT_WARPS = 16
PIVOTS = 8
MAX_PASSES = 12
# The split path (top-k up to DEFAULT_SLOTS): chunks of DEFAULT_CHUNK logits, the fastest of `scripts/bench_sampler.py
# --sweep` on an H200 (docs/BENCHMARKS.md, 2026-11-26). It takes batches of SPLIT_MIN_BATCH to SPLIT_MAX_BATCH
# rows: its time grows with the rows (top-k 50 + top-p, kernels alone: 0.034 ms at 16, 0.09 at 64, 0.25 at 192,
# 0.33 at 256), the per-row kernels' with the waves of one program per row over the SMs (0.11 at 1, 0.16 at 16 to
# 128, 0.28 at 192 and 256), and below 16 rows the per-row kernels were faster. It never takes temperature-only rows.
DEFAULT_CHUNK = 4096
DEFAULT_SLOTS = 64
DEFAULT_SPLIT_WARPS = 4
DEFAULT_FINISH_WARPS = 8
DEFAULT_FINISH_SORT = 256
SPLIT_MIN_BATCH = 16
SPLIT_MAX_BATCH = 192


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
    WITH_MASS), one online pass with per-lane accumulators."""
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
    return row_max, tl.min(lane_min, axis=0), tl.sum(finite, axis=0), mass


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
    """The tokens with lo <= x < hi (at most CAP of them), sorted by logit descending then id ascending:
    (values, ids, lane is filled). Each chosen token takes a scratch slot from an atomic counter (zero before
    the call): the order the slots are taken in does not matter, the sort restores one."""
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
    return values, ids, lanes < filled


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
def _finish_in_registers(base, vocab, lo, hi, row_max, inv_t, k_target, p, tau, topp_on, row_key, scratch_row,
                         counter, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """Every token >= lo fits in CAP and top-k is on: gather and sort them, place top-k, then top-p among its
    survivors, and draw; no further pass."""
    values, ids, filled = _gather_sorted(base, vocab, lo, hi, scratch_row, counter, BLOCK, CAP)
    return _finish_sorted(values, ids, filled, row_max, inv_t, k_target, p, tau, topp_on, row_key, vocab, CAP)


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
SPLIT = tl.constexpr(-3)  # a row of the split path, which _sample_kernel leaves alone


@triton.jit
def _takes_split(temperature, k, topk_on, SLOTS: tl.constexpr):
    """The rows of the split path (none when SLOTS is 0): top-k up to SLOTS, with or without top-p and min-p."""
    return (SLOTS > 0) & (temperature != 0.0) & topk_on & (k <= SLOTS)


@triton.jit
def _pivot_counts(x, lo, top, lanes, PIVOTS: tl.constexpr):
    """(pivots, count of x >= each): the thresholds of _pivots, counted one at a time, so that no [len(x), PIVOTS]
    comparison is held in registers (a chunk's spilled: 0.39 -> 0.30 ms for the split kernel at batch 256)."""
    pivots = tl.zeros([PIVOTS], dtype=tl.float32)
    counts = tl.zeros([PIVOTS], dtype=tl.int32)
    for j in tl.static_range(PIVOTS):
        if j == PIVOTS - 1:
            pivot = top
        else:
            pivot = lo + (top - lo) * ((j + 1) / PIVOTS)
        pivots = tl.where(lanes == j, pivot, pivots)
        counts = tl.where(lanes == j, tl.sum((x >= pivot).to(tl.int32), axis=0), counts)
    return pivots, counts


@triton.jit
def _chunk_threshold(x, target, PIVOTS: tl.constexpr, SLOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """(lo, count of x >= lo): the count search of _search over a chunk in registers. lo is at most the chunk's
    target-th largest logit, so x >= lo holds its top `target` with every tie; it stops once at most SLOTS tokens
    lie at or above lo (a count above SLOTS: ties, or MAX_PASSES). No finite logit: lo = +inf, count 0. NaN lanes
    (no candidate) count nowhere."""
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
    while (count_lo > SLOTS) & (lo < top) & (passes < MAX_PASSES):
        pivots, counts = _pivot_counts(x, lo, top, lanes, PIVOTS)
        lo, hi, count_lo, count_hi, _, _ = _narrow(pivots, counts, masses, counts >= target, lo, hi, count_lo,
                                                   count_hi, no_mass, no_mass, PIVOTS)
        top = tl.minimum(hi, top)
        passes += 1
    return lo, count_lo


@triton.jit
def _sample_split_kernel(logits, stride, temperatures, top_k, top_p, min_p, seeds, positions, keys, counts, vocab,
                         CHUNK: tl.constexpr, PIVOTS: tl.constexpr, SLOTS: tl.constexpr,
                         MAX_PASSES: tl.constexpr):
    """Split path, grid (rows, chunks): chunk c of a row (logits [c * CHUNK, (c + 1) * CHUNK)) is read once, into
    registers. A top-k row writes the chunk's candidates, a superset of its top-k with ties (the row's top-k with
    ties lies in the union of the chunks'), as sort keys into its SLOTS key slots, and their count (-1: more than
    SLOTS)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on = _row_settings(
        temperatures, top_k, top_p, min_p, seeds, positions, row, vocab)
    if _takes_split(temperature, k, topk_on, SLOTS):
        x, cols = _load(logits + row * stride, chunk * CHUNK, vocab, CHUNK)
        slot = row * tl.num_programs(1) + chunk
        lo, count = _chunk_threshold(x, tl.minimum(k, vocab).to(tl.int32), PIVOTS, SLOTS, MAX_PASSES)
        chosen = x >= lo
        place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
        tl.store(keys + slot * SLOTS + place, _sort_key(x, cols), mask=chosen & (place < SLOTS))  # all or none read
        tl.store(counts + slot, tl.where(count <= SLOTS, count, -1))


@triton.jit
def _finish_candidates(row_keys, filled, temperature, inv_t, k, p, minimum_p, topp_on, row_key, vocab,
                       LANES: tl.constexpr):
    """A split row's candidates (keys, filled lanes), sorted and finished as _finish_in_registers does: the row
    maximum is the largest candidate; a k past the unbanned tokens keeps every candidate (then all of them)."""
    values, ids = _from_key(tl.sort(row_keys, descending=True))
    filled = tl.arange(0, LANES) < tl.sum(filled.to(tl.int32), axis=0)  # the sort puts the filled lanes first
    row_max = tl.max(tl.where(filled, values, float("-inf")), axis=0)
    tau = tl.full([], float("-inf"), tl.float32)
    if minimum_p > 0.0:
        tau = row_max + temperature * tl.log(minimum_p)
    k_target = tl.minimum(k, tl.sum(filled.to(tl.int32), axis=0)).to(tl.float32)
    return _finish_sorted(values, ids, filled, row_max, inv_t, k_target, p, tau, topp_on, row_key, vocab, LANES)


@triton.jit
def _sample_split_finish_kernel(out, temperatures, top_k, top_p, min_p, seeds, positions, keys, counts, short,
                                vocab, chunks, SLOTS: tl.constexpr, CHUNKS: tl.constexpr, SHORT: tl.constexpr,
                                PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Split path, one program per row: the row's chunks' keys (CHUNKS: the number of chunks rounded up to a power
    of two). A row finishes from its candidates (_finish_candidates), or is marked WIDE when a chunk overflowed.
    With SHORT > 0, a count search over the candidates in registers first keeps at most SHORT of them that hold the
    top-k with ties (the chunks' search again), moved through the row's `short` scratch, so that only those are
    sorted; when ties leave more, all are sorted."""
    row = tl.program_id(0).to(tl.int64)
    temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on = _row_settings(
        temperatures, top_k, top_p, min_p, seeds, positions, row, vocab)
    if _takes_split(temperature, k, topk_on, SLOTS):
        lanes = tl.arange(0, CHUNKS * SLOTS)
        chunk = lanes // SLOTS
        filled_in_chunk = tl.load(counts + row * chunks + chunk, mask=chunk < chunks, other=0)
        row_keys = tl.load(keys + row * chunks * SLOTS + lanes, mask=lanes % SLOTS < filled_in_chunk, other=NO_KEY)
        if tl.min(filled_in_chunk, axis=0) < 0:
            token = tl.full([], WIDE, tl.int64)
        else:
            filled = row_keys != NO_KEY
            if SHORT > 0:
                values, _ = _from_key(row_keys)  # NO_KEY: NaN, neither finite nor at or above any threshold
                total = tl.sum(filled.to(tl.int32), axis=0)
                lo, count = _chunk_threshold(values, tl.minimum(k, total).to(tl.int32), PIVOTS, SHORT, MAX_PASSES)
                if count <= SHORT:
                    chosen = filled & (values >= lo)
                    place = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
                    tl.store(short + row * SHORT + place, row_keys, mask=chosen & (place < SHORT))
                    tl.debug_barrier()
                    short_lanes = tl.arange(0, SHORT)
                    kept = short_lanes < count
                    token = _finish_candidates(tl.load(short + row * SHORT + short_lanes, mask=kept, other=NO_KEY),
                                               kept, temperature, inv_t, k, p, minimum_p, topp_on, row_key, vocab,
                                               SHORT)
                else:
                    token = _finish_candidates(row_keys, filled, temperature, inv_t, k, p, minimum_p, topp_on,
                                               row_key, vocab, CHUNKS * SLOTS)
            else:
                token = _finish_candidates(row_keys, filled, temperature, inv_t, k, p, minimum_p, topp_on, row_key,
                                           vocab, CHUNKS * SLOTS)
        tl.store(out + row, token)


@triton.jit
def _sample_kernel(logits, stride, out, temperatures, top_k, top_p, min_p, seeds, positions, scratch, counters,
                   vocab, BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CAP: tl.constexpr, MAX_PASSES: tl.constexpr,
                   SLOTS: tl.constexpr):
    """Rows with a top-k up to CAP (with or without top-p and min-p), temperature-only, min-p-only and greedy
    rows, but for those the split path takes (_takes_split); the others (top-k > CAP, top-p without top-k, a
    top-k search left with more than CAP tokens) are marked WIDE for _sample_wide_kernel. Kept lean, with
    count searches only: its registers bound the speed of every pass."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on = _row_settings(
        temperatures, top_k, top_p, min_p, seeds, positions, row, vocab)
    token = tl.full([], -1, tl.int64)
    if _takes_split(temperature, k, topk_on, SLOTS):
        token = tl.full([], SPLIT, tl.int64)  # _sample_split_finish_kernel writes it
    elif temperature == 0.0:
        token = _argmax_pass(base, vocab, BLOCK)
    else:
        tau = tl.full([], float("-inf"), tl.float32)
        if topk_on & (k <= CAP):  # top-p (if on) is placed among the top-k survivors once they are in registers
            row_max, row_min, finite, mass = _stats_pass(base, vocab, inv_t, BLOCK, False)
            if minimum_p > 0.0:
                tau = row_max + temperature * tl.log(minimum_p)
            k_target = tl.minimum(k, finite).to(tl.float32)  # a k past the unbanned tokens keeps them all
            lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
                base, vocab, row_max, inv_t, row_min, finite, mass, k_target, False, False, False, BLOCK, PIVOTS, CAP,
                MAX_PASSES)
            if count_lo <= CAP:
                token = _finish_in_registers(base, vocab, lo, hi, row_max, inv_t, k_target, p, tau, topp_on,
                                             row_key, scratch + row * CAP, counters + row * 4, BLOCK, CAP)
            else:
                token = tl.full([], WIDE, tl.int64)
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
    if token != SPLIT:
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
        row_max, row_min, finite, total = _stats_pass(base, vocab, inv_t, BLOCK, True)
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
            values, ids, filled = _gather_sorted(base, vocab, lo, hi, scratch_row, counter + 1, BLOCK, CAP)
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
                values, ids, filled = _gather_sorted(base, vocab, lo, hi, scratch_row, counter + 2, BLOCK, CAP)
                weights = tl.where(filled, tl.exp((values - row_max) * inv_t), 0.0)
                threshold = _first_reaching(values, mass_hi + tl.cumsum(weights, axis=0), p * survivors,
                                            filled, lanes, CAP)
            threshold = tl.maximum(threshold, tau_k)
        tau = tl.maximum(tau, threshold)
        tl.store(out + row, _draw_pass(base, vocab, tau, inv_t, row_key, BLOCK))


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *, cap: int = DEFAULT_CAP,
                 block: int = DEFAULT_BLOCK, num_warps: int = DEFAULT_WARPS, chunk: int = DEFAULT_CHUNK,
                 slots: int = DEFAULT_SLOTS, split_warps: int = DEFAULT_SPLIT_WARPS,
                 finish_warps: int = DEFAULT_FINISH_WARPS, finish_sort: int = DEFAULT_FINISH_SORT,
                 split_min_batch: int = SPLIT_MIN_BATCH, split_max_batch: int = SPLIT_MAX_BATCH) -> torch.Tensor:
    """logits [batch, vocab] fp32/bf16/fp16 (unit stride along vocab) -> token ids int64 [batch]. Per-row
    settings: temperatures f32 (0 = greedy), top_k int (>= vocab = off), top_p f32 (1 = off), min_p f32
    (0 = off), seeds and positions int64. No host synchronisation; `cap`, `block`, `chunk`, `slots` and
    `finish_sort` are powers of two or 0: `slots` 0 turns the split path off (every row on the per-row kernels),
    `finish_sort` 0 sorts a split row's every candidate (else at most that many, after a count search); a batch
    outside [`split_min_batch`, `split_max_batch`] rows takes the per-row kernels only."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "logits must be contiguous along the vocabulary"
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    scratch = torch.empty(batch, cap, dtype=torch.int64, device=logits.device)
    counters = torch.zeros(batch, 4, dtype=torch.int32, device=logits.device)  # one per gather of a row
    settings = (temperatures, top_k, top_p, min_p, seeds, positions)
    assert finish_sort == 0 or finish_sort >= slots, "finish_sort below slots cannot hold a top-k of slots"
    if not split_min_batch <= batch <= split_max_batch:
        slots = 0
    if slots:
        chunks = triton.cdiv(vocab, chunk)
        keys = torch.empty(batch, chunks, slots, dtype=torch.int64, device=logits.device)
        counts = torch.empty(batch, chunks, dtype=torch.int32, device=logits.device)
        _sample_split_kernel[(batch, chunks)](logits, logits.stride(0), *settings, keys, counts, vocab, CHUNK=chunk,
                                              PIVOTS=PIVOTS, SLOTS=slots, MAX_PASSES=MAX_PASSES,
                                              num_warps=split_warps)
        short = torch.empty(batch, max(finish_sort, 1), dtype=torch.int64, device=logits.device)
        _sample_split_finish_kernel[(batch,)](out, *settings, keys, counts, short, vocab, chunks, SLOTS=slots,
                                              CHUNKS=triton.next_power_of_2(chunks), SHORT=finish_sort,
                                              PIVOTS=PIVOTS, MAX_PASSES=MAX_PASSES, num_warps=finish_warps)
    args = (logits, logits.stride(0), out, *settings, scratch, counters, vocab)
    config = dict(BLOCK=block, PIVOTS=PIVOTS, CAP=cap, MAX_PASSES=MAX_PASSES, num_warps=num_warps)
    _sample_kernel[(batch,)](*args, **config, SLOTS=slots)
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
