"""How many bytes of GPU memory the KV cache gets (docs/ARCHITECTURE.md, KV budget), and the default batch.

`gpu_memory_utilization` is a per-engine share, as in vLLM: two engines at 0.45 each fit on one GPU. Against the
share count the engine's own tensors (weights and buffers, counted from the model, not from allocator deltas that
another engine freeing memory would skew), the worst step the configuration allows (`WorstStep`, measured before
the cache exists: the peak of an eager step at the token budget with every row's logits sampled, and the memory
the largest decode graph keeps), and a fixed allowance for what belongs to the process rather than to one engine
(CUDA context, kernel images, cuBLAS and split-K workspaces). Memory held by other processes or engines is not
counted, so every engine of a process measures the same budget. The cache never takes more than is free now,
less the worst step and a headroom for the step buffers allocated after it. So every step an accepted
configuration can schedule fits beside the cache: none runs out of memory mid-job.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

PROCESS_ALLOWANCE = 1 << 30  # measured 0.6-0.9 GiB on H100/H200: context, kernel images, library workspaces
AFTER_CACHE_HEADROOM = 1 << 28  # step buffers and output slots, allocated after the cache
# With no max_num_seqs given, the batch is as large as the cache gives every row this many tokens on average, at
# least the CPU's default and at most the peers' largest default (vLLM and SGLang run 1,024 rows on 80 GB GPUs).
AUTO_NUM_SEQS_TOKENS = 512
MIN_AUTO_NUM_SEQS, MAX_AUTO_NUM_SEQS = 256, 1024


@dataclass(frozen=True)
class WorstStep:
    """What the worst step the configuration allows needs besides the cache: `activations`, the transient peak of
    an eager step at the token budget whose every row is sampled (logits, sampler and logprob workspaces), and
    `graph_pool`, what the largest decode graph keeps allocated once captured (its activations and logits)."""

    activations: int
    graph_pool: int = 0


@dataclass(frozen=True)
class DeviceMemory:
    total: int
    free: int
    engine_bytes: int  # the engine's weights and buffers
    worst_step: WorstStep


def kv_cache_bytes(memory: DeviceMemory, utilization: float) -> int:
    reserved = memory.worst_step.activations + memory.worst_step.graph_pool
    share = memory.total * utilization - memory.engine_bytes - reserved - PROCESS_ALLOWANCE
    free_now = memory.free - reserved - AFTER_CACHE_HEADROOM
    return max(int(min(share, free_now)), 0)


def auto_max_num_seqs(kv_cache_tokens: int) -> int:
    """The batch for a cache of `kv_cache_tokens` when the user sets none: a multiple of 64 between
    MIN_AUTO_NUM_SEQS and MAX_AUTO_NUM_SEQS, each row having AUTO_NUM_SEQS_TOKENS of cache on average."""
    rows = kv_cache_tokens // AUTO_NUM_SEQS_TOKENS // 64 * 64
    return min(max(rows, MIN_AUTO_NUM_SEQS), MAX_AUTO_NUM_SEQS)


def tensor_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers, each storage once (tied weights share one)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in (*module.parameters(), *module.buffers())}
    return sum(storages.values())


class EngineMemoryMeter:
    """The peak a piece of work allocates above what stays allocated (`peak_of`), and the device's memory."""

    def __init__(self, device: torch.device):
        self.device = device

    def peak_of(self, work) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        work()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        return peak

    def measure(self, model: torch.nn.Module, worst_step: WorstStep) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(total=total, free=free, engine_bytes=tensor_bytes(model), worst_step=worst_step)


def release_process_workspaces() -> None:
    """Free the cuBLAS workspaces torch keeps per stream for the process when an engine is released: the process's
    share of memory (PROCESS_ALLOWANCE) does not grow with every engine made in it."""
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
