"""The KV cache's element type (`kv_cache_dtype`, vLLM's names) and its FP8 quantization rule.

An FP8 cache stores `saturate(x / scale)` rounded to nearest (e4m3: max 448, e5m2: max 57344) and is read as
`stored * scale`. Scales are per tensor: one K and one V scale per layer (`Attention.k_scale` / `v_scale`), 1.0 by
default (vLLM's calibration-free default; docs/FP8.md says why and what it costs). The store kernels quantize;
the attention kernels fold the K scale into the softmax scale and the V scale into the output, so dequantizing is
a register convert. These torch functions are the rule itself: the reference backend's path and the tests' oracle.
"""
from __future__ import annotations

import torch

from nanovllm.kernels.fp8_formats import fp8_max, is_fp8

FP8_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
KV_CACHE_DTYPES = ("auto", *FP8_KV_CACHE_DTYPES)
# FP8 conversions need the tensor cores' FP8 support (Ada, Hopper and later) in the Triton kernels.
MIN_FP8_CAPABILITY = (8, 9)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model's for "auto", else the named FP8 type."""
    return model_dtype if name == "auto" else FP8_KV_CACHE_DTYPES[name]


def check_fp8_kv_supported(name: str, device: torch.device) -> None:
    """Raise ValueError naming kv_cache_dtype and the requirement where an FP8 cache cannot run on `device`."""
    if name == "auto" or device.type != "cuda":  # the CPU runs the torch reference path
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_FP8_CAPABILITY:
        raise ValueError(
            f"kv_cache_dtype={name!r} needs a GPU with FP8 support (compute capability >= "
            f"{MIN_FP8_CAPABILITY[0]}.{MIN_FP8_CAPABILITY[1]}: Ada, Hopper or later); "
            f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use kv_cache_dtype='auto'")


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x as stored in a cache of `dtype`: a saturating FP8 cast of x / scale (x times the fp32 reciprocal, as the
    store kernel computes it), or x itself cast for a non-FP8 cache."""
    if not is_fp8(dtype):
        return x.to(dtype)
    bound = fp8_max(dtype)
    return (x.float() * (1.0 / scale)).clamp(-bound, bound).to(dtype)


def dequantize(stored: torch.Tensor, scale: float) -> torch.Tensor:
    """FP8 cache elements as fp32 values; a non-FP8 cache's elements unchanged."""
    return stored.float() * scale if is_fp8(stored.dtype) else stored
