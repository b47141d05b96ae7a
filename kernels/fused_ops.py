"""The decoder's small ops fused into one kernel each, so a layer launches 4 of them instead of dozens of torch ops.

- `rms_norm`: (residual add +) RMSNorm, one program per token;
- `qk_norm_rope`: Qwen3's per-head RMSNorm of q and k (optional) and rotary embedding, in place, one program per
  token and tensor;
- `silu_and_mul`: silu(gate) * up of the packed [gate | up] projection.

Each rounds where the torch layers round (the normalised value is cast to the activation dtype before the weight
multiplies it, rotary works in float32), so the two paths differ only in the order of a float32 sum.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import await_previous_kernel, pdl_launch_args


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, residual_out, stride_x, stride_r, stride_o, stride_ro, hidden, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    values = tl.load(x + token * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        values = values + tl.load(residual + token * stride_r + cols, mask=mask, other=0.0)
        tl.store(residual_out + token * stride_ro + cols, values, mask=mask)
    upcast = values.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(upcast * upcast, axis=0) / hidden + eps)
    scale = tl.load(weight + cols, mask=mask, other=0.0)
    tl.store(out + token * stride_o + cols, (upcast * rstd).to(values.dtype) * scale, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [tokens, hidden]. Without `residual`: norm(x). With it: (norm(x + residual), x + residual)."""
    hidden = x.shape[-1]
    assert x.stride(-1) == 1 and weight.is_contiguous()
    out = torch.empty_like(x)
    residual_out = torch.empty_like(x) if residual is not None else out
    source = residual if residual is not None else x  # unread when there is no residual
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, source, weight, out, residual_out, x.stride(0), source.stride(0), out.stride(0),
            residual_out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(hidden), num_warps=4 if hidden <= 2048 else 8, **pdl_launch_args(x))
    return out if residual is None else (out, residual_out)


@triton.jit
def _norm_rope_heads(x, token, stride_t, stride_h, num_heads, weight, cos, sin, eps,
                     HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
    """In place on one token's heads of one tensor: optional per-head RMSNorm, then rotate-half rotary."""
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    first_ptr = x + token * stride_t + heads * stride_h + dims
    first = tl.load(first_ptr, mask=mask, other=0.0)
    second = tl.load(first_ptr + HALF, mask=mask, other=0.0)
    dtype = first.dtype
    x1, x2 = first.to(tl.float32), second.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
        dim = tl.arange(0, HALF)
        x1 = ((x1 * rstd).to(dtype) * tl.load(weight + dim)[None, :]).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype) * tl.load(weight + HALF + dim)[None, :]).to(tl.float32)
    tl.store(first_ptr, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(first_ptr + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(q, k, positions, cos_sin, q_weight, k_weight, stride_qt, stride_qh, stride_kt, stride_kh,
                         num_q_heads, num_kv_heads, stride_cs, eps,
                         HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions + token)
    dims = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_sin + position * stride_cs + dims)
    sin = tl.load(cos_sin + position * stride_cs + HALF + dims)
    if tl.program_id(1) == 0:
        _norm_rope_heads(q, token, stride_qt, stride_qh, num_q_heads, q_weight, cos, sin, eps, HAS_NORM, BLOCK_H, HALF)
    else:
        _norm_rope_heads(k, token, stride_kt, stride_kh, num_kv_heads, k_weight, cos, sin, eps, HAS_NORM, BLOCK_H,
                         HALF)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float) -> None:
    """In place. q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim] (views of the qkv projection
    are fine: last dim contiguous); cos_sin: float32 [max_position, head_dim] = cos | sin; weights per head_dim
    (both or neither: no norm)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert q.stride(-1) == k.stride(-1) == 1 and cos_sin.stride(-1) == 1 and head_dim % 2 == 0
    has_norm = q_weight is not None
    if num_tokens == 0:
        return
    _qk_norm_rope_kernel[(num_tokens, 2)](
        q, k, positions, cos_sin, q_weight if has_norm else cos_sin, k_weight if has_norm else cos_sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), num_q_heads, num_kv_heads, cos_sin.stride(0), eps,
        HAS_NORM=has_norm, BLOCK_H=triton.next_power_of_2(max(num_q_heads, num_kv_heads)), HALF=head_dim // 2,
        num_warps=4, **pdl_launch_args(q))


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_o, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(x + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x + token * stride_x + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    tl.store(out + token * stride_o + cols, (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up, mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [tokens, 2 * width] = gate | up -> silu(gate) * up: [tokens, width]."""
    num_tokens, packed = x.shape
    width = packed // 2
    assert x.stride(-1) == 1
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(width), 1024)
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](x, out, x.stride(0), out.stride(0), width,
                                                                        BLOCK=block, **pdl_launch_args(x))
    return out
