"""y = x W^T (+ b) for the few rows of a decode step: a matmul that must stream the whole weight matrix for a
handful of output rows.

At a decode step's sizes a projection is latency-bound: cuBLAS takes 6-8 us for every one of Qwen3-0.6B's
projections from 1 to 128 rows, 0.23-0.60 of the copy bandwidth (docs/BENCHMARKS.md). Up to 64 rows this kernel
matches it alone, and it can start early under programmatic dependent launch (kernels/pdl.py): its programs
prefetch their slice of the weight into L2 while the kernel before them finishes, which cuBLAS cannot.

Projections with few output columns (1024) make few tiles, so a tile's K range is split across programs until
the SMs are filled (split-K). The splits write float32 partial sums to a workspace and count their arrival on a
per-tile counter; the last to arrive adds the partials in split order (the same sum whatever the arrival order:
results are deterministic), writes the output and zeroes the counter for the next call. One launch, no memset,
nothing read back on the host: the call can be captured in a CUDA graph.

The workspace and counters belong to the device, so the calls must run one after another (one stream).
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.pdl import await_previous_kernel, pdl_launch_args

MAX_SPLIT_K = 8
MAX_ROWS = 64  # above this cuBLAS is faster (at 256 rows 2-3x): larger batches and prefill chunks go to cuBLAS
# Above this many bytes of weight a projection streams for longer than cuBLAS's fixed cost, and cuBLAS reads it
# at 0.7-0.94 of the copy bandwidth where this kernel reaches 0.5-0.6 (H100: from 2560 x 2560 up to Qwen3-8B's
# projections); at or below it (every Qwen3-0.6B projection) the two tie alone and this kernel's early start
# under PDL wins the step.
MAX_WEIGHT_BYTES = 12 * 2**20
_CACHE_LINE = 128  # bytes per L2 prefetch
WORKSPACE_FLOATS = 4 * 1024 * 1024  # 16 MiB of partial sums per device
_MAX_TILES = 64 * 1024


class SkinnyConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4
    prefetch: bool = True  # under PDL: the program's weight slice into L2 before the previous kernel ends


@triton.jit
def _store_tile(out, bias, result, offs_m, offs_n, n_ok, mask, stride_om, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        result += tl.load(bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out + offs_m[:, None] * stride_om + offs_n[None, :], result.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _prefetch_to_l2(pointers):
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [pointers], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _skinny_gemm_kernel(x, w, bias, out, partials, counters, M, N, K, stride_xm, stride_wn, stride_om,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                        PREFETCH: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    split = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    # Whole BLOCK_K steps per split, so only the last split of an uneven K is partial.
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    x_tile = x + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_tile = w + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    if PREFETCH:  # the weight is constant: safe to touch before the previous kernel has finished
        lines = w + offs_n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BLOCK_K // LINE)[None, :] * LINE
        for k in range(k_start, k_end, BLOCK_K):
            _prefetch_to_l2(lines + k)
    await_previous_kernel(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(x_tile + k, mask=m_ok[:, None], other=0.0)
            b = tl.load(w_tile + k, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + offs_k) < k_end
            a = tl.load(x_tile + k, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_tile + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc)
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        _store_tile(out, bias, acc, offs_m, offs_n, n_ok, mask, stride_om, HAS_BIAS)
    else:
        cell = offs_m[:, None] * N + offs_n[None, :]  # partials: [SPLIT_K, M, N]
        tl.store(partials + split * M * N + cell, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the arrival is counted
        tile = pid_m * tl.num_programs(0) + pid_n
        arrived = tl.atomic_add(counters + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in range(SPLIT_K):  # fixed order: deterministic
                total += tl.load(partials + s * M * N + cell, mask=mask, other=0.0, cache_modifier=".cg")
            _store_tile(out, bias, total, offs_m, offs_n, n_ok, mask, stride_om, HAS_BIAS)
            tl.atomic_xchg(counters + tile, 0)


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The device's partial-sum buffer and zeroed arrival counters, made on first use. The layers that use the
    kernel ask for it when they are built, so that it is in place before the engine measures its memory budget
    (a second engine in the process then measures the same) and before any CUDA graph capture."""
    if device not in _workspaces:
        _workspaces[device] = (torch.empty(WORKSPACE_FLOATS, dtype=torch.float32, device=device),
                               torch.zeros(_MAX_TILES, dtype=torch.int32, device=device))
    return _workspaces[device]


@functools.cache  # eager steps ask for every projection of every step
def choose_config(m: int, n: int, k: int, num_sms: int) -> SkinnyConfig:
    """Tiles of the rows (16 to 64) by 32 columns, K split (by powers of two) while the programs still fit on
    the SMs at once and each streams at least 2 x 128 of K: the best of a sweep on an H100 at Qwen3-0.6B's
    projections (scripts/bench_gemm.py --sweep)."""
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 32, 128
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    split_k = 1
    while (split_k < MAX_SPLIT_K and tiles * split_k * 2 <= num_sms and k // (2 * split_k) >= 2 * block_k
           and 2 * split_k * m * n <= WORKSPACE_FLOATS):
        split_k *= 2
    return SkinnyConfig(block_m, block_n, block_k, split_k)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None) -> torch.Tensor:
    """x: [M, K] (unit stride in K); weight: [N, K] contiguous; bias: [N] or None. Returns [M, N] in x's dtype.
    `config`: default `choose_config` for the device."""
    m, k = x.shape
    n = weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.is_contiguous()
    config = config or choose_config(m, n, k, _num_sms(x.device))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    pdl = pdl_launch_args(x)
    partials, counters = workspace(x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, config.block_m), config.split_k)
    assert config.split_k == 1 or (config.split_k * m * n <= partials.numel() and grid[0] * grid[1] <= len(counters))
    _skinny_gemm_kernel[grid](
        x, weight, bias if bias is not None else weight, out, partials, counters, m, n, k,
        x.stride(0), weight.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        SPLIT_K=config.split_k, EVEN_K=k % (config.split_k * config.block_k) == 0,
        PREFETCH=config.prefetch and pdl["PDL"], LINE=_CACHE_LINE // x.element_size(),
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl)
    return out
