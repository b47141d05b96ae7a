"""The decode step's projections at few rows: cuBLAS (F.linear) against the split-K skinny GEMM (GPU; JSON lines).

Each shape is run as in a decode step: once per layer on that layer's own weight (a model's worth of distinct
weights, so they stream from memory, not from L2), all calls captured in one CUDA graph; time per call is the
graph's time over the calls. The weight bytes per call over that time are compared with the measured copy
bandwidth. `--sweep` also times a grid of skinny configurations and reports the best beside the chosen one.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F

from nanovllm.kernels.skinny_gemm import WORKSPACE_FLOATS, SkinnyConfig, choose_config, skinny_linear
from nanovllm.loaders.resolve import resolve_model
from nanovllm.models.geometry import head_dim_of
from nanovllm_cli.roofline import measure_ceilings


def graph_ms_per_call(calls) -> float:
    """Device ms per call of `calls` (a list of thunks) replayed as one CUDA graph, median of 5 replays."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:  # compile and initialise outside the capture
            call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(6):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times[1:])[2] / len(calls)


def projection_shapes(hf) -> dict[str, tuple[int, int]]:
    """name -> (N, K) of a decoder layer's projection weights (q/k/v and gate/up packed)."""
    head_dim = head_dim_of(hf)
    return {
        "qkv": ((hf.num_attention_heads + 2 * hf.num_key_value_heads) * head_dim, hf.hidden_size),
        "o": (hf.hidden_size, hf.num_attention_heads * head_dim),
        "gate_up": (2 * hf.intermediate_size, hf.hidden_size),
        "down": (hf.hidden_size, hf.intermediate_size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    hf = resolve_model(args.model, load_format="dummy").hf_config
    shapes = projection_shapes(hf)
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    layers = hf.num_hidden_layers
    sweep = [SkinnyConfig(0, bn, bk, sk, warps, stages) for bn, bk, sk, warps, stages in
             itertools.product((32, 64, 128), (128, 256), (1, 2, 4, 8), (4,), (4,))]
    print(json.dumps({"device": ceilings.name, "copy_bytes_per_s": ceilings.copy_bytes_per_s, "sms": num_sms}))
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            reference = F.linear(x, weights[0]).float()
            chosen = choose_config(m, n, k, num_sms)
            row = {"shape": name, "n": n, "k": k, "m": m, "chosen": chosen._asdict()}
            row["cublas_us"] = 1e3 * graph_ms_per_call([functools.partial(F.linear, x, w) for w in weights])
            row["skinny_us"] = 1e3 * graph_ms_per_call([functools.partial(skinny_linear, x, w, None, chosen)
                                                        for w in weights])
            error = (skinny_linear(x, weights[0], None, chosen).float() - reference).abs().max().item()
            row["skinny_max_abs_err"] = error
            if args.sweep:
                best = None
                for config in sweep:
                    config = config._replace(block_m=chosen.block_m)
                    if config.split_k * m * n > WORKSPACE_FLOATS or k // config.split_k < config.block_k:
                        continue
                    try:
                        us = 1e3 * graph_ms_per_call([functools.partial(skinny_linear, x, w, None, config)
                                                      for w in weights])
                    except Exception as exc:  # a config the compiler rejects (shared memory)
                        print(f"skip {config}: {type(exc).__name__}", file=sys.stderr)
                        continue
                    if best is None or us < best[0]:
                        best = (us, config)
                row["best_us"], row["best"] = best[0], best[1]._asdict()
            weight_bytes = n * k * 2
            for key in ("cublas", "skinny", "best"):
                if f"{key}_us" in row:
                    row[f"{key}_bw_frac"] = weight_bytes / (row[f"{key}_us"] * 1e-6) / ceilings.copy_bytes_per_s
            print(json.dumps(row), flush=True)
        del weights
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
