"""The FP8 formats the kernels and the torch reference paths share: e4m3 limits, the smallest amax a scale is
computed from, and `Fp8Activation`, an activation a kernel already quantized for the FP8 linear it feeds."""
from __future__ import annotations

from typing import NamedTuple

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-10  # the smallest max(|x|) a scale is computed from: a zero group gets a finite scale
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of `dtype` (the saturation bound of a store), 0.0 for a non-FP8 type."""
    return torch.finfo(dtype).max if is_fp8(dtype) else 0.0


class Fp8Activation(NamedTuple):
    """An activation quantized per token by the kernel that made it (kernels/fused_ops.py, `quantize=True`), for
    the per-channel FP8 linear it feeds: `values` float8 [M, K], `scales` float32 [M, 1], `dtype` the model dtype
    it stands for (the linear's output dtype)."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype
