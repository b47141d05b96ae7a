"""The inner step shared by the paged-attention kernels: one tile of keys of one sequence, online softmax."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def attend_paged_tile(q, acc, m_i, l_i, k_head, v_head, table_row, start, kv_end, q_pos, qk_scale,
                      stride_kb, stride_ks, stride_vb, stride_vs,
                      PAGE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr):
    """Fold keys [start, start + BLOCK_N) ∩ [0, kv_end) of one sequence into the running softmax of q's rows.

    q: [M, HEAD_DIM]; acc: [M, HEAD_DIM] fp32; m_i, l_i: [M] fp32 running max (log2 units) and sum.
    k_head/v_head point at one KV head of the caches; table_row at the sequence's block-table row.
    CAUSAL: row r sees only keys at positions <= q_pos[r]. Every row must see at least one key of the first
    tile it is given (else its max stays -inf and the rescale below makes NaN)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    in_range = offs_n < kv_end
    # int64: block id x block stride overflows int32 for caches of more than 2^31 elements per layer.
    block = tl.load(table_row + offs_n // PAGE, mask=in_range, other=0).to(tl.int64)
    offset = offs_n % PAGE
    k = tl.load(k_head + (block * stride_kb + offset * stride_ks)[:, None] + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    # V is requested with K, before the softmax needs it: both tiles are in flight at once.
    v = tl.load(v_head + (block * stride_vb + offset * stride_vs)[:, None] + offs_d[None, :],
                mask=in_range[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    visible = in_range[None, :]
    if CAUSAL:
        visible = visible & (offs_n[None, :] <= q_pos[:, None])
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)
