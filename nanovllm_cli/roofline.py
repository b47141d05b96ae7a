"""The least time a workload can take on a device: its rows run in the ideal continuous-batching schedule at the
engine's batch size, each step as long as the larger of its bytes over the memory bandwidth and its FLOPs over
the matmul rate.

A step reads the weights once and every decoding row's whole KV context, and does the matmul FLOPs of every token
in it (prompt tokens of the rows admitted in it, one token per decoding row) plus attention's. The ceilings are
measured on the device at the start of the run (a large copy, counting bytes read plus written, and a large bf16
matmul). The costs (`LLM.info.costs`) are one rank's (its
weight shard, its KV heads, its attention heads): every rank does an equal share at once, so the
bound is one device's share over one device's ceilings."""
from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import torch

from nanovllm import CostModel


@dataclass
class DeviceCeilings:
    name: str
    copy_bytes_per_s: float  # bytes read + bytes written per second
    matmul_flops_per_s: float  # bf16


def median_cuda_ms(fn, repeats: int = 7) -> float:
    """Median device time of `fn` in ms between CUDA events on the current stream, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _copy_ms() -> float:
    src = torch.randn(1 << 28, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    return median_cuda_ms(lambda: dst.copy_(src))


def _matmul_ms(n: int) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return median_cuda_ms(lambda: a @ b)


def measure_ceilings(device: torch.device) -> DeviceCeilings:
    with torch.cuda.device(device):
        copy_ms, n = _copy_ms(), 8192
        matmul_ms = _matmul_ms(n)
    return DeviceCeilings(torch.cuda.get_device_name(device), 2 * (1 << 30) / copy_ms * 1e3,
                          2 * n ** 3 / matmul_ms * 1e3)


@dataclass
class IdealSchedule:
    """The ideal continuous-batching schedule of a workload, one entry per step: its rows (decoding and
    prefilling), decoding rows, prompt tokens, the context tokens its decodes read, and its time on the device."""

    rows: np.ndarray
    decode_rows: np.ndarray
    prefill_tokens: np.ndarray
    kv_tokens: np.ndarray
    step_s: np.ndarray

    @property
    def seconds(self) -> float:
        return float(self.step_s.sum())


def slot_starts(output_lens: np.ndarray, batch: int) -> np.ndarray:
    """The step at which each row (in order) is admitted when `batch` slots are refilled as soon as they free: a
    row of output n holds its slot for n steps (its prefill samples the first token, then n - 1 decodes), and the
    next row takes the slot that frees first."""
    starts = np.zeros(len(output_lens), dtype=np.int64)
    free_at = [int(n) for n in output_lens[:batch]]  # a min-heap of the steps at which the slots free
    heapq.heapify(free_at)
    lens = output_lens.tolist()
    for i in range(batch, len(lens)):
        start = free_at[0]
        heapq.heapreplace(free_at, start + lens[i])
        starts[i] = start
    return starts


def ideal_schedule(costs: CostModel, prompt_lens, output_lens, batch: int, ceilings: DeviceCeilings) -> IdealSchedule:
    """Every step decodes every running row, a finished row's slot is refilled at once (its prompt prefilled in
    that step), and a step costs max((weight bytes + the KV bytes its decodes read) / copy bandwidth, FLOPs /
    matmul rate). A row's decode j (1 .. n - 1) attends to p + j tokens (it writes its token, then reads it
    too); FLOPs are every token's matmuls plus attention's pairs (p (p + 1) / 2 for a prompt of p, the context
    for a decode). A mixture of experts reads the experts the step's tokens select (models/costs.py)."""
    p = np.asarray(prompt_lens, dtype=np.int64)
    n = np.asarray(output_lens, dtype=np.int64)
    if len(p) != len(n) or not len(n) or n.min() < 1 or batch < 1:
        raise ValueError("ideal_schedule needs as many prompt as output lengths, each output at least 1, batch >= 1")
    starts = slot_starts(n, batch)
    ends = starts + n  # one past each row's last step
    num_steps = int(ends.max())

    def per_step(at: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
        return np.bincount(at, weights, minlength=num_steps + 1).astype(np.int64)

    # A row decodes in steps start + 1 .. end - 1: +1 where that begins, -1 where it ends. Its decode at step t
    # reads p + t - start tokens: summed over the rows decoding at t, (their p - start) + t x their number.
    decoding = per_step(starts + 1) - per_step(ends)
    offsets = per_step(starts + 1, p - starts) - per_step(ends, p - starts)
    decode_rows = np.cumsum(decoding)[:num_steps]
    steps = np.arange(num_steps, dtype=np.int64)
    kv_tokens = np.cumsum(offsets)[:num_steps] + steps * decode_rows
    prefill_rows = per_step(starts)[:num_steps]
    prefill_tokens = per_step(starts, p)[:num_steps]
    prefill_pairs = per_step(starts, p * (p + 1) // 2)[:num_steps]
    tokens = decode_rows + prefill_tokens
    step_tokens, index = np.unique(tokens, return_inverse=True)
    weight_bytes = np.array([costs.decode_weight_bytes(int(t)) for t in step_tokens])[index]
    memory_s = (weight_bytes + kv_tokens * float(costs.kv_bytes_per_token)) / ceilings.copy_bytes_per_s
    flops = tokens * float(costs.flops_per_token) + (kv_tokens + prefill_pairs) * float(costs.attention_flops_per_pair)
    return IdealSchedule(decode_rows + prefill_rows, decode_rows, prefill_tokens, kv_tokens,
                         np.maximum(memory_s, flops / ceilings.matmul_flops_per_s))


def roofline_seconds(costs: CostModel, prompt_lens, output_lens, batch: int, ceilings: DeviceCeilings) -> float:
    """The least time the workload's rows of these lengths take at a batch of `batch` rows: `ideal_schedule`."""
    return ideal_schedule(costs, prompt_lens, output_lens, batch, ceilings).seconds
