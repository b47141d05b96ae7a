"""FP8 (e4m3) GEMM with scales, and the dynamic quantization of its activations.

Rule of `quantize_groups`: each row of x is cut into groups of `group` columns (group = K: one group per row,
i.e. per token); each group gets scale = max(|x|) / 448 (floored at a tiny positive value: an all-zero group
quantizes to zeros) and is stored as clamp(x / scale, ±448) rounded to float8_e4m3fn; the scales are float32
[M, K / group]. (layers/fp8.py `quantize` is the torch reference.)

Rule of `fp8_gemm`: out[m, n] = sum_k a[m, k] b[n, k] sa[m, k / gk] sb[n / gn, k / gk] (+ bias[n]), accumulated
in float32 and rounded once to the output dtype. Two scale layouts:
- per channel (`block=None`): sa [M, 1] (one per token), sb [N, 1] (one per output channel): the scales factor
  out of the sum and are applied once in the epilogue;
- block-scaled (`block=(gn, gk)`, e.g. the 128 x 128 of HF's `fp8` checkpoints): sa [M, K / gk], sb
  [N / gn, K / gk]; each K tile of gk columns is a separate fp8 dot, scaled and added to the float32 sum.

Not split-K and no PDL: a plain tiled GEMM, a candidate against cuBLASLt (`torch._scaled_mm`) at decode-sized
batches (scripts/bench_fp8_gemm.py times both).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fp8_formats import FP8_DTYPE, FP8_MAX, MIN_AMAX

_QUANT_CHUNK = 1024  # columns a quantization program loads at a time


@triton.jit
def fp8_group_scale(absmax, FP8_MAX_: tl.constexpr, MIN_AMAX_: tl.constexpr):
    """The rule's scale of a group whose largest |x| is `absmax` (float32)."""
    return tl.maximum(absmax, MIN_AMAX_) / FP8_MAX_


@triton.jit
def fp8_clamped(v, scale, FP8_MAX_: tl.constexpr):
    """v (float32) in units of `scale`, clamped to e4m3's range: the value an FP8 store rounds."""
    return tl.clamp(v / scale, -FP8_MAX_, FP8_MAX_)


@triton.jit
def _quantize_groups_kernel(x, out, scales, K, stride_xm, stride_om, num_groups, GROUP: tl.constexpr,
                            CHUNK: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_AMAX_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * GROUP
    absmax = tl.zeros((CHUNK,), dtype=tl.float32)
    for c in range(0, GROUP, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        ok = (c + tl.arange(0, CHUNK)) < GROUP
        v = tl.load(x + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(v))
    scale = fp8_group_scale(tl.max(absmax, axis=0), FP8_MAX_, MIN_AMAX_)
    tl.store(scales + row * num_groups + group, scale)
    for c in range(0, GROUP, CHUNK):
        offs = start + c + tl.arange(0, CHUNK)
        ok = (c + tl.arange(0, CHUNK)) < GROUP
        v = tl.load(x + row * stride_xm + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out + row * stride_om + offs, fp8_clamped(v, scale, FP8_MAX_).to(out.dtype.element_ty), mask=ok)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] (unit stride in K), K a multiple of `group`. Returns (float8_e4m3fn [M, K], float32 scales
    [M, K / group])."""
    m, k = x.shape
    assert k % group == 0 and x.stride(1) == 1
    out = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(m, k // group, dtype=torch.float32, device=x.device)
    if m:
        chunk = min(_QUANT_CHUNK, triton.next_power_of_2(group))
        _quantize_groups_kernel[(m, k // group)](x, out, scales, k, x.stride(0), out.stride(0), k // group,
                                                 GROUP=group, CHUNK=chunk, FP8_MAX_=FP8_MAX, MIN_AMAX_=MIN_AMAX)
    return out, scales


class Fp8GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _fp8_gemm_kernel(a, a_scale, b, b_scale, bias, out, M, N, K, stride_am, stride_bn, stride_om, stride_sam,
                     stride_sbn, HAS_BIAS: tl.constexpr, BLOCK_SCALED: tl.constexpr, SCALE_BLOCK_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_tile = a + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :]
    b_tile = b + offs_n.to(tl.int64)[:, None] * stride_bn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(a_tile + k, mask=m_ok[:, None], other=0.0)
            w = tl.load(b_tile + k, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < K
            x = tl.load(a_tile + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(b_tile + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if BLOCK_SCALED:  # BLOCK_K is the scale block's K: one scale column per tile
            kb = k // BLOCK_K
            sa = tl.load(a_scale + offs_m * stride_sam + kb, mask=m_ok, other=0.0)
            sb = tl.load(b_scale + (offs_n // SCALE_BLOCK_N) * stride_sbn + kb, mask=n_ok, other=0.0)
            acc += tl.dot(x, tl.trans(w)) * sa[:, None] * sb[None, :]
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    if not BLOCK_SCALED:
        sa = tl.load(a_scale + offs_m * stride_sam, mask=m_ok, other=0.0)
        sb = tl.load(b_scale + offs_n * stride_sbn, mask=n_ok, other=0.0)
        acc = acc * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    tl.store(out + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(out.dtype.element_ty),
             mask=mask)


@functools.cache
def choose_config(m: int, block: tuple[int, int] | None) -> Fp8GemmConfig:
    """Row tiles of the batch (16 to 128), narrow column tiles for few rows (more programs to stream the weight),
    K tiles of 128 (block-scaled: the scale block's K). Untuned: scripts/bench_fp8_gemm.py --sweep."""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    block_n = 32 if m <= 16 else 64 if m <= 64 else 128
    block_k = block[1] if block is not None else 128
    warps = 8 if block_m * block_n >= 128 * 128 else 4
    return Fp8GemmConfig(block_m, block_n, block_k, warps, 3 if block_m >= 128 else 4)


def fp8_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
             block: tuple[int, int] | None, bias: torch.Tensor | None, out_dtype: torch.dtype,
             config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """a: float8 [M, K] and its scales (see the module rule), b: float8 [N, K] contiguous and its scales; returns
    [M, N] in `out_dtype`. `config`: default `choose_config`."""
    m, k = a.shape
    n = b.shape[0]
    assert b.shape[1] == k and a.stride(1) == 1 and b.is_contiguous()
    assert a_scale.dtype == b_scale.dtype == torch.float32 and a_scale.stride(1) == 1 and b_scale.stride(1) == 1
    config = config or choose_config(m, block)
    if block is not None:
        assert config.block_k == block[1] and k % block[1] == 0
        assert a_scale.shape == (m, k // block[1]) and b_scale.shape == (triton.cdiv(n, block[0]), k // block[1])
    else:
        assert a_scale.shape == (m, 1) and b_scale.shape == (n, 1)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m))
    _fp8_gemm_kernel[grid](
        a, a_scale, b, b_scale, bias if bias is not None else b_scale, out, m, n, k, a.stride(0), b.stride(0),
        out.stride(0), a_scale.stride(0), b_scale.stride(0), HAS_BIAS=bias is not None,
        BLOCK_SCALED=block is not None, SCALE_BLOCK_N=block[0] if block is not None else 1,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, EVEN_K=k % config.block_k == 0,
        num_warps=config.num_warps, num_stages=config.num_stages)
    return out
