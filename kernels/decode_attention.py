"""Paged attention for decode: one query token per sequence over its whole cached context.

One program per (sequence, KV head, split): the query heads that share a KV head are the rows of one tile, so each
KV block is read once per step (GQA). With `num_splits > 1` the context is cut into that many contiguous ranges
(flash-decoding) whose partial results a second kernel merges. Nothing here reads device values on the host and
every shape follows from the inputs' shapes and `num_splits`, so the call can be captured in a CUDA graph.
A sliding window only moves the start of the context range (the one query sees the last `window` positions);
soft-capping bounds the scores. Both are compile-time switches: without them the kernel is unchanged.
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

# Below this many keys per split, writing and merging partial results costs more than the parallelism gains.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 32


class DecodeConfig(NamedTuple):
    block_n: int = 64  # keys per tile
    num_warps: int = 4
    num_stages: int = 2


WIDE_HEAD_DECODE = DecodeConfig(block_n=32)  # Gemma's 256-wide heads: half the keys per tile
# An FP8 cache: twice the keys per tile for the same bytes in flight, and a deeper pipeline (H100, batch 256 x
# 1024 keys, 8 KV heads of 128: 286 -> 251 us; scripts/bench_kernels.py --sweep --kv-cache-dtype fp8)
FP8_DECODE = DecodeConfig(block_n=128, num_stages=4)


def default_decode_config(head_dim: int, cache_dtype: torch.dtype) -> DecodeConfig:
    if head_dim > 128:
        return WIDE_HEAD_DECODE
    return FP8_DECODE if cache_dtype.itemsize == 1 else DecodeConfig()


@triton.jit
def _decode_kernel(q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, qk_scale, v_scale, window,
                   softcap,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                   FP16_DOTS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    seq_len = tl.load(seq_lens + seq)
    lo = 0
    if WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    # Whole tiles per split, so that only the last tile of the sequence is partial.
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len - lo, BLOCK_N), num_splits)
    start = lo + split * tiles_per_split * BLOCK_N
    end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + offs_h
    head_ok = offs_h < GROUP
    query = tl.load(q + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=head_ok[:, None], other=0.0)
    query, qk_scale = dot_query(query, qk_scale, FP16_DOTS)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n in range(start, end, BLOCK_N):
        acc, m_i, l_i = attend_paged_tile(
            query, acc, m_i, l_i, k_cache + kv_head * stride_kh, v_cache + kv_head * stride_vh,
            block_tables + seq * stride_bt, n, end, offs_h, qk_scale, stride_kb, stride_ks, stride_vb, stride_vs,
            window, softcap, PAGE=PAGE, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM, CAUSAL=False, SOFTCAP=SOFTCAP,
            PRECISION=PRECISION)
    # An empty range (seq_len 0, or a split past the end) has l_i = 0 and acc = 0: it yields zeros, not NaN.
    result = acc / tl.maximum(l_i, 1e-30)[:, None] * v_scale
    if SPLIT:
        rows = (seq * tl.num_programs(1) * GROUP + heads) * num_splits + split  # part_* are [B, H, S(, D)]
        tl.store(part_out + rows[:, None] * HEAD_DIM + offs_d[None, :], result, mask=head_ok[:, None])
        tl.store(part_lse + rows, m_i + tl.log2(tl.maximum(l_i, 1e-30)), mask=head_ok)
    else:
        tl.store(out + seq * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 result.to(out.dtype.element_ty), mask=head_ok[:, None])


@triton.jit
def _merge_splits_kernel(part_out, part_lse, out, stride_ob, stride_oh, num_splits,
                         HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    rows = (seq * tl.num_programs(1) + head) * num_splits + tl.arange(0, BLOCK_S)
    split_ok = tl.arange(0, BLOCK_S) < num_splits
    lse = tl.load(part_lse + rows, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    weight = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # all splits empty: weights 0, output 0
    parts = tl.load(part_out + rows[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :],
                    mask=split_ok[:, None], other=0.0)
    result = tl.sum(weight[:, None] * parts, 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    tl.store(out + seq * stride_ob + head * stride_oh + tl.arange(0, HEAD_DIM), result.to(out.dtype.element_ty))


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) so that about two programs per SM stream KV, but never fewer than
    MIN_TOKENS_PER_SPLIT keys per split. A large batch gets 1 (no merge pass at all).

    For CUDA graphs pass the largest context the graph may see (max_model_len): a split past a shorter
    sequence's end exits at once, so over-splitting costs little, under-splitting a long context costs a lot."""
    wanted = -(-2 * num_sms // max(batch * num_kv_heads, 1))  # host code: triton.cdiv is a slow jit call here
    useful = -(-max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, num_splits: int,
                           out: torch.Tensor | None = None, config: DecodeConfig | None = None,
                           window: int | None = None, softcap: float | None = None, k_scale: float = 1.0,
                           v_scale: float = 1.0) -> torch.Tensor:
    """q: [batch, num_heads, head_dim], one new token per sequence (already stored in the cache);
    k_cache/v_cache: [num_blocks, block_size, num_kv_heads, head_dim], of q's type or FP8 (then k_scale / v_scale
    are its scales); block_tables: [batch, max_blocks] int32; seq_lens: [batch] int32 (0 is allowed: that row's
    output is zeros). window: the token sees only the last `window` positions; softcap: scores cap * tanh(s / cap).
    Returns [batch, num_heads, head_dim]."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    assert num_heads % num_kv_heads == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == v_cache.stride(-1) == 1
    config = config or default_decode_config(head_dim, k_cache.dtype)
    group = num_heads // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    if num_splits > 1:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # not read: the kernel writes `out` directly
    qk_scale, softcap_log2 = score_scales(scale, softcap, k_scale)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, out, part_out, part_lse, block_tables, seq_lens, qk_scale, v_scale, window or 0,
        softcap_log2,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim, PAGE=page,
        BLOCK_N=config.block_n, SPLIT=num_splits > 1, WINDOW=window is not None, SOFTCAP=softcap is not None,
        FP16_DOTS=fp16_dots(q, k_cache), PRECISION=dot_precision(q.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
        **pdl_launch_args(q),
    )
    if num_splits > 1:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), num_splits,
            HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), **pdl_launch_args(q),
        )
    return out
