"""Write this step's K/V into the paged cache: token t goes to slot `slot_mapping[t]`, or nowhere when it is -1.

An FP8 cache stores each element as the saturating cast of x / scale (nanovllm.attention.kv_quant's rule: x times
the fp32 reciprocal of the scale, clamped to the type's finite range, rounded to nearest); any other cache stores x
cast to its type."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_formats import fp8_max
from nanovllm.kernels.pdl import await_previous_kernel, pdl_launch_args


@triton.jit
def _store_kvcache_kernel(k, v, k_cache, v_cache, slot_mapping, k_inv_scale, v_inv_scale,
                          stride_kt, stride_kh, stride_vt, stride_vh,
                          stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                          NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                          PAGE: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:
        return
    block, offset = slot // PAGE, slot % PAGE
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, HEAD_DIM)[None, :]
    mask = offs_h < NUM_KV_HEADS
    key = tl.load(k + token * stride_kt + offs_h * stride_kh + offs_d, mask=mask)
    value = tl.load(v + token * stride_vt + offs_h * stride_vh + offs_d, mask=mask)
    if FP8_MAX > 0.0:  # an FP8 cache: scale and saturate before the cast (e4m3 has no infinity)
        key = tl.clamp(key.to(tl.float32) * k_inv_scale, -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32) * v_inv_scale, -FP8_MAX, FP8_MAX)
    tl.store(k_cache + block * stride_kcb + offset * stride_kcs + offs_h * stride_kch + offs_d,
             key.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + block * stride_vcb + offset * stride_vcs + offs_h * stride_vch + offs_d,
             value.to(v_cache.dtype.element_ty), mask=mask)


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k, v: [tokens, kv_heads, head_dim] (last dim contiguous); caches: [blocks, block_size, kv_heads, head_dim];
    k_scale / v_scale: an FP8 cache's scales (ignored otherwise)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3],
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        PAGE=k_cache.shape[1], FP8_MAX=fp8_max(k_cache.dtype), **pdl_launch_args(k),
    )
