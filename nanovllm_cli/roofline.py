"""The least time a workload can take on a device: bytes over memory bandwidth plus FLOPs over the matmul rate.

Decode steps must read the weights once and every sequence's whole KV context; prefill must do the matmul
FLOPs of every prompt token. The ceilings are measured on the device at the start of the run (a large copy,
counting bytes read plus written, and a large bf16 matmul). The costs (`LLM.info.costs`) are one rank's (its
weight shard, its KV heads, its attention heads): every rank does an equal share at once, so the
bound is one device's share over one device's ceilings."""
from __future__ import annotations

import bisect
from dataclasses import dataclass

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


def decode_batch_sizes(output_lens: list[int], max_num_seqs: int) -> list[int]:
    """The batch of every decode step under the roofline's schedule: waves of `max_num_seqs` sequences, each
    wave as many steps as the longest output of all minus one (prefill samples the first token); a sequence
    takes part in steps 1 .. its output length - 1."""
    steps = max(output_lens) - 1
    batches = []
    for start in range(0, len(output_lens), max_num_seqs):
        lens = sorted(output_lens[start:start + max_num_seqs])
        batches += [len(lens) - bisect.bisect_right(lens, step) for step in range(1, steps + 1)]
    return batches


def roofline_seconds(costs: CostModel, prompt_lens: list[int], output_lens: list[int], max_num_seqs: int,
                     ceilings: DeviceCeilings) -> float:
    """Decode: each output token after the first (which prefill samples) reads its sequence's context of p + j
    tokens at step j; each step reads the weights (of a mixture of experts, those its batch selects), and a batch
    of at most `max_num_seqs` sequences needs as many steps as its longest output. Prefill: every prompt
    token's matmuls plus causal attention."""
    kv_tokens_read = sum((n - 1) * p + n * (n - 1) // 2 for p, n in zip(prompt_lens, output_lens))
    weight_bytes = sum(map(costs.decode_weight_bytes, decode_batch_sizes(output_lens, max_num_seqs)))
    decode_bytes = kv_tokens_read * costs.kv_bytes_per_token + weight_bytes
    prefill_flops = sum(p * costs.flops_per_token + p * (p + 1) // 2 * costs.attention_flops_per_pair
                        for p in prompt_lens)
    return decode_bytes / ceilings.copy_bytes_per_s + prefill_flops / ceilings.matmul_flops_per_s
