"""The decoder's small ops fused into one kernel each, so a layer launches 4 of them instead of dozens of torch ops.

- `rms_norm`: (residual add +) RMSNorm, one program per token;
- `qk_norm_rope`: Qwen3's per-head RMSNorm of q and k (optional) and rotary embedding, in place, one program per
  token and tensor;
- `silu_and_mul`: silu(gate) * up of the packed [gate | up] projection.

Each rounds where the torch layers round (the normalised value is cast to the activation dtype before the weight
multiplies it, rotary works in float32), so the two paths differ only in the order of a float32 sum.

`rms_norm` and `silu_and_mul` can also quantize their output for the FP8 linear it feeds (`quantize=True`):
per token, by the rule of fp8_gemm.quantize_groups applied to the value they would have stored, so the FP8
bytes and scale are those the separate quantization kernel would make (one launch and one round trip of the
activation less per projection). The result is then an `Fp8Activation`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_formats import FP8_DTYPE, FP8_MAX, MIN_AMAX, Fp8Activation
from nanovllm.kernels.fp8_gemm import fp8_clamped, fp8_group_scale, quantize_groups
from nanovllm.kernels.pdl import await_previous_kernel, pdl_launch_args

FP8_MAX_ = tl.constexpr(FP8_MAX)
MIN_AMAX_ = tl.constexpr(MIN_AMAX)


def _outputs(x: torch.Tensor, width: int, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The output buffer of a [tokens, width] result, and its per-token scales (quantized) or a stand-in."""
    if not quantize:
        return torch.empty(x.shape[0], width, dtype=x.dtype, device=x.device), x
    return (torch.empty(x.shape[0], width, dtype=FP8_DTYPE, device=x.device),
            torch.empty(x.shape[0], 1, dtype=torch.float32, device=x.device))


def _result(out: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype, quantize: bool):
    return Fp8Activation(out, scales, dtype) if quantize else out


@triton.jit
def _rms_norm_kernel(x, residual, weight, out, out_scales, residual_out, stride_x, stride_r, stride_o, stride_ro,
                     hidden, eps, HAS_RESIDUAL: tl.constexpr, QUANTIZE: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
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
    normed = (upcast * rstd).to(values.dtype) * tl.load(weight + cols, mask=mask, other=0.0)
    if QUANTIZE:  # the value the unquantized kernel would store, then the rule
        normed = normed.to(values.dtype).to(tl.float32)
        scale = fp8_group_scale(tl.max(tl.abs(normed), axis=0), FP8_MAX_, MIN_AMAX_)
        tl.store(out_scales + token, scale)
        normed = fp8_clamped(normed, scale, FP8_MAX_)
    tl.store(out + token * stride_o + cols, normed.to(out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             quantize: bool = False):
    """x: [tokens, hidden]. Without `residual`: norm(x). With it: (norm(x + residual), x + residual).
    `quantize`: norm(x) as an Fp8Activation (see the module doc)."""
    hidden = x.shape[-1]
    assert x.stride(-1) == 1 and weight.is_contiguous()
    out, scales = _outputs(x, hidden, quantize)
    residual_out = torch.empty_like(x) if residual is not None else x  # unwritten when there is no residual
    source = residual if residual is not None else x  # unread when there is no residual
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x, source, weight, out, scales, residual_out, x.stride(0), source.stride(0), out.stride(0),
            residual_out.stride(0), hidden, eps, HAS_RESIDUAL=residual is not None, QUANTIZE=quantize,
            BLOCK=triton.next_power_of_2(hidden), num_warps=4 if hidden <= 2048 else 8, **pdl_launch_args(x))
    normed = _result(out, scales, x.dtype, quantize)
    return normed if residual is None else (normed, residual_out)


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
def _silu_mul(x, token, stride_x, width, cols):
    """silu(gate) * up at columns `cols` of one token, in the activation dtype, and the columns' mask."""
    mask = cols < width
    gate = tl.load(x + token * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x + token * stride_x + width + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    return (g / (1.0 + tl.exp(-g))).to(gate.dtype) * up, mask


@triton.jit
def _silu_and_mul_kernel(x, out, stride_x, stride_o, width, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    product, mask = _silu_mul(x, token, stride_x, width, cols)
    tl.store(out + token * stride_o + cols, product, mask=mask)


@triton.jit
def _silu_and_mul_quantize_kernel(x, out, out_scales, stride_x, stride_o, width, BLOCK: tl.constexpr,
                                  PDL: tl.constexpr):
    """One program per token, the whole row (BLOCK >= width) held: its largest |product| is known before the
    store."""
    await_previous_kernel(PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    product, mask = _silu_mul(x, token, stride_x, width, cols)
    product = product.to(tl.float32)
    scale = fp8_group_scale(tl.max(tl.abs(product), axis=0), FP8_MAX_, MIN_AMAX_)
    tl.store(out_scales + token, scale)
    quantized = fp8_clamped(product, scale, FP8_MAX_)
    tl.store(out + token * stride_o + cols, quantized.to(out.dtype.element_ty), mask=mask)


# The widest row (padded to a power of two) the quantizing SiLU-and-mul holds in one program: Qwen3-8B's 12288
# columns take 16384. A wider row is computed by the plain kernel and quantized by `quantize_groups`: a program
# per token making two passes over it measured slower than those two kernels on the H100 (docs/BENCHMARKS.md).
QUANTIZE_ROW_MAX = 16384


def silu_and_mul(x: torch.Tensor, quantize: bool = False):
    """x: [tokens, 2 * width] = gate | up -> silu(gate) * up: [tokens, width]; `quantize`: as an Fp8Activation
    (see the module doc)."""
    num_tokens, packed = x.shape
    width = packed // 2
    assert x.stride(-1) == 1
    row = triton.next_power_of_2(width)
    if quantize and row > QUANTIZE_ROW_MAX:
        return Fp8Activation(*quantize_groups(silu_and_mul(x), width), x.dtype)
    out, scales = _outputs(x, width, quantize)
    if num_tokens and quantize:
        _silu_and_mul_quantize_kernel[(num_tokens,)](x, out, scales, x.stride(0), out.stride(0), width, BLOCK=row,
                                                     num_warps=min(16, max(4, row // 1024)), **pdl_launch_args(x))
    elif num_tokens:
        block = min(row, 1024)
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(width, block))](x, out, x.stride(0), out.stride(0), width,
                                                                        BLOCK=block, **pdl_launch_args(x))
    return _result(out, scales, x.dtype, quantize)
