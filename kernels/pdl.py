"""Programmatic dependent launch (PDL, Hopper and later): a kernel may start while the one before it finishes.

A decode step of a small model is ~300 kernels of a few microseconds each, and each pays a fixed cost between
kernels (launch, ramp-up, drain) that rivals its work. With PDL the next kernel's programs are placed on the SMs
as soon as every program of the current one has passed `await_previous_kernel`; they run their preamble (the
skinny GEMM prefetches its weights into L2) and block in their own `await_previous_kernel` until the previous
kernel has finished and its writes are visible. Letting the next kernel in only after this wait keeps one kernel
waiting at a time.

The rule every kernel here keeps: `await_previous_kernel` comes before it reads or writes anything that a kernel
before it writes or reads (only constant weights may be touched before). Without PDL it is a no-op. PDL is on
for CUDA devices of compute capability 9.0 and above unless NANOVLLM_PDL=0.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.cache
def pdl_enabled(device_index: int | None = None) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    if os.environ.get("NANOVLLM_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_launch_args(tensor: torch.Tensor) -> dict:
    """Extra launch arguments of a kernel with a `PDL: tl.constexpr` parameter, for the device of `tensor`."""
    if tensor.is_cuda and pdl_enabled(tensor.device.index):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def await_previous_kernel(PDL: tl.constexpr):
    """Block until the previous kernel has finished (its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
