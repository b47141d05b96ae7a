"""Microbenchmark of the Triton attention kernels; prints JSON.

- decode at batch 256 x context 1024 (Qwen3-0.6B heads, bf16) per block size: KV bytes read per second and its
  fraction of the device's copy bandwidth (`--copy-bandwidth`, read + write bytes per second);
- a num_splits sweep for small batches (8 and 32) at context 4096 and for the batch above, beside what
  `choose_num_splits` picks;
- prefill of 8 x 1024 new tokens: attention TFLOP/s (causal pairs only).
`--sweep` also times a grid of tile configs (the decode grid at every block size, the prefill grid at the first);
each output is compared with the default config's.
`--kv-cache-dtype fp8` (or fp8_e5m2) stores the caches in FP8 (KV bytes counted at 1 per element).
`--smoke` runs tiny shapes (under TRITON_INTERPRET=1 without CUDA) to check that the script works.

    python scripts/bench_kernels.py --sweep > bench_kernels.json
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import statistics
import time

import torch

HEADS = (16, 8, 128)  # Qwen3-0.6B: query heads, KV heads, head dim


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--block-sizes", default="16,32,64,128,256")
    parser.add_argument("--copy-bandwidth", type=float, default=3.03e12, help="bytes/s, read + write counted")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time a grid of kernel tile configs")
    parser.add_argument("--kv-cache-dtype", default="auto", help="the engine's kv_cache_dtype names")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, a few repeats: checks the script runs")
    return parser.parse_args()


class Workload:
    """Random Q and a paged cache holding `context` tokens per sequence in shuffled blocks (an engine after churn)."""

    def __init__(self, contexts: list[int], new_tokens: list[int], heads: tuple[int, int, int], block_size: int,
                 dtype: torch.dtype, device: torch.device, cache_dtype: torch.dtype | None = None, seed: int = 0):
        num_heads, num_kv_heads, head_dim = heads
        torch.manual_seed(seed)
        counts = [-(-n // block_size) for n in contexts]
        ids = torch.randperm(sum(counts), device=device, dtype=torch.int32)
        self.block_tables = torch.full((len(contexts), max(counts)), -1, dtype=torch.int32, device=device)
        start = 0
        for i, count in enumerate(counts):
            self.block_tables[i, :count] = ids[start:start + count]
            start += count
        shape = (sum(counts), block_size, num_kv_heads, head_dim)
        cache_dtype = cache_dtype or dtype
        self.k_cache = torch.randn(shape, dtype=dtype, device=device).to(cache_dtype)
        self.v_cache = torch.randn(shape, dtype=dtype, device=device).to(cache_dtype)
        self.q = torch.randn(sum(new_tokens), num_heads, head_dim, dtype=dtype, device=device)
        self.seq_lens = torch.tensor(contexts, dtype=torch.int32, device=device)
        self.query_start_loc = torch.tensor([0, *itertools.accumulate(new_tokens)], dtype=torch.int32,
                                            device=device)
        self.max_query_len = max(new_tokens)
        self.scale = head_dim ** -0.5
        self.kv_bytes = 2 * sum(contexts) * num_kv_heads * head_dim * cache_dtype.itemsize
        self.causal_flops = sum(4 * num_heads * head_dim * (q * (n - q) + q * (q + 1) // 2)
                                for n, q in zip(contexts, new_tokens))


def median_seconds(fn, repeats: int) -> float:
    """Median over `repeats` calls after warm-up (CUDA events on the GPU, the host clock on the CPU).

    On the GPU each call follows a 256 MB memset: it empties L2 of the last call's data, and the GPU is still
    busy with it while the host launches the call, so no launch gap is timed."""
    for _ in range(min(repeats, 5)):
        fn()
    times = []
    if torch.cuda.is_available():
        scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            scratch.zero_()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        torch.cuda.synchronize()
    else:
        for _ in range(repeats):
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def time_configs(run, configs: list, repeats: int, summarise) -> list[dict]:
    """Time `run(config)` per config; each output is compared with the first config's. A config that the
    compiler rejects (say, too much shared memory) is reported, not fatal."""
    from triton.compiler.errors import CompilationError
    from triton.runtime.errors import OutOfResources

    rows, reference = [], None
    for config in configs:
        try:
            seconds = median_seconds(functools.partial(run, config), repeats)
        except (CompilationError, OutOfResources, RuntimeError) as error:
            rows.append({"config": config._asdict(), "error": f"{type(error).__name__}: {str(error)[:200]}"})
            continue
        out = run(config)
        reference = out.clone() if reference is None else reference
        rows.append({"config": config._asdict(), "us": seconds * 1e6, **summarise(seconds),
                     "rel_diff_vs_first": rel_diff(out, reference)})
    return rows


def main() -> None:
    args = parse_args()
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported (decorated)
    from nanovllm.attention.kv_quant import resolve_kv_cache_dtype
    from nanovllm.kernels.decode_attention import (
        DecodeConfig,
        choose_num_splits,
        default_decode_config,
        paged_decode_attention,
    )
    from nanovllm.kernels.prefill_attention import PrefillConfig, paged_prefill_attention

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    # The interpreter has no bf16 tl.dot (triton-lang/triton#11584): the CPU smoke run uses fp16.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    repeats = 2 if args.smoke else args.repeats
    block_sizes = [16] if args.smoke else [int(b) for b in args.block_sizes.split(",")]
    heads = (4, 2, 64) if args.smoke else HEADS
    decode_batch, decode_context = (4, 64) if args.smoke else (256, 1024)
    # batch, context, split counts to time
    split_shapes = ([(2, 128, (1, 2))] if args.smoke else
                    [(8, 4096, (1, 2, 4, 8, 16, 32)), (32, 4096, (1, 2, 4, 8, 16)), (256, 1024, (1, 2, 4))])
    prefill_seqs, prefill_len = (2, 64) if args.smoke else (8, 1024)
    cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, dtype)
    default_decode = default_decode_config(heads[2], cache_dtype)  # what the engine runs
    decode_configs = [default_decode]
    prefill_configs = [PrefillConfig()]
    if args.sweep:
        grid = itertools.product((32, 64, 128), (4, 8), (2, 3, 4))
        decode_configs += [c for c in map(DecodeConfig._make, grid) if c != default_decode]
        grid = itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3))
        prefill_configs += [c for c in map(PrefillConfig._make, grid) if c != PrefillConfig()]
        if args.smoke:
            decode_configs, prefill_configs = decode_configs[:2], prefill_configs[:2]
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)",
              "dtype": str(dtype), "kv_cache_dtype": str(cache_dtype), "heads": heads,
              "copy_bandwidth": args.copy_bandwidth, "num_sms": num_sms,
              "decode": [], "decode_splits": [], "prefill": []}

    def decode(w: Workload, out: torch.Tensor, num_splits: int, config) -> torch.Tensor:
        return paged_decode_attention(w.q, w.k_cache, w.v_cache, w.block_tables, w.seq_lens, w.scale, num_splits,
                                      out=out, config=config)

    def prefill(w: Workload, out: torch.Tensor, config) -> torch.Tensor:
        return paged_prefill_attention(w.q, w.k_cache, w.v_cache, w.query_start_loc, w.seq_lens, w.block_tables,
                                       w.max_query_len, w.scale, out=out, config=config)

    def bandwidth(kv_bytes: int):
        return lambda seconds: {"kv_bytes_per_s": kv_bytes / seconds,
                                "fraction_of_copy_bw": kv_bytes / seconds / args.copy_bandwidth}

    def flop_rate(flops: int):
        return lambda seconds: {"tflops": flops / seconds / 1e12}

    for block_size in block_sizes:
        w = Workload([decode_context] * decode_batch, [1] * decode_batch, heads, block_size, dtype, device,
                     cache_dtype)
        run = functools.partial(decode, w, torch.empty_like(w.q), 1)
        for row in time_configs(run, decode_configs, repeats, bandwidth(w.kv_bytes)):
            report["decode"].append({"block_size": block_size, "batch": decode_batch, "context": decode_context,
                                     **row})

    for batch, context, split_counts in split_shapes:
        w = Workload([context] * batch, [1] * batch, heads, 16, dtype, device, cache_dtype)
        chosen = choose_num_splits(batch, heads[1], context, num_sms)
        for num_splits in sorted({*split_counts, chosen}):
            run = functools.partial(decode, w, torch.empty_like(w.q), num_splits)
            for row in time_configs(run, [default_decode], repeats, bandwidth(w.kv_bytes)):
                report["decode_splits"].append({"batch": batch, "context": context, "block_size": 16,
                                                "num_splits": num_splits, "chosen": num_splits == chosen, **row})

    for block_size in block_sizes:
        w = Workload([prefill_len] * prefill_seqs, [prefill_len] * prefill_seqs, heads, block_size, dtype, device,
                     cache_dtype)
        run = functools.partial(prefill, w, torch.empty_like(w.q))
        configs = prefill_configs if block_size == block_sizes[0] else prefill_configs[:1]
        for row in time_configs(run, configs, repeats, flop_rate(w.causal_flops)):
            report["prefill"].append({"block_size": block_size, "sequences": prefill_seqs, "tokens_each": prefill_len,
                                      **row})

    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
