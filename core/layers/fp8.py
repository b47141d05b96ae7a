"""FP8 (e4m3) weights for the tensor-parallel linear layers (quantization="fp8", or an FP8 checkpoint).

A weight is float8_e4m3fn with float32 scales, w ≈ q * scale, in one of two layouts (`Fp8Scheme.block`):
- per output channel: `weight_scale` [N, 1], one scale per row (quantization="fp8" on a bf16/fp16 checkpoint,
  quantized after loading, each row's scale the least-squared-error one of `WEIGHT_SCALE_SEARCH` tries;
  compressed-tensors `channel` checkpoints);
- block-scaled: `weight_scale` [N / bn, K / bk], one per bn x bk tile (HF `fp8` checkpoints with
  `weight_block_size`, whose tensor is named `weight_scale_inv`: it multiplies, as here).
Activations are quantized on the fly: per token (per channel) or per token and bk-column group (block-scaled).

Which layers: every `ColumnParallelLinear` / `RowParallelLinear` (q|k|v, o, gate|up, down, the shared expert of
Qwen2-MoE). The LM head and embeddings, MoE routers (`ReplicatedLinear`) and the stacked MoE experts stay in the
model dtype.

Tensor parallelism: a scale is sharded like the weight rows (or columns) it scales. Per-channel scales of a
row-parallel layer are whole on every rank when they come from a checkpoint; quantized after loading, each rank
scales its own slice of the row (the per-row maximum of its shard), which is at least as precise.

On CUDA (compute capability >= 8.9) the matmul runs on FP8 tensor cores: per-channel through cuBLASLt
(`torch._scaled_mm` with row-wise scales) above `TRITON_MAX_ROWS` rows and through the Triton kernel
(kernels/fp8_gemm.py) at or below it (without fused ops, on cuBLASLt at every size); block-scaled always through
the Triton kernel. The activations are quantized by a Triton kernel: by the fused RMSNorm or SiLU-and-mul
that makes them where the model pairs it with the linear (`fuse_activation_quantization`), else by one of their
own (kernels/fp8_gemm.py `quantize_groups`), by the same rule. On the CPU a reference
computes the same rule in float32: activations quantized and dequantized as on the GPU, the weight dequantized.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from nanovllm.kernels.fp8_formats import FP8_DTYPE, FP8_MAX, MIN_AMAX, Fp8Activation

# Weights quantized at load try this many scales per row (`quantize`'s search): on SmolLM2-135M's real weights it
# took the perplexity ratio of FP8 weights + KV from 1.0356 to 1.0274 (H100, bf16; docs/FP8.md).
WEIGHT_SCALE_SEARCH = 16
SEARCH_CHUNK = 1 << 24  # weight elements a scale search tries at once (its float32 temporaries: 64 MiB each)
# Per-channel FP8 projections with at most this many rows (tokens) run on the Triton kernel, larger ones on
# cuBLASLt: at Qwen3-8B's projections on the H100 Triton was faster at 1, 16 and 64 rows, even at 32 and slower
# from 128 (scripts/bench_fp8_gemm.py).
TRITON_MAX_ROWS = 64


@dataclass(frozen=True)
class Fp8Scheme:
    """How the linear layers hold FP8 weights. `block`: None per output channel, (bn, bk) block-scaled.
    `in_checkpoint`: the checkpoint stores the FP8 weights and scales (else they are quantized after loading).
    `name`: what the user asked or the checkpoint declared, for messages."""

    block: tuple[int, int] | None
    in_checkpoint: bool
    name: str


def quantize(t: torch.Tensor, block: tuple[int, int],
             scale_search: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """t [N, K] -> (float8_e4m3fn [N, K], float32 scales [N / bn, K / bk]) with one scale per bn x bk tile,
    q = clamp(t / scale, ±448). (1, K): per row; (1, g): per row and g-column group.

    scale_search = 1: scale = max(|tile|) / 448 (the activations' rule, computed on the fly). n > 1 (the weights,
    quantized once at load): each tile tries the n scales max(|tile|) / 448 * 2^(j / n), j < n, one octave above
    the max (no value clips, and every alignment of e4m3's grid on the tile's values), and keeps the one of least
    squared error; ties keep the smaller scale."""
    n, k = t.shape
    bn, bk = block
    if n % bn or k % bk:
        raise ValueError(f"a [{n}, {k}] tensor does not divide into {bn} x {bk} scale blocks")
    tiles = t.float().reshape(n // bn, bn, k // bk, bk)
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    if scale_search > 1:  # a few rows of tiles at a time: the tries' float32 temporaries stay small
        rows = max(1, SEARCH_CHUNK // tiles[0].numel())
        scale = torch.cat([_least_error_scale(part, base, scale_search)
                           for part, base in zip(tiles.split(rows), scale.split(rows))])
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(n, k), scale[:, 0, :, 0]


def _least_error_scale(tiles: torch.Tensor, base: torch.Tensor, tries: int) -> torch.Tensor:
    """Per tile of `tiles` [rows, bn, cols, bk], the scale base * 2^(j / tries), j < tries, whose rounding leaves
    the least squared error (the first of equals)."""
    scale, best_error = base, None
    for j in range(tries):
        candidate = base * 2 ** (j / tries)
        rounded = (tiles / candidate).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() * candidate
        error = (rounded - tiles).square().sum(dim=(1, 3), keepdim=True)
        if best_error is not None:
            better = error < best_error
            scale, error = torch.where(better, candidate, scale), torch.where(better, error, best_error)
        best_error = error
    return scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 tensor q * scale, each scale spread over its block (the block is the shape ratio)."""
    n, k = q.shape
    bn, bk = -(-n // scale.shape[0]), -(-k // scale.shape[1])
    spread = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return q.float() * spread


def activation_group(scheme_block: tuple[int, int] | None, k: int) -> int:
    """Columns per activation scale: the whole row (per channel) or the weight block's K."""
    return scheme_block[1] if scheme_block is not None else k


def reference_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                     bias: torch.Tensor | None) -> torch.Tensor:
    """The FP8 linear's rule in float32 (the CPU path and the tests' reference)."""
    group = activation_group(block, x.shape[1])
    xq, xs = quantize(x, (1, group))
    out = dequantize(xq, xs) @ dequantize(weight, scale).T
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype)


