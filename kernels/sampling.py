"""Fused sampling: temperature, top-k, top-p, min-p (any mix per row) and greedy rows, in a bounded number of passes.

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

One program per row; a "pass" reads the row once (256 x 151,936 bf16 logits: 78 MB). No threshold costs a number
of passes that depends on the logits:

1. A bracket [a, b) holds every threshold of the row: the tokens at or above b are all kept, those below a none,
   those tied at a are kept or dropped together.
2. One pass (`_bracket_pass`) gathers the tokens strictly inside the bracket (value and id, as one 64-bit slot)
   into a per-row scratch of G slots, counts the tokens tied at a and their Gumbel-max winner, and the tokens at
   or above b: their count, mass and Gumbel-max winner over x >= max(b, tau_min) (the draw over the kept tokens
   that lie there).
3. The thresholds are then found in the scratch alone (`_finish`): a bisection of the 32-bit order-preserving key
   with PIVOTS pivots per sweep of at most G slots, at most 8 sweeps per threshold, then one sweep for the draw.
   Ties need no care: tied tokens share one key.

Passes by kind of row:

- greedy: one (argmax). Temperature only: one (the draw). Min-p only: two (the maximum, the draw).
- top-k <= NARROW (with or without top-p and min-p), `_sample_kernel`: two, for every input. The lane-maximum pass
  (the maxima of BLOCK lanes, lane j holding ids j, j + BLOCK, ...), then the bracket pass with a = the k-th
  largest lane maximum, b = +inf: at least k tokens lie at or above a, and the tokens above a lie in the fewer
  than k lanes whose maximum exceeds a, so there are at most (k - 1) * lane_len of them. The tokens tied at a are
  gathered too when at most NARROW lanes reach a (those lanes bound them), else counted. G = NARROW * lane_len
  slots therefore always suffice. The gather pass computes the Gumbel scores only when it counts ties.
- top-p without top-k, top-k > NARROW, `_sample_wide_kernel`: two. A stats pass (maximum, mass, finite count,
  the lane maxima and a sample of one logit per lane, lane j sampling block j mod the number of blocks), then
  the bracket pass with the draw over x >= b fused in. a and b are the sample's quantiles six standard deviations
  of the estimate below and above the threshold's estimated rank (capped so the bracket holds about 0.3 G
  tokens; a top-p threshold is estimated from its share of the sampled mass, or, where that is tighter, from the
  mass the sample puts below it against the row's exact mass), tightened by the lane maxima (the mass at or
  above the lane maxima >= v is a lower bound of mass(x >= v)); a row with at most G finite logits gathers them
  all. Two top-p rows get another bracket: one
  whose estimated threshold lies below its min-p threshold gets [tau_min, +inf) when the tokens above tau_min fit
  (a top-heavy row's mass estimate is too loose to bracket a low top-p threshold, and min-p decides there
  unless the scratch shows otherwise); one whose estimate is the value of a large tie group (low-precision
  logits) gets two groups, that one and its neighbour on the side where the sample's mass lies nearer the
  target, the lower counted at a and the upper gathered. The bracket pass measures all the bracket
  needs to be checked (count and mass at or above b, in the scratch, tied at a). A row whose bracket missed
  (its sample laid out against the row, e.g. every logit but the sampled ones high; none of the kinds
  scripts/bench_sampler.py times) takes the exact search instead, in the same kernel (`_search_row`: up to
  MAX_PASSES narrowing passes per threshold with PIVOTS_SEARCH pivots each, a sort of the last interval, the
  draw), and its counters[3] says so.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels import noise
from nanovllm.kernels.order_keys import HALF, NO_KEY, key_of, slot_key, slot_parts, value_of

# jit functions read module globals only as constexpr
MIX_A = tl.constexpr(noise.MIX_A)
MIX_B = tl.constexpr(noise.MIX_B)
GOLDEN = tl.constexpr(noise.GOLDEN)
SALT = tl.constexpr(noise.SALT)

DEFAULT_BLOCK = 4096  # lanes: BLOCK / (32 * num_warps) logits per thread per load
DEFAULT_WARPS = 16
NARROW_K = 512  # top-k up to this (and BLOCK) takes the lane-maximum bracket
PIVOTS = 16  # pivots per sweep of the scratch bisection
CHUNK = 512  # slots per step of a scratch sweep
# the exact search of a row whose bracket missed: pivots per narrowing pass, passes per threshold, tokens sorted
PIVOTS_SEARCH = 8
MAX_PASSES = 12
SEARCH_CAP = 512

WIDE = tl.constexpr(-2)  # `out` of a row left by _sample_kernel to _sample_wide_kernel
SEARCH = tl.constexpr(-3)  # a row whose bracket missed: the exact search finishes it
U_TOP = tl.constexpr(4294967296)  # above every key


# ---- the noise ------------------------------------------------------------------------------------------------


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
def _select(keys, weights, target):
    """The largest key K with sum(weights[keys >= K]) >= target, built bit by bit from the top (keys: [n] in
    [0, 2**32), weights >= 0); 0 when the whole vector falls short. K is one of `keys`."""
    chosen = tl.full([], 0, tl.int64)
    for i in range(32):
        candidate = chosen | (tl.full([], HALF, tl.int64) >> i)
        reached = tl.sum(tl.where(keys >= candidate, weights, 0.0), axis=0) >= target
        chosen = tl.where(reached, candidate, chosen)
    return chosen


@triton.jit
def _select_pair(keys_a, weights_a, target_a, keys_b, weights_b, target_b):
    """_select of two (keys, weights, target) at once: one reduction per bit for both."""
    keys = tl.join(keys_a, keys_b)
    weights = tl.join(weights_a, weights_b)
    index = tl.arange(0, 2)
    targets = tl.where(index == 0, target_a, target_b)
    chosen = tl.zeros([2], dtype=tl.int64)
    for i in range(32):
        candidate = chosen | (tl.full([], HALF, tl.int64) >> i)
        reached = tl.sum(tl.where(keys >= candidate[None, :], weights, 0.0), axis=0) >= targets
        chosen = tl.where(reached, candidate, chosen)
    return tl.sum(tl.where(index == 0, chosen, 0), axis=0), tl.sum(tl.where(index == 1, chosen, 0), axis=0)


# ---- passes over the row ---------------------------------------------------------------------------------------


@triton.jit
def _load(base, start, vocab, BLOCK: tl.constexpr):
    cols = start + tl.arange(0, BLOCK)
    return tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32), cols


@triton.jit
def _first_best(best, best_id, vocab):
    """The largest of per-lane bests and, on ties, the smallest id: each lane kept its first best, and a lane's
    ids only grow."""
    top = tl.max(best, axis=0)
    return top, tl.min(tl.where(best == top, best_id, vocab), axis=0).to(tl.int64)


@triton.jit
def _take_better(score, cols, best, best_id):
    take = score > best
    return tl.where(take, score, best), tl.where(take, cols, best_id)


@triton.jit
def _better(score, token, other_score, other_token):
    """The better of two candidates (score descending, then token ascending)."""
    take = (other_score > score) | ((other_score == score) & (other_token < token))
    return tl.where(take, other_score, score), tl.where(take, other_token, token)


@triton.jit
def _argmax_pass(base, vocab, BLOCK: tl.constexpr):
    # Per-lane running bests, reduced across the program once at the end: a reduction per block would cost a
    # barrier and a shared-memory round trip per block, which bounds a pass more than its loads.
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        best, best_id = _take_better(x, cols, best, best_id)
    return _first_best(best, best_id, vocab)[1]


@triton.jit
def _lane_max_pass(base, vocab, BLOCK: tl.constexpr):
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        x, _ = _load(base, start, vocab, BLOCK)
        lane_max = tl.maximum(lane_max, x)
    return lane_max


@triton.jit
def _draw_pass(base, vocab, tau, inv_t, row_key, BLOCK: tl.constexpr):
    """Gumbel-max winner over the tokens with x >= tau."""
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        score = tl.where(x >= tau, x * inv_t + _gumbel(row_key, cols), float("-inf"))
        best, best_id = _take_better(score, cols, best, best_id)
    return _first_best(best, best_id, vocab)[1]


@triton.jit
def _wide_stats_pass(base, vocab, inv_t, BLOCK: tl.constexpr):
    """Per lane: maximum, smallest finite logit, number of finite logits, mass relative to the lane maximum (one
    exp per logit: exp(-|x - max| * inv_t) either scales the mass or adds to it), and one sampled logit (lane j
    samples block j mod the number of blocks, so the sample spreads over the row)."""
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    lane_finite = tl.zeros([BLOCK], dtype=tl.int32)
    lane_mass = tl.zeros([BLOCK], dtype=tl.float32)
    sample = tl.full([BLOCK], float("-inf"), tl.float32)
    lanes = tl.arange(0, BLOCK)
    sampled_block = lanes % tl.cdiv(vocab, BLOCK)
    for start in range(0, vocab, BLOCK):
        x, _ = _load(base, start, vocab, BLOCK)
        finite = x > float("-inf")
        rises = x > lane_max
        scale = tl.exp(-tl.abs(tl.where(finite, x - lane_max, 0.0)) * inv_t)
        lane_mass = tl.where(finite, tl.where(rises, lane_mass * scale + 1.0, lane_mass + scale), lane_mass)
        lane_max = tl.maximum(lane_max, x)
        lane_min = tl.minimum(lane_min, tl.where(finite, x, float("inf")))
        lane_finite += finite.to(tl.int32)
        sample = tl.where(sampled_block == start // BLOCK, x, sample)
    return lane_max, lane_min, lane_finite, lane_mass, sample


@triton.jit
def _bracket_pass(base, vocab, a, b, floor, row_max, inv_t, row_key, scratch_row, counter, ties, draw, G,
                  BLOCK: tl.constexpr, ABOVE: tl.constexpr):
    """One pass: the tokens with a <= x < b (a < x < b with `ties`) into scratch slots (taken from an atomic
    counter, zero before the call; in any order); with `ties`, the number of tokens tied at a and their
    Gumbel-max winner; with ABOVE, the number and mass of the tokens with x >= b; with `draw`, the Gumbel-max
    winner over x >= floor. Returns (tokens to gather, ties, tie winner score, id, count above, mass above,
    winner score, id); slots past G are not written (the caller sees the count)."""
    # the value gathered with the tokens above a: a itself, unless its ties are counted (or a = -inf: banned
    # tokens are never kept); NaN equals nothing
    gathered_a = tl.where(ties | (a == float("-inf")), float("nan"), a)
    scored = ties | draw
    tie_count = tl.zeros([BLOCK], dtype=tl.int32)
    tie_best = tl.full([BLOCK], float("-inf"), tl.float32)
    tie_id = tl.zeros([BLOCK], dtype=tl.int32)
    above_count = tl.zeros([BLOCK], dtype=tl.int32)
    above_mass = tl.zeros([BLOCK], dtype=tl.float32)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_id = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        chosen = (x < b) & ((x > a) | (x == gathered_a))
        slot = tl.atomic_add(counter + tl.zeros_like(cols), 1, mask=chosen, sem="relaxed")
        tl.store(scratch_row + slot, slot_key(x, cols), mask=chosen & (slot < G))
        if ABOVE:
            above = x >= b
            above_count += above.to(tl.int32)
            above_mass += tl.where(above, tl.exp((x - row_max) * inv_t), 0.0)
        if scored:
            score = x * inv_t + _gumbel(row_key, cols)
            if draw:
                best, best_id = _take_better(tl.where(x >= floor, score, float("-inf")), cols, best, best_id)
            if ties:
                tied = x == a
                tie_count += tied.to(tl.int32)
                tie_best, tie_id = _take_better(tl.where(tied, score, float("-inf")), cols, tie_best, tie_id)
    tl.debug_barrier()
    filled = tl.atomic_add(counter, 0, sem="relaxed")  # read at the L2, where the increments are
    tie_top, tie_token = _first_best(tie_best, tie_id, vocab)
    top, token = _first_best(best, best_id, vocab)
    return (filled, tl.sum(tie_count, axis=0), tie_top, tie_token, tl.sum(above_count, axis=0),
            tl.sum(above_mass, axis=0), top, token)


# ---- the thresholds inside the scratch -------------------------------------------------------------------------


@triton.jit
def _slot_weights(slots, valid, row_max, inv_t, BY_MASS: tl.constexpr):
    keys, values, ids = slot_parts(slots)
    if BY_MASS:
        weights = tl.where(valid, tl.exp((values - row_max) * inv_t), 0.0)
    else:
        weights = valid.to(tl.float32)
    return keys, values, ids, weights


@triton.jit
def _scratch_weight(scratch_row, n, floor_key, row_max, inv_t, BY_MASS: tl.constexpr, CHUNK: tl.constexpr):
    """Count (or mass) of the gathered tokens whose key is >= floor_key."""
    total = tl.full([], 0.0, tl.float32)
    for start in range(0, n, CHUNK):
        lanes = start + tl.arange(0, CHUNK)
        valid = lanes < n
        keys, _, _, weights = _slot_weights(tl.load(scratch_row + lanes, mask=valid, other=NO_KEY), valid, row_max,
                                            inv_t, BY_MASS)
        total += tl.sum(tl.where(keys >= floor_key, weights, 0.0), axis=0)
    return total


@triton.jit
def _scratch_select(scratch_row, n, lo, hi, target, base_weight, tie_key, tie_weight, row_max, inv_t,
                    BY_MASS: tl.constexpr, CHUNK: tl.constexpr, PIVOTS: tl.constexpr):
    """The largest key K in [lo, hi) with W(K) >= target, W(K) = base_weight + the weight (count or mass) of the
    gathered tokens with key >= K + tie_weight when K <= tie_key; the caller checks that lo reaches the target
    and hi does not. Each sweep of the scratch places PIVOTS pivots in [lo, hi) and keeps the interval between
    the last one reaching the target and the first one not: at most 8 sweeps for 32-bit keys."""
    pivot_index = tl.arange(0, PIVOTS)
    while hi - lo > 1:
        span = hi - lo
        pivots = lo + tl.maximum((span * (pivot_index + 1).to(tl.int64)) // (PIVOTS + 1), 1)
        sums = tl.zeros([PIVOTS], dtype=tl.float32)
        for start in range(0, n, CHUNK):
            lanes = start + tl.arange(0, CHUNK)
            valid = lanes < n
            keys, _, _, weights = _slot_weights(tl.load(scratch_row + lanes, mask=valid, other=NO_KEY), valid,
                                                row_max, inv_t, BY_MASS)
            sums += tl.sum(tl.where(keys[:, None] >= pivots[None, :], weights[:, None], 0.0), axis=0)
        sums += base_weight + tl.where(pivots <= tie_key, tie_weight, 0.0)
        reached = tl.sum((sums >= target).to(tl.int32), axis=0)  # W falls as the pivot rises: a prefix reaches
        lo = tl.where(reached > 0, tl.max(tl.where(pivot_index == reached - 1, pivots, 0), axis=0), lo)
        hi = tl.where(reached < PIVOTS, tl.max(tl.where(pivot_index == reached, pivots, 0), axis=0), hi)
    return lo


@triton.jit
def _scratch_min(scratch_row, n, floor_key, CHUNK: tl.constexpr):
    """The smallest gathered logit with key >= floor_key (+inf when none)."""
    smallest = tl.full([], float("inf"), tl.float32)
    for start in range(0, n, CHUNK):
        lanes = start + tl.arange(0, CHUNK)
        keys, values, _ = slot_parts(tl.load(scratch_row + lanes, mask=lanes < n, other=NO_KEY))
        smallest = tl.minimum(smallest, tl.min(tl.where((lanes < n) & (keys >= floor_key), values, float("inf")),
                                               axis=0))
    return smallest


@triton.jit
def _scratch_draw(scratch_row, n, tau, inv_t, row_key, vocab, CHUNK: tl.constexpr):
    """Gumbel-max winner (score, token) over the gathered tokens with x >= tau; (-inf, vocab) when none."""
    best = tl.full([], float("-inf"), tl.float32)
    token = tl.full([], vocab, tl.int64)
    for start in range(0, n, CHUNK):
        lanes = start + tl.arange(0, CHUNK)
        _, values, ids = slot_parts(tl.load(scratch_row + lanes, mask=lanes < n, other=NO_KEY))
        score = tl.where((lanes < n) & (values >= tau), values * inv_t + _gumbel(row_key, ids), float("-inf"))
        top = tl.max(score, axis=0)
        top_id = tl.min(tl.where(score == top, ids, vocab), axis=0)
        best, token = _better(best, token, top, top_id)
    return best, token


@triton.jit
def _finish(scratch_row, n, a, b, tie_count, tie_best, tie_token, above_count, above_mass, best, token, row_max,
            inv_t, k_target, topk_on, p, topp_on, tau_min, total_mass, covers_bottom, row_key, vocab,
            CHUNK: tl.constexpr, PIVOTS: tl.constexpr):
    """Every threshold of the row from its bracket: the n gathered tokens (in the scratch), the tokens tied at a
    (count, winner), those at or above b (count, mass, winner over x >= max(b, tau_min)), and the row's total mass
    (top-p without top-k). Then the draw. Returns the token, or SEARCH when the bracket does not hold a threshold
    (below a, unless `covers_bottom`: nothing lies below a, or tau_min >= a: min-p decides; at or above b)."""
    a_key = key_of(a)
    # W(top_key) is what lies at or above b (the count and mass the caller checks against the targets)
    top_key = tl.minimum(key_of(b), key_of(row_max) + 1)
    tie_weight = tie_count.to(tl.float32)
    tie_mass = tl.where(tie_count > 0, tie_weight * tl.exp((a - row_max) * inv_t), 0.0)
    failed = tl.zeros([], dtype=tl.int32)  # 1: the bracket does not hold a threshold
    tau_k = tl.full([], float("-inf"), tl.float32)
    survivors_key = a_key
    if topk_on:
        failed = ((above_count >= k_target) | (above_count + n + tie_count < k_target)).to(tl.int32)
        if failed == 0:
            survivors_key = _scratch_select(scratch_row, n, a_key, top_key, k_target.to(tl.float32),
                                            above_count.to(tl.float32), a_key, tie_weight, row_max, inv_t, False,
                                            CHUNK, PIVOTS)
            tau_k = value_of(survivors_key)
    survivors = total_mass
    tau_p = tl.full([], float("-inf"), tl.float32)
    if topp_on & (failed == 0):
        reach = (above_mass + _scratch_weight(scratch_row, n, survivors_key, row_max, inv_t, True, CHUNK)
                 + tl.where(survivors_key <= a_key, tie_mass, 0.0))
        if topk_on:
            survivors = reach
        target = p * survivors
        if above_mass >= target:
            failed = tl.full([], 1, tl.int32)
        elif reach >= target:
            tau_p = value_of(_scratch_select(scratch_row, n, survivors_key, top_key, target, above_mass, a_key,
                                              tie_mass, row_max, inv_t, True, CHUNK, PIVOTS))
        elif covers_bottom:  # rounding left the whole mass short of the target: keep every survivor
            tau_p = tl.minimum(_scratch_min(scratch_row, n, survivors_key, CHUNK),
                               tl.where(tie_count > 0, a, float("inf")))
        elif tau_min < a:  # tau_p lies below a; at or above it, min-p's threshold would decide alone
            failed = tl.full([], 1, tl.int32)
    tau = tl.maximum(tl.maximum(tau_k, tau_p), tau_min)
    top, top_token = _scratch_draw(scratch_row, n, tau, inv_t, row_key, vocab, CHUNK)
    top, top_token = _better(top, top_token, best, token)
    top, top_token = _better(top, top_token, tl.where((tie_count > 0) & (a >= tau), tie_best, float("-inf")),
                             tie_token)
    top_token = tl.where(top == float("-inf"), 0, top_token)  # every score -inf: 0, as the torch argmax gives
    return tl.where(failed == 1, SEARCH, top_token)


# ---- the kernels -----------------------------------------------------------------------------------------------


@triton.jit
def _min_p_threshold(row_max, temperature, minimum_p):
    """tau_min (-inf when min-p is off)."""
    return tl.where(minimum_p > 0.0, row_max + temperature * tl.log(tl.where(minimum_p > 0.0, minimum_p, 1.0)),
                    float("-inf"))


@triton.jit
def _row_settings(temperatures, top_k, top_p, min_p, seeds, positions, row, vocab):
    temperature = tl.load(temperatures + row)
    inv_t = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.where(temperature == 0.0, 1.0, temperature))
    k = tl.load(top_k + row)
    p = tl.load(top_p + row)
    minimum_p = tl.load(min_p + row)
    return (temperature, inv_t, k, p, minimum_p, _row_key(tl.load(seeds + row), tl.load(positions + row)),
            k < vocab, p < 1.0)


@triton.jit
def _narrow_row(base, vocab, inv_t, k, p, topp_on, temperature, minimum_p, row_key, scratch_row,
                counter, G, BLOCK: tl.constexpr, NARROW: tl.constexpr, CHUNK: tl.constexpr,
                PIVOTS: tl.constexpr):
    """A row with top-k <= NARROW: the lane-maximum bracket [k-th largest lane maximum, +inf), two passes."""
    lane_max = _lane_max_pass(base, vocab, BLOCK)
    row_max = tl.max(lane_max, axis=0)
    tau_min = _min_p_threshold(row_max, temperature, minimum_p)
    a = value_of(_select(key_of(lane_max), tl.full([BLOCK], 1.0, tl.float32), k.to(tl.float32)))
    # Tokens above a lie in the < k lanes whose maximum exceeds a; those tied at a are counted instead of gathered
    # when more than NARROW lanes reach a (else those lanes bound them).
    ties = (tl.sum((lane_max >= a).to(tl.int32), axis=0) > NARROW) & (a > float("-inf"))
    infinite = tl.full([], float("inf"), tl.float32)
    n, tie_count, tie_best, tie_token, _, _, _, _ = _bracket_pass(
        base, vocab, a, infinite, infinite, row_max, inv_t, row_key, scratch_row, counter, ties, False, G, BLOCK,
        False)
    # a = -inf: fewer than k lanes hold a finite logit, and every finite logit was gathered
    k_target = tl.where(a > float("-inf"), k, tl.minimum(k, n.to(tl.int64)))
    token = tl.full([], 0, tl.int64)
    if n + tie_count > 0:
        token = _finish(scratch_row, n, a, infinite, tie_count, tie_best, tie_token, tl.full([], 0, tl.int32),
                        tl.full([], 0.0, tl.float32), tl.full([], float("-inf"), tl.float32),
                        tl.full([], vocab, tl.int64), row_max, inv_t, k_target, True, p, topp_on, tau_min,
                        tl.full([], 0.0, tl.float32), True, row_key, vocab, CHUNK, PIVOTS)
    return token


@triton.jit
def _sample_kernel(logits, stride, out, temperatures, top_k, top_p, min_p, seeds, positions, scratch, counters,
                   vocab, G, BLOCK: tl.constexpr, NARROW: tl.constexpr, CHUNK: tl.constexpr, PIVOTS: tl.constexpr):
    """Greedy, temperature-only, min-p-only rows and rows with top-k <= NARROW; the others are marked WIDE."""
    row = tl.program_id(0).to(tl.int64)
    base = logits + row * stride
    temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on = _row_settings(
        temperatures, top_k, top_p, min_p, seeds, positions, row, vocab)
    if temperature == 0.0:
        token = _argmax_pass(base, vocab, BLOCK)
    elif topk_on & (k <= NARROW):
        token = _narrow_row(base, vocab, inv_t, k, p, topp_on, temperature, minimum_p, row_key, scratch + row * G,
                            counters + row * 4, G, BLOCK, NARROW, CHUNK, PIVOTS)
    elif topk_on | topp_on:
        token = tl.full([], WIDE, tl.int64)
    else:
        tau = tl.full([], float("-inf"), tl.float32)
        if minimum_p > 0.0:
            tau = _min_p_threshold(tl.max(_lane_max_pass(base, vocab, BLOCK), axis=0), temperature, minimum_p)
        token = _draw_pass(base, vocab, tau, inv_t, row_key, BLOCK)
    tl.store(out + row, token)


@triton.jit
def _rank_bracket(keys, ones, sample, count, lo_rank, hi_rank):
    """(a: the lo_rank-th largest sample, -inf past the last; b: the smallest sample above the (hi_rank + 1)-th
    largest, so that at most hi_rank samples lie at or above it, +inf when hi_rank < 1; that (hi_rank + 1)-th
    largest)."""
    lo_key, below_key = _select_pair(keys, ones, tl.maximum(lo_rank, 1.0), keys, ones, tl.maximum(hi_rank + 1.0, 1.0))
    below = value_of(below_key)
    b = tl.min(tl.where(sample > below, sample, float("inf")), axis=0)
    return (tl.where(lo_rank > count, float("-inf"), value_of(lo_key)), tl.where(hi_rank < 1.0, float("inf"), b),
            below)


@triton.jit
def _spread(rank, count, effective):
    """Half-width of the bracket around an estimated sample rank: six standard deviations of a quantile estimated
    from `effective` independent samples, in samples (plus a margin for small ranks)."""
    q = tl.minimum(tl.maximum(rank / count, 0.0), 1.0)
    return 6.0 * count * tl.sqrt(q * (1.0 - q) / effective) + 8.0


@triton.jit
def _fits(samples, per_sample, slots):
    """Whether the tokens that `samples` of the sample stand for fit in `slots`, six standard deviations over."""
    return (samples + 6.0 * tl.sqrt(samples) + 8.0) * per_sample <= slots


@triton.jit
def _wide_bracket(lane_max, sample, row_max, inv_t, finite, total_mass, k_target, topk_on, p, topp_on, tau_min, G,
                  BLOCK: tl.constexpr):
    """[a, b) and whether many tokens may tie at a, from the sample and the lane maxima (see the module
    docstring): a at about 6 standard deviations of the estimate below the threshold's estimated rank among the
    samples, b as far above; each sample stands for finite / count tokens, and the half-width is capped so the
    bracket holds about 0.3 G tokens. A top-p row whose estimated threshold lies below its min-p threshold,
    which few enough tokens reach, gets [tau_min, +inf) instead: the scratch then holds every token min-p keeps,
    and the top-p threshold is found there or proved below tau_min (min-p decides). A top-heavy row's mass
    estimate is too loose for a bracket of 0.3 G tokens around a low top-p threshold, and min-p makes it moot."""
    valid = sample > float("-inf")
    ones = valid.to(tl.float32)
    count = tl.sum(ones, axis=0)
    keys = key_of(sample)
    sample_mass = tl.where(valid, tl.exp((sample - row_max) * inv_t), 0.0)
    per_sample = finite.to(tl.float32) / count
    widest = 0.3 * G / per_sample
    lane_keys = key_of(lane_max)
    a = tl.full([], float("-inf"), tl.float32)
    b = tl.full([], float("inf"), tl.float32)
    below_b = tl.full([], float("-inf"), tl.float32)
    survivors = tl.sum(sample_mass, axis=0)
    if topk_on:
        rank = k_target.to(tl.float32) / per_sample
        spread = tl.minimum(_spread(rank, count, count), widest)
        a, b, below_b = _rank_bracket(keys, ones, sample, count, tl.math.ceil(rank + spread),
                                      tl.math.floor(rank - spread))
        lane_key, estimate = _select_pair(lane_keys, tl.full([BLOCK], 1.0, tl.float32), k_target.to(tl.float32),
                                          keys, ones, tl.maximum(rank, 1.0))
        if k_target <= BLOCK:  # at least k tokens lie at or above the k-th largest lane maximum
            a = tl.maximum(a, value_of(lane_key))
        survivors = tl.sum(tl.where(keys >= estimate, sample_mass, 0.0), axis=0)
    if topp_on:
        # mass(x >= v) >= the mass of the lane maxima >= v, and the survivors' mass <= the row's: tau_p >= lowest
        lane_mass = tl.where(lane_max > float("-inf"), tl.exp((lane_max - row_max) * inv_t), 0.0)
        threshold, lowest_key = _select_pair(keys, sample_mass, p * survivors, lane_keys, lane_mass, p * total_mass)
        lowest = tl.where(tl.sum(lane_mass, axis=0) >= p * total_mass, value_of(lowest_key), float("-inf"))
        # no sampled mass (all of it above the samples, or underflowed): the threshold lies above every sample
        threshold = tl.where(survivors > 0.0, threshold, U_TOP)
        squares = tl.sum(sample_mass * sample_mass, axis=0)
        effective = tl.where(squares > 0.0, survivors / tl.sqrt(squares), 1.0)
        spread = _spread(tl.sum(tl.where(keys >= threshold, ones, 0.0), axis=0), count,
                         tl.minimum(tl.maximum(effective * effective, 1.0), count))
        # Top-p alone: M is exact (the stats pass), so the sample may estimate the mass below the threshold
        # instead of the threshold's share of the sampled mass. Where a few heavy tokens make that share loose
        # and the threshold lies deep in a flat tail (p near 1), the tail's many light samples pin it far
        # tighter: a mass error of sqrt(sum of their squared weights) moves it by that over its own weight.
        allowed = (1.0 - p) * total_mass / per_sample
        tail_key = tl.where(survivors > allowed, _select(keys, sample_mass, survivors - allowed),
                            tl.min(tl.where(valid, keys, U_TOP), axis=0))
        tail_squares = tl.sum(tl.where(keys < tail_key, sample_mass * sample_mass, 0.0), axis=0)
        tail_weight = tl.exp((value_of(tail_key) - row_max) * inv_t)
        tail_spread = tl.where(tail_weight > 0.0, 6.0 * tl.sqrt(tail_squares) / tail_weight + 8.0, float("inf"))
        use_tail = (tail_spread < spread) & (topk_on == 0) & (survivors > 0.0)
        threshold = tl.where(use_tail, tail_key, threshold)
        spread = tl.minimum(tl.where(use_tail, tail_spread, spread), widest)
        rank = tl.sum(tl.where(keys >= threshold, ones, 0.0), axis=0)
        a_p, b_p, below_p = _rank_bracket(keys, ones, sample, count, tl.math.ceil(rank + spread),
                                          tl.math.floor(rank - spread))
        if topk_on:  # the bracket spans both thresholds: top-k's bottom, top-p's top
            below_b = tl.where(b_p > b, below_p, below_b)
            b = tl.maximum(b, b_p)
        else:
            a = tl.maximum(a_p, lowest)
            b = b_p
            below_b = below_p
            estimate = value_of(threshold)
            tied = tl.sum(tl.where(sample == estimate, ones, 0.0), axis=0)
            if (survivors > 0.0) & (tied * per_sample > 0.25 * G):
                # The estimate is the value of a large tie group (low-precision logits), which a bracket of
                # rank quantiles would hold whole and overflow the scratch. Bracket two groups instead, the
                # lower one counted at a and the upper one gathered: the estimate's and the neighbour on the
                # side where the sample's mass lies nearest the target (the threshold moves a group only there).
                up = tl.min(tl.where(sample > estimate, sample, float("inf")), axis=0)
                up2 = tl.min(tl.where(sample > up, sample, float("inf")), axis=0)
                down = tl.max(tl.where(sample < estimate, sample, float("-inf")), axis=0)
                target = p * survivors
                above_group = tl.sum(tl.where(sample > estimate, sample_mass, 0.0), axis=0)
                with_group = tl.sum(tl.where(sample >= estimate, sample_mass, 0.0), axis=0)
                up_count = tl.sum(tl.where(sample == up, ones, 0.0), axis=0)
                a = estimate
                b = up
                if target - above_group < with_group - target:
                    if _fits(up_count, per_sample, G):
                        b = up2
                elif _fits(tied, per_sample, G) & (down > float("-inf")):
                    a = down
                a = tl.maximum(a, lowest)
                below_b = tl.max(tl.where(sample < b, sample, float("-inf")), axis=0)
            above_min = tl.sum(tl.where(sample >= tau_min, ones, 0.0), axis=0)
            if (value_of(threshold) < tau_min) & _fits(above_min, per_sample, 0.3 * G):
                a = tau_min
                b = tl.full([], float("inf"), tl.float32)
                below_b = b
        # b at or below that bound: the sample missed the top of the row (a few heavy tokens), b says nothing
        b = tl.where(b > lowest, b, float("inf"))
    b = tl.where(b > a, b, float("inf"))
    smallest = tl.min(tl.where(valid, sample, float("inf")), axis=0)
    if (a == float("-inf")) & (below_b == smallest):  # the window ends in the bottom tie group: bracket it at a
        a = smallest
    ties = (tl.sum((sample == a).to(tl.float32), axis=0) * per_sample > 0.25 * G) & (a > float("-inf"))
    return a, b, ties


@triton.jit
def _sample_wide_kernel(logits, stride, out, temperatures, top_k, top_p, min_p, seeds, positions, scratch,
                        counters, vocab, G, BLOCK: tl.constexpr, CHUNK: tl.constexpr, PIVOTS: tl.constexpr,
                        SEARCH_PIVOTS: tl.constexpr, SEARCH_CAP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """The rows _sample_kernel marked WIDE (every other row returns at once): top-p without top-k, top-k >
    NARROW; a stats pass, the bracket pass with the draw over x >= b, the thresholds in the scratch. A row whose
    bracket missed (or marked SEARCH) takes the exact search, and its counters[3] says so."""
    row = tl.program_id(0).to(tl.int64)
    code = tl.load(out + row)
    if (code == WIDE) | (code == SEARCH):
        base = logits + row * stride
        temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on = _row_settings(
            temperatures, top_k, top_p, min_p, seeds, positions, row, vocab)
        token = code
        if code == WIDE:
            token = _wide_row(base, vocab, temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on,
                              scratch + row * G, counters + row * 4, G, BLOCK, CHUNK, PIVOTS)
        if token == SEARCH:
            token = _search_row(base, vocab, temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on,
                                scratch + row * G, counters + row * 4, BLOCK, SEARCH_PIVOTS, SEARCH_CAP, MAX_PASSES)
            tl.store(counters + row * 4 + 3, 1)
        tl.store(out + row, token)


@triton.jit
def _wide_row(base, vocab, temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on, scratch_row, counter, G,
              BLOCK: tl.constexpr, CHUNK: tl.constexpr, PIVOTS: tl.constexpr):
    """A wide row's token, or SEARCH when its bracket missed."""
    lane_max, lane_min, lane_finite, lane_mass, sample = _wide_stats_pass(base, vocab, inv_t, BLOCK)
    row_max = tl.max(lane_max, axis=0)
    token = tl.full([], 0, tl.int64)  # every token banned: 0, as the torch argmax gives
    if row_max > float("-inf"):
        finite = tl.sum(lane_finite, axis=0)
        total_mass = tl.sum(lane_mass * tl.exp((lane_max - row_max) * inv_t), axis=0)
        tau_min = _min_p_threshold(row_max, temperature, minimum_p)
        k_target = tl.minimum(k, finite.to(tl.int64))
        a = tl.full([], float("-inf"), tl.float32)
        b = tl.full([], float("inf"), tl.float32)
        ties = finite < 0
        if finite > G:  # else every finite logit fits in the scratch
            a, b, ties = _wide_bracket(lane_max, sample, row_max, inv_t, finite, total_mass, k_target, topk_on, p,
                                       topp_on, tau_min, G, BLOCK)
        floor = tl.maximum(b, tau_min)
        draw = floor < float("inf")
        n, tie_count, tie_best, tie_token, above_count, above_mass, best, best_token = _bracket_pass(
            base, vocab, a, b, floor, row_max, inv_t, row_key, scratch_row, counter,
            ties | (draw & (a > float("-inf"))), draw, G, BLOCK, True)
        token = tl.full([], SEARCH, tl.int64)
        if n <= G:
            token = _finish(scratch_row, n, a, b, tie_count, tie_best, tie_token, above_count, above_mass, best,
                            best_token, row_max, inv_t, k_target, topk_on, p, topp_on, tau_min, total_mass,
                            a == float("-inf"), row_key, vocab, CHUNK, PIVOTS)
    return token


