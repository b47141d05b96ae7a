"""The inner step shared by the paged-attention kernels: one tile of keys of one sequence, online softmax."""
from __future__ import annotations

import math

import triton
import triton.language as tl


def score_scales(scale: float, softcap: float | None, k_scale: float = 1.0) -> tuple[float, float]:
    """(qk_scale, softcap) arguments of attend_paged_tile for softmax scale `scale`, an optional logit cap and the
    K scale of an FP8 cache (q.k of the stored keys times k_scale is q.k of the real ones)."""
    if softcap is None:
        return scale * k_scale * math.log2(math.e), 0.0
    return scale * k_scale / softcap, softcap * math.log2(math.e)


def fp16_dots(q, k_cache) -> bool:
    """dot_query's FP16_DOTS for a query and a cache (torch tensors): an FP8 cache read by a 16-bit query."""
    return k_cache.dtype.itemsize == 1 and q.dtype.itemsize == 2


@triton.jit
def dot_query(query, qk_scale, FP16_DOTS: tl.constexpr):
    """(query, qk_scale) as attend_paged_tile takes them. FP16_DOTS (an FP8 cache and a 16-bit query): the tiles'
    dots run in fp16, since FP8 -> fp16 is one conversion instruction per pair of values on Hopper and FP8 -> bf16
    several, and at half the bytes those conversions bound the kernel. The query is pre-scaled by qk_scale (then
    1) so that it stays far inside fp16's range; fp16 holds every FP8 value exactly and the softmax weights more
    finely than bf16. An fp32 query (the CPU's reference mode) keeps fp32 dots."""
    if FP16_DOTS:
        query = (query.to(tl.float32) * qk_scale).to(tl.float16)
        qk_scale = 1.0
    return query, qk_scale


@triton.jit
def attend_paged_tile(q, acc, m_i, l_i, k_head, v_head, table_row, start, kv_end, q_pos, qk_scale,
                      stride_kb, stride_ks, stride_vb, stride_vs, window, softcap,
                      PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr,
                      PRECISION: tl.constexpr, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False):
    """Fold keys [start, start + BLOCK_N) ∩ [0, kv_end) of one sequence into the running softmax of q's rows.

    q: [M, HEAD_DIM]; acc: [M, HEAD_DIM] fp32; m_i, l_i: [M] fp32 running max (log2 units) and sum.
    k_head/v_head point at one KV head of the caches; table_row at the sequence's block-table row.
    The caches may be of q's type or FP8 (read as q's type: fp16 after dot_query); an FP8 cache's K scale is folded
    into qk_scale and its V scale is the caller's to apply to the output (acc / l_i * v_scale): see score_scales.
    Scores are in log2 units: without SOFTCAP s = q.k * qk_scale with qk_scale = scale * log2(e). SOFTCAP (Gemma 2's
    attention soft-capping, cap * tanh(q.k * scale / cap)): qk_scale = scale / cap and softcap = cap * log2(e).
    CAUSAL: row r sees only keys at positions <= q_pos[r]. WINDOW: row r sees only keys at positions
    > q_pos[r] - window (its last `window` positions, its own included: HF's sliding window); keys before every
    row's window are not read, so their block-table entries may be -1 (blocks freed once out of the window).
    PRECISION: the dots' input_precision (kernels/precision.py; "ieee" for an fp32 query).
    Without WINDOW every row must see at least one key of the first tile it is given (else its max stays -inf and
    the rescale below makes NaN); with WINDOW a row may see none yet (its max stays -inf, its sums 0)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_n < kv_end
    if WINDOW:  # keys no row sees are not even loaded: their blocks may be freed (table entry -1)
        in_range = in_range & (offs_n > tl.min(q_pos, 0) - window)
    # int64: block id x block stride overflows int32 for caches of more than 2^31 elements per layer.
    block = tl.load(table_row + offs_n // PAGE, mask=in_range, other=0).to(tl.int64)
    offset = offs_n % PAGE
    k = tl.load(k_head + (block * stride_kb + offset * stride_ks)[:, None] + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    # V is requested with K, before the softmax needs it: both tiles are in flight at once.
    v = tl.load(v_head + (block * stride_vb + offset * stride_vs)[:, None] + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    # An FP8 cache is dequantized here, in registers: its scales are in qk_scale and the caller's output scale.
    k, v = k.to(q.dtype), v.to(q.dtype)
    if SOFTCAP:
        # qk_scale = scale / softcap here; tanh(x) = 1 - 2 / (e^(2x) + 1) saturates to +-1 without NaN.
        x = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)) * softcap  # 2.885... = 2 log2(e)
    else:
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    visible = in_range[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= q_pos[:, None])
    if WINDOW:
        visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = m_new
    if WINDOW:  # a row with no visible key so far keeps max -inf: subtract 0 instead, its p and alpha are then 0
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)
