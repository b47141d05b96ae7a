"""Device time by kernel over one `nanovllm bench` workload (torch.profiler, CUDA activity only): which kernels
a setting (an FP8 cache, FP8 weights, a model shape) makes faster or slower. Prints one JSON line: total kernel
ms, and the top kernels by total time with their call count.

    python scripts/profile_kernels.py --model qwen3-8b --output-len 256 [--kv-cache-dtype fp8] [--quantization fp8]
"""
import argparse
import json
from collections import defaultdict

import torch
from bench_setup import add_workload_arguments

from nanovllm import LLM
from nanovllm_cli.bench import run_workload, synthetic_workload, warmup_workload


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_workload_arguments(parser)
    parser.add_argument("--output-len", type=int, default=None, help="every output this long (default U[100, max])")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--quantization", default=None)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy", kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)
    lengths = (100, args.max_len)
    outputs = lengths if args.output_len is None else (args.output_len, args.output_len)
    workload = synthetic_workload(args.num_seqs, lengths, outputs, llm._runner.vocab_size, 0)
    run_workload(llm, warmup_workload(llm, 0), "warm-up", False)
    on_cuda = torch.cuda.is_available()  # on the CPU (a smoke run): the ops' CPU time
    activity = torch.profiler.ProfilerActivity.CUDA if on_cuda else torch.profiler.ProfilerActivity.CPU
    device = torch.autograd.DeviceType.CUDA if on_cuda else torch.autograd.DeviceType.CPU
    with torch.profiler.profile(activities=[activity]) as profiler:
        stats, _ = run_workload(llm, workload, "profiled", False)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in profiler.events():
        if event.device_type == device:
            entry = by_kernel[event.name[:120]]
            entry[0] += (event.device_time_total if on_cuda else event.self_cpu_time_total) / 1000
            entry[1] += 1
    top = sorted(by_kernel.items(), key=lambda item: -item[1][0])[:args.top]
    print(json.dumps({"model": args.model, "kv_cache_dtype": args.kv_cache_dtype, "quantization": args.quantization,
                      "wall_s": stats["wall_s"], "steps": stats["steps"],
                      "kernel_ms": sum(ms for ms, _ in by_kernel.values()),
                      "top": [{"kernel": name, "ms": round(ms, 2), "calls": calls} for name, (ms, calls) in top]}))


if __name__ == "__main__":
    main()
