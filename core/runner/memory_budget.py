"""How many bytes of GPU memory the KV cache gets (docs/ARCHITECTURE.md, KV budget).

`gpu_memory_utilization` is a per-engine share, as in vLLM: two engines at 0.45 each fit on one GPU. Against the
share count what this engine allocated through torch (weights, buffers, library workspaces it made), its peak
activations, and a fixed allowance for what torch does not allocate (CUDA context, kernel images). Memory held by
other processes, or left in this process by earlier engines (kernels loaded once per process), is not the
engine's and is not counted, so every engine of a process measures the same budget. The cache never takes more
than is free now, less the activations and a headroom for what is allocated after it (step buffers, CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NON_TORCH_ALLOWANCE = 1 << 30  # measured 0.6-0.9 GiB on H100/H200: context, kernel images, cuBLAS handles
AFTER_CACHE_HEADROOM = 1 << 29  # step buffers and CUDA graph pools, allocated after the cache


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    engine_bytes: int  # allocated through torch by this engine, the KV cache excepted
    peak_activations: int  # the warm-up's peak above what stays allocated


def kv_cache_bytes(memory: DeviceMemory, utilization: float) -> int:
    share = memory.total * utilization - memory.engine_bytes - memory.peak_activations - NON_TORCH_ALLOWANCE
    free_now = memory.free - memory.peak_activations - AFTER_CACHE_HEADROOM
    return max(int(min(share, free_now)), 0)


class EngineMemoryMeter:
    """Started before the engine allocates anything on `device`; `measure` after its warm-up forward, which
    `start_peak` precedes."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = torch.cuda.memory_allocated(device)

    def start_peak(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def measure(self) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        return DeviceMemory(total=total, free=free, engine_bytes=allocated - self.baseline,
                            peak_activations=torch.cuda.max_memory_allocated(self.device) - allocated)


def release_process_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per stream for the process, so that the next engine allocates (and
    counts) them again, as the first one did."""
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
