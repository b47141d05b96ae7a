"""Paged attention for prefill and extend: each sequence's new tokens (a chunk of any length) attend causally to
every earlier position of the sequence — prefix-cache hits and earlier chunks alike — and to each other.

All keys are read from the paged cache, so the step's K/V must be stored first. One program per
(query tile, KV head, sequence); a tile's rows are (token, query head) pairs of the heads that share the KV head,
so a KV tile is read once for the whole group (GQA) and short chunks (decodes in a mixed batch) still fill rows.
A sliding window (a layer's last `window` positions) starts the key loop at the tile's first visible key and masks
per row; soft-capping bounds the scores. Both are compile-time switches: without them the kernel is unchanged.
An FP8 cache is read as FP8 and converted in registers (paged_tile.py); its V scale multiplies the output.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.paged_tile import attend_paged_tile, dot_query, fp16_dots, score_scales
from nanovllm.kernels.pdl import await_previous_kernel, pdl_launch_args
from nanovllm.kernels.precision import dot_precision


class PrefillConfig(NamedTuple):
    block_m: int = 128  # rows (token x query head) per program
    block_n: int = 64  # keys per tile
    num_warps: int = 8
    num_stages: int = 2


# Gemma's 256-wide heads: half the rows and keys per tile keep the tiles within registers and shared memory.
WIDE_HEAD_PREFILL = PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


@triton.jit
def _prefill_kernel(q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, qk_scale, v_scale, window,
                    softcap,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                    FP16_DOTS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    if tile * TOKENS >= q_len:
        return
    seq_len = tl.load(seq_lens + seq)
    first = seq_len - q_len + tile * TOKENS  # position of the tile's first token

    offs_r = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    tok = tile * TOKENS + offs_r // GROUP  # index in the chunk
    heads = kv_head * GROUP + offs_r % GROUP
    row_ok = (offs_r < TOKENS * GROUP) & (tok < q_len)
    query = tl.load(q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None], other=0.0)
    query, qk_scale = dot_query(query, qk_scale, FP16_DOTS)
    q_pos = first + offs_r // GROUP
    k_head = k_cache + kv_head * stride_kh
    v_head = v_cache + kv_head * stride_vh
    table_row = block_tables + seq * stride_bt

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    # Keys before the tile's first token are visible to all its rows: no causal mask there.
    causal_start = first // BLOCK_N * BLOCK_N
    lo = 0
    if WINDOW:  # the tile's first token sees nothing before first - window + 1
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
    for n in range(lo, causal_start, BLOCK_N):
        acc, m_i, l_i = attend_paged_tile(
            query, acc, m_i, l_i, k_head, v_head, table_row, n, causal_start, q_pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs, window, softcap, PAGE=PAGE, BLOCK_N=BLOCK_N,
            HEAD_DIM=HEAD_DIM, CAUSAL=False, WINDOW=WINDOW, SOFTCAP=SOFTCAP, PRECISION=PRECISION)
    kv_end = tl.minimum(first + TOKENS, seq_len)
    for n in range(causal_start, kv_end, BLOCK_N):
        acc, m_i, l_i = attend_paged_tile(
            query, acc, m_i, l_i, k_head, v_head, table_row, n, kv_end, q_pos, qk_scale,
            stride_kb, stride_ks, stride_vb, stride_vs, window, softcap, PAGE=PAGE, BLOCK_N=BLOCK_N,
            HEAD_DIM=HEAD_DIM, CAUSAL=True, WINDOW=WINDOW, SOFTCAP=SOFTCAP, PRECISION=PRECISION)
    result = acc / l_i[:, None] * v_scale
    tl.store(out + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             result.to(out.dtype.element_ty), mask=row_ok[:, None])


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                            max_query_len: int, scale: float, out: torch.Tensor | None = None,
                            config: PrefillConfig | None = None, window: int | None = None,
                            softcap: float | None = None, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim], sequence i's new tokens at rows query_start_loc[i]:[i+1] and at the
    last positions of its seq_lens[i]-token context; k_cache/v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim] already holding every position < seq_lens[i], of q's type or FP8 (then k_scale / v_scale are its
    scales). max_query_len (host int) sizes the grid.
    window: a token sees only the last `window` positions up to its own; softcap: scores cap * tanh(s / cap).
    Returns [num_tokens, num_heads, head_dim]."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == v_cache.stride(-1) == 1
    config = config or (PrefillConfig() if head_dim <= 128 else WIDE_HEAD_PREFILL)
    group = num_heads // num_kv_heads
    assert config.block_m >= group, "a tile must hold at least one token's query heads"
    out = torch.empty_like(q) if out is None else out
    batch = seq_lens.shape[0]
    tokens_per_tile = config.block_m // group
    qk_scale, softcap_log2 = score_scales(scale, softcap, k_scale)
    _prefill_kernel[(triton.cdiv(max_query_len, tokens_per_tile), num_kv_heads, batch)](
        q, k_cache, v_cache, out, block_tables, seq_lens, query_start_loc, qk_scale, v_scale, window or 0,
        softcap_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=page, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        WINDOW=window is not None, SOFTCAP=softcap is not None, num_warps=config.num_warps,
        FP16_DOTS=fp16_dots(q, k_cache), PRECISION=dot_precision(q.dtype),
        num_stages=config.num_stages, **pdl_launch_args(q),
    )
    return out