@functools.cache
def _scaled_mm_rowwise(device_index: int | None) -> bool:
    """cuBLASLt's row-wise scaled FP8 matmul: Hopper and later."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def fp8_linear(x: torch.Tensor | Fp8Activation, weight: torch.Tensor, scale: torch.Tensor,
               block: tuple[int, int] | None, bias: torch.Tensor | None,
               triton_max_rows: int = TRITON_MAX_ROWS) -> torch.Tensor:
    """y = x W^T (+ b) for an FP8 weight [N, K] and its scales; x: [M, K] in the model dtype, or already quantized
    per token (per-channel weights only). Per channel on CUDA, batches of more than `triton_max_rows` rows go to
    cuBLASLt where it takes them (bf16 output, Hopper, N and K multiples of 16)."""
    if isinstance(x, Fp8Activation):
        xq, xs, dtype = x
    elif not x.is_cuda:
        return reference_linear(x, weight, scale, block, bias)
    else:
        from nanovllm.kernels.fp8_gemm import quantize_groups

        xq, xs = quantize_groups(x if x.stride(-1) == 1 else x.contiguous(), activation_group(block, x.shape[1]))
        dtype = x.dtype
    from nanovllm.kernels.fp8_gemm import fp8_gemm

    if (block is None and xq.shape[0] > triton_max_rows and dtype == torch.bfloat16
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0 and _scaled_mm_rowwise(xq.device.index)):
        out = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=dtype)
        return out + bias if bias is not None else out
    return fp8_gemm(xq, xs, weight, scale, block, bias, dtype)