# ---- the exact search, for rows whose bracket missed -------------------------------------------------------------------------


@triton.jit
def _stats_pass(base, vocab, inv_t, BLOCK: tl.constexpr):
    """(max, smallest finite logit, number of finite logits, sum of exp((x - max) * inv_t)), one online pass."""
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_min = tl.full([BLOCK], float("inf"), tl.float32)
    finite = tl.zeros([BLOCK], dtype=tl.int32)
    lane_mass = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, vocab, BLOCK):
        x, _ = _load(base, start, vocab, BLOCK)
        new_max = tl.maximum(lane_max, x)
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
def _count_and_mass_above(x, pivots, row_max, inv_t, counts, masses):
    """(count, mass) above each pivot of one block, reduced across the program at once."""
    above = x[:, None] >= pivots[None, :]
    counts += tl.sum(above.to(tl.int32), axis=0)
    masses += tl.sum(tl.where(above, tl.exp((x - row_max) * inv_t)[:, None], 0.0), axis=0)
    return counts, masses


@triton.jit
def _search(base, vocab, row_max, inv_t, lo, count_lo, mass_lo, target, BY_MASS: tl.constexpr,
            BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CAP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Narrow [lo, hi) around the largest threshold v with W(x >= v) >= target (W: the token count, or the mass
    when BY_MASS), from a lo that reaches the target, until [lo, hi) holds at most CAP tokens, at most MAX_PASSES
    passes. Returns lo, hi and the (count, mass) at or above each; stops early when lo reaches the top."""
    hi = tl.full([], float("inf"), tl.float32)
    count_hi = tl.full([], 0, tl.int32)
    mass_hi = tl.full([], 0.0, tl.float32)
    lanes = tl.arange(0, PIVOTS)
    passes = 0
    top = tl.minimum(hi, row_max)
    SUB: tl.constexpr = BLOCK // 4
    while (count_lo > CAP) & (count_lo - count_hi > CAP) & (lo < top) & (passes < MAX_PASSES):
        pivots = lo + (top - lo) * ((lanes + 1).to(tl.float32) / PIVOTS)
        pivots = tl.where(lanes == PIVOTS - 1, top, pivots)
        counts = tl.zeros([PIVOTS], dtype=tl.int32)
        masses = tl.zeros([PIVOTS], dtype=tl.float32)
        for start in range(0, vocab, BLOCK):  # four loads in flight before the first is used
            x0, _ = _load(base, start, vocab, SUB)
            x1, _ = _load(base, start + SUB, vocab, SUB)
            x2, _ = _load(base, start + 2 * SUB, vocab, SUB)
            x3, _ = _load(base, start + 3 * SUB, vocab, SUB)
            counts, masses = _count_and_mass_above(x0, pivots, row_max, inv_t, counts, masses)
            counts, masses = _count_and_mass_above(x1, pivots, row_max, inv_t, counts, masses)
            counts, masses = _count_and_mass_above(x2, pivots, row_max, inv_t, counts, masses)
            counts, masses = _count_and_mass_above(x3, pivots, row_max, inv_t, counts, masses)
        if BY_MASS:
            reached = masses >= target
        else:
            reached = counts.to(tl.float32) >= target
        num_valid = tl.sum(reached.to(tl.int32), axis=0)  # the weight falls as the pivot rises: a prefix reaches
        if num_valid > 0:
            lo = _pick(pivots, num_valid - 1, lanes)
            count_lo = _pick(counts, num_valid - 1, lanes)
            mass_lo = _pick(masses, num_valid - 1, lanes)
        if num_valid < PIVOTS:
            hi = _pick(pivots, num_valid, lanes)
            count_hi = _pick(counts, num_valid, lanes)
            mass_hi = _pick(masses, num_valid, lanes)
        top = tl.minimum(hi, row_max)
        passes += 1
    if count_lo <= CAP:
        hi = tl.full([], float("inf"), tl.float32)
        count_hi = tl.full([], 0, tl.int32)
        mass_hi = tl.full([], 0.0, tl.float32)
    return lo, hi, count_lo, count_hi, mass_lo, mass_hi


@triton.jit
def _gather_sorted(base, vocab, lo, hi, scratch_row, counter, BLOCK: tl.constexpr, CAP: tl.constexpr):
    """The tokens with lo <= x < hi, sorted by logit descending then id ascending: (values, ids, lane is filled),
    valid when at most CAP."""
    for start in range(0, vocab, BLOCK):
        x, cols = _load(base, start, vocab, BLOCK)
        chosen = (x >= lo) & (x < hi)
        slot = tl.atomic_add(counter + tl.zeros_like(cols), 1, mask=chosen, sem="relaxed")
        tl.store(scratch_row + slot, slot_key(x, cols), mask=chosen & (slot < CAP))
    tl.debug_barrier()
    filled = tl.atomic_add(counter, 0, sem="relaxed")
    lanes = tl.arange(0, CAP)
    slots = tl.sort(tl.load(scratch_row + lanes, mask=lanes < filled, other=NO_KEY), descending=True)
    _, values, ids = slot_parts(slots)
    return values, ids, lanes < filled


@triton.jit
def _first_reaching(values, cumulative, target, filled, lanes, CAP: tl.constexpr):
    """The value at the first filled lane whose cumulative weight reaches target (the last filled lane if
    rounding leaves every lane short)."""
    first = tl.min(tl.where((cumulative >= target) & filled, lanes, CAP), axis=0)
    last = tl.max(tl.where(filled, lanes, 0), axis=0)
    return _pick(values, tl.minimum(first, last), lanes)


@triton.jit
def _search_row(base, vocab, temperature, inv_t, k, p, minimum_p, row_key, topk_on, topp_on, scratch_row, counter,
                BLOCK: tl.constexpr, PIVOTS: tl.constexpr, CAP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """A row whose bracket missed: narrowing passes place top-k, then top-p among its survivors, each exactly once
    at most CAP tokens remain in its interval (else, after MAX_PASSES passes, the whole interval is kept); one
    last pass draws over the kept set."""
    row_max, row_min, finite, total = _stats_pass(base, vocab, inv_t, BLOCK)
    tau = _min_p_threshold(row_max, temperature, minimum_p)
    k_target = tl.minimum(k, finite).to(tl.float32)
    lanes = tl.arange(0, CAP)
    if topk_on:
        lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
            base, vocab, row_max, inv_t, row_min, finite, total, k_target, False, BLOCK, PIVOTS, CAP, MAX_PASSES)
    else:
        lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
            base, vocab, row_max, inv_t, row_min, finite, total, p * total, True, BLOCK, PIVOTS, CAP, MAX_PASSES)
    threshold = lo  # more than CAP tokens still in [lo, hi) after MAX_PASSES: keep them all
    count_kept = count_lo
    survivors = mass_lo
    if count_lo - count_hi <= CAP:  # the exact threshold, inside the interval
        values, ids, filled = _gather_sorted(base, vocab, lo, hi, scratch_row, counter + 1, BLOCK, CAP)
        weights = tl.where(filled, tl.exp((values - row_max) * inv_t), 0.0)
        if topk_on:
            threshold = _first_reaching(values, (count_hi + lanes + 1).to(tl.float32), k_target, filled, lanes, CAP)
        else:
            threshold = _first_reaching(values, mass_hi + tl.cumsum(weights, axis=0), p * total, filled, lanes, CAP)
        kept = filled & (values >= threshold)
        count_kept = count_hi + tl.sum(kept.to(tl.int32), axis=0)
        survivors = mass_hi + tl.sum(tl.where(kept, weights, 0.0), axis=0)
    if topk_on & topp_on:  # top-p inside the top-k survivors: a second search, up from tau_k
        lo, hi, count_lo, count_hi, mass_lo, mass_hi = _search(
            base, vocab, row_max, inv_t, threshold, count_kept, survivors, p * survivors, True, BLOCK, PIVOTS, CAP,
            MAX_PASSES)
        tau_k = threshold
        threshold = lo
        if count_lo - count_hi <= CAP:
            values, ids, filled = _gather_sorted(base, vocab, lo, hi, scratch_row, counter + 2, BLOCK, CAP)
            weights = tl.where(filled, tl.exp((values - row_max) * inv_t), 0.0)
            threshold = _first_reaching(values, mass_hi + tl.cumsum(weights, axis=0), p * survivors, filled, lanes,
                                        CAP)
        threshold = tl.maximum(threshold, tau_k)
    return _draw_pass(base, vocab, tl.maximum(tau, threshold), inv_t, row_key, BLOCK)


# ---- the entry -------------------------------------------------------------------------------------------------


def scratch_slots(vocab: int, block: int = DEFAULT_BLOCK, narrow: int = NARROW_K) -> int:
    """G, the scratch slots per row: the most tokens the lane-maximum bracket of a top-k <= narrow row can hold
    (see the module docstring), and at least SEARCH_CAP for the search's gathers."""
    return max(min(narrow, block) * triton.cdiv(vocab, block), SEARCH_CAP)


def fused_sample(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 min_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, *, block: int = DEFAULT_BLOCK,
                 num_warps: int = DEFAULT_WARPS, narrow: int = NARROW_K) -> torch.Tensor:
    """logits [batch, vocab] fp32/bf16/fp16 (unit stride along vocab) -> token ids int64 [batch]. Per-row
    settings: temperatures f32 (0 = greedy), top_k int (>= vocab = off), top_p f32 (1 = off), min_p f32
    (0 = off), seeds and positions int64. No host synchronisation; `block` is a power of two."""
    batch, vocab = logits.shape
    assert logits.stride(1) == 1, "logits must be contiguous along the vocabulary"
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    slots = scratch_slots(vocab, block, narrow)
    scratch = torch.empty(batch, slots, dtype=torch.int64, device=logits.device)
    # per row: the gathers' slot counters (the bracket's, the search's two), whether the search ran
    counters = torch.zeros(batch, 4, dtype=torch.int32, device=logits.device)
    args = (logits, logits.stride(0), out, temperatures, top_k, top_p, min_p, seeds, positions, scratch, counters,
            vocab, slots)
    _sample_kernel[(batch,)](*args, BLOCK=block, NARROW=min(narrow, block), CHUNK=CHUNK, PIVOTS=PIVOTS,
                             num_warps=num_warps)
    _sample_wide_kernel[(batch,)](*args, BLOCK=block, CHUNK=CHUNK, PIVOTS=PIVOTS, SEARCH_PIVOTS=PIVOTS_SEARCH,
                                  SEARCH_CAP=SEARCH_CAP, MAX_PASSES=MAX_PASSES, num_warps=num_warps)
    return out
