"""How many bytes of GPU memory the KV cache gets (docs/ARCHITECTURE.md, KV budget).

`gpu_memory_utilization` is a per-engine share, as in vLLM: two engines at 0.45 each fit on one GPU. Against the
share count the engine's own tensors (weights and buffers, counted from the model, not from allocator deltas that
another engine freeing memory would skew), its peak activations, and a fixed allowance for what belongs to the
process rather than to one engine (CUDA context, kernel images, cuBLAS and split-K workspaces). Memory held by
other processes or engines is not counted, so every engine of a process measures the same budget. The cache never takes more
than is free now, less the activations and a headroom for what is allocated after it (step buffers, CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PROCESS_ALLOWANCE = 1 << 30  # measured 0.6-0.9 GiB on H100/H200: context, kernel images, library workspaces
AFTER_CACHE_HEADROOM = 1 << 29  # step buffers and CUDA graph pools, allocated after the cache


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    engine_bytes: int  # the engine's weights and buffers
    peak_activations: int  # the warm-up's peak above what stays allocated


def kv_cache_bytes(memory: DeviceMemory, utilization: float) -> int:
    share = memory.total * utilization - memory.engine_bytes - memory.peak_activations - PROCESS_ALLOWANCE
    free_now = memory.free - memory.peak_activations - AFTER_CACHE_HEADROOM
    return max(int(min(share, free_now)), 0)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once (tied weights share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values())


class EngineMemoryMeter:
    """`start_peak` before the engine's warm-up forward, `measure` after it."""

    def __init__(self, device: torch.device):
        self.device = device

    def start_peak(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def measure(self, model: torch.nn.Module) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        allocated = torch.cuda.memory_allocated(self.device)
        return DeviceMemory(total=total, free=free, engine_bytes=tensor_bytes(model),
                            peak_activations=torch.cuda.max_memory_allocated(self.device) - allocated)


def release_process_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per stream for the process when an engine is released: the process's
    share of memory (PROCESS_ALLOWANCE) does not grow with every engine made in it."""
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
