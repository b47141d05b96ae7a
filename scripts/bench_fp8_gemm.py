"""FP8 projections at decode-sized batches: bf16 cuBLAS against FP8 through cuBLASLt (`torch._scaled_mm`, row-wise
scales) and through the Triton kernels (per channel, and 128 x 128 block-scaled), on a model's projection shapes
(GPU of compute capability >= 8.9; JSON lines).

Each shape is run as in a decode step: once per layer on that layer's own weight (so weights stream from memory,
not L2), all calls captured in one CUDA graph (scripts/bench_gemm.py `graph_ms_per_call`). Per row count it
times the GEMMs alone on pre-quantized activations, the activation quantization alone, and the whole FP8 linear
(quantization + GEMM) of each path, and tries torch's own block-scaled `_scaled_mm` (1x128 activations,
128x128 weights; timed where this torch and GPU take it, else the error is recorded). The last line suggests
layers/fp8.py's `TRITON_MAX_ROWS`: the largest row count up to which the Triton path of the whole linear beats
cuBLASLt on every shape. `--sweep` also times a grid of Triton tile configurations and reports the best beside
the chosen one.
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch
import torch.nn.functional as F
from bench_gemm import graph_ms_per_call, projection_shapes

from nanovllm.kernels.fp8_gemm import Fp8GemmConfig, choose_config, fp8_gemm, quantize_groups
from nanovllm.layers.fp8 import quantize
from nanovllm.loaders.resolve import resolve_model
from nanovllm_cli.roofline import measure_ceilings

BLOCK = (128, 128)


def scaled_mm(xq, xs, wq, ws, dtype):
    return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=dtype)


def scaled_mm_block(xbq, a_scale, wq, ws, contiguous_b: bool):
    """torch's own 1x128 x 128x128 block-scaled _scaled_mm (newer torch, Hopper): scale_a [M, K/128] M-major,
    scale_b [K/128, N/128] (as a view of ours, or contiguous)."""
    b_scale = ws.t().contiguous() if contiguous_b else ws.t()
    return torch._scaled_mm(xbq, wq.t(), scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16)


def try_scaled_mm_block(row, xbq, xbs, block, triton_out):
    """Time torch's block-scaled _scaled_mm in the first scale layout that runs and matches the Triton kernel;
    else record why not."""
    a_scale = xbs.t().contiguous().t()
    errors = {}
    for contiguous_b in (False, True):
        layout = "scale_b_contiguous" if contiguous_b else "scale_b_view"
        try:
            out = scaled_mm_block(xbq, a_scale, *block[0], contiguous_b).float()
        except Exception as exc:  # not supported by this torch / GPU / layout
            errors[layout] = f"{type(exc).__name__}: {str(exc)[:160]}"
            continue
        err = ((out - triton_out.float()).norm() / triton_out.float().norm()).item()
        if err > 1e-2:
            errors[layout] = f"rel err {err:.3g} vs the Triton block kernel"
            continue
        calls = [functools.partial(scaled_mm_block, xbq, a_scale, q, s, contiguous_b) for q, s in block]
        row["gemm_scaled_mm_block_us"], row["scaled_mm_block_layout"] = 1e3 * graph_ms_per_call(calls), layout
        return
    row["scaled_mm_block_errors"] = errors


def linear_scaled_mm(x, wq, ws):
    xq, xs = quantize_groups(x, x.shape[1])
    return scaled_mm(xq, xs, wq, ws, x.dtype)


def linear_triton(x, wq, ws, block, config=None):
    xq, xs = quantize_groups(x, block[1] if block else x.shape[1])
    return fp8_gemm(xq, xs, wq, ws, block, None, x.dtype, config)


def best_config(calls_for, m: int, block) -> tuple[float, Fp8GemmConfig] | None:
    best = None
    for bm, bn, warps, stages in itertools.product((16, 32, 64, 128), (32, 64, 128), (4, 8), (3, 4, 5)):
        if bm > max(16, 2 * m):
            continue
        config = Fp8GemmConfig(bm, bn, block[1] if block else 128, warps, stages)
        try:
            us = 1e3 * graph_ms_per_call(calls_for(config))
        except Exception as exc:  # a config the compiler rejects (shared memory)
            print(f"skip {config}: {type(exc).__name__}", file=sys.stderr)
            continue
        if best is None or us < best[0]:
            best = (us, config)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256])
    parser.add_argument("--layers", type=int, default=None, help="weights per shape (default: the model's layers)")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    hf = resolve_model(args.model, load_format="dummy").hf_config
    shapes = projection_shapes(hf)
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    layers = args.layers or hf.num_hidden_layers
    print(json.dumps({"device": ceilings.name, "capability": torch.cuda.get_device_capability(device),
                      "copy_bytes_per_s": ceilings.copy_bytes_per_s, "model": args.model, "layers": layers}))
    triton_wins: dict[int, bool] = {m: True for m in args.rows}
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02 for _ in range(layers)]
        channel = [quantize(w, (1, k)) for w in weights]
        block = [quantize(w, BLOCK) for w in weights]
        for m in args.rows:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            xq, xs = quantize_groups(x, k)
            xbq, xbs = quantize_groups(x, BLOCK[1])
            row = {"shape": name, "n": n, "k": k, "m": m, "chosen": choose_config(m, None)._asdict()}
            timings = {
                "bf16_cublas": [functools.partial(F.linear, x, w) for w in weights],
                "quant_per_token": [functools.partial(quantize_groups, x, k)] * layers,
                "quant_per_group128": [functools.partial(quantize_groups, x, BLOCK[1])] * layers,
                "gemm_scaled_mm": [functools.partial(scaled_mm, xq, xs, q, s, x.dtype) for q, s in channel],
                "gemm_triton_channel": [functools.partial(fp8_gemm, xq, xs, q, s, None, None, x.dtype)
                                        for q, s in channel],
                "gemm_triton_block": [functools.partial(fp8_gemm, xbq, xbs, q, s, BLOCK, None, x.dtype)
                                      for q, s in block],
                "linear_scaled_mm": [functools.partial(linear_scaled_mm, x, q, s) for q, s in channel],
                "linear_triton_channel": [functools.partial(linear_triton, x, q, s, None) for q, s in channel],
                "linear_triton_block": [functools.partial(linear_triton, x, q, s, BLOCK) for q, s in block],
            }
            for key, calls in timings.items():
                row[f"{key}_us"] = 1e3 * graph_ms_per_call(calls)
            reference = F.linear(x, weights[0]).float()
            for key, out in (("scaled_mm", linear_scaled_mm(x, *channel[0])),
                             ("triton_channel", linear_triton(x, *channel[0], None)),
                             ("triton_block", linear_triton(x, *block[0], BLOCK))):
                row[f"{key}_rel_err"] = ((out.float() - reference).norm() / reference.norm()).item()
            for key, nbytes in (("bf16_cublas", 2 * n * k), ("gemm_scaled_mm", n * k), ("gemm_triton_channel", n * k),
                                ("gemm_triton_block", n * k)):
                row[f"{key}_bw_frac"] = nbytes / (row[f"{key}_us"] * 1e-6) / ceilings.copy_bytes_per_s
            try_scaled_mm_block(row, xbq, xbs, block, fp8_gemm(xbq, xbs, *block[0], BLOCK, None, x.dtype))
            triton_wins[m] &= row["linear_triton_channel_us"] < row["linear_scaled_mm_us"]
            if args.sweep:
                for label, blk, operands in (("channel", None, (xq, xs, channel)), ("block", BLOCK, (xbq, xbs, block))):
                    aq, as_, ws = operands
                    found = best_config(lambda c, aq=aq, as_=as_, ws=ws, blk=blk, dtype=x.dtype: [
                        functools.partial(fp8_gemm, aq, as_, q, s, blk, None, dtype, c) for q, s in ws], m, blk)
                    if found:
                        row[f"best_{label}_us"], row[f"best_{label}"] = found[0], found[1]._asdict()
            print(json.dumps(row), flush=True)
        del weights, channel, block
        torch.cuda.empty_cache()
    wins = sorted(m for m, won in triton_wins.items() if won)
    below = [m for m in sorted(args.rows) if all(triton_wins[r] for r in sorted(args.rows) if r <= m)]
    print(json.dumps({"triton_faster_at_rows": wins, "suggested_TRITON_MAX_ROWS": below[-1] if below else 0}))


if __name__ == "__main__":
    main()
