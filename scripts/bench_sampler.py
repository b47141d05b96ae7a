"""Sampler alone on the GPU: the torch path (full-vocabulary sort + per-entry hash, what sampling cost before the
fused kernel) against the fused Triton kernel, and compute_logprobs(k=5); JSON lines.

    python scripts/bench_sampler.py OUT.jsonl [--batches 1 16 64 256] [--vocab 151936] [--reps 50] [--sweep]

Runs from a checkout with only torch and triton installed (no engine imports). Each line: mode, batch, vocab,
path ("torch_full_sort" | "fused_kernel" | "sample_dispatch" | "logprobs_k5"), median ms over `reps` CUDA-event
timings, and for the kernel the fraction of rows whose token equals the torch path's (same seeds: expected 1.0 but
for knife-edge float rounding). "fused_kernel" is `fused_sample` with its defaults, "sample_dispatch" what the
engine's `sample` runs. --sweep also times the kernel at other (block, num_warps, cap) configurations."""
from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import types
from pathlib import Path

import torch

from nanovllm_cli.roofline import median_cuda_ms

ROOT = Path(__file__).resolve().parent.parent


def import_sampling_modules():
    """nanovllm's sampling modules; without the engine's dependencies, straight from the checkout's folders."""
    try:
        import nanovllm  # noqa: F401
    except ImportError:
        for name, folder in (("nanovllm", "core"), ("nanovllm.kernels", "kernels")):
            package = types.ModuleType(name)
            package.__path__ = [str(ROOT / folder)]
            sys.modules[name] = package
    return (importlib.import_module("nanovllm.layers.sampler"), importlib.import_module("nanovllm.kernels.sampling"),
            importlib.import_module("nanovllm.layers.logprobs"))


# mode -> (temperature, top_k (None: off), top_p, min_p)
MODES = {
    "greedy": (0.0, None, 1.0, 0.0),
    "temperature": (0.8, None, 1.0, 0.0),
    "top_k_top_p": (0.8, 50, 0.95, 0.0),
    "min_p": (0.8, None, 1.0, 0.05),
    "top_p": (0.8, None, 0.95, 0.0),
}

SWEEP = [(block, warps, cap) for block, warps in ((2048, 4), (4096, 4), (4096, 8), (4096, 16), (8192, 8),
                                                   (8192, 16), (8192, 32), (16384, 16), (16384, 32))
         for cap in (256, 512)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="JSON lines output path")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--logit-scale", type=float, default=3.0, help="std of the random bf16 logits")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--sweep", action="store_true",
                        help="also time the kernel at other (block, num_warps, cap) configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_sampler needs a CUDA device")
    sampler, kernels, logprobs = import_sampling_modules()
    device = torch.device("cuda")
    generator = torch.Generator(device).manual_seed(0)
    with open(args.out, "w") as out:
        def emit(record):
            line = json.dumps(record)
            print(line, flush=True)
            out.write(line + "\n")

        emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": importlib.import_module("triton").__version__})
        for batch in args.batches:
            logits = (torch.randn(batch, args.vocab, device=device, generator=generator) * args.logit_scale)
            logits = logits.to(torch.bfloat16)
            for mode in args.modes:
                temperature, top_k, top_p, min_p = MODES[mode]
                t = types.SimpleNamespace(  # the sampler reads these fields (layers/sampler.py SamplingSettings)
                    temperatures=torch.full((batch,), temperature, device=device),
                    top_k=torch.full((batch,), args.vocab if top_k is None else top_k, dtype=torch.int64,
                                     device=device),
                    top_p=torch.full((batch,), top_p, device=device),
                    min_p=torch.full((batch,), min_p, device=device),
                    seeds=torch.arange(batch, dtype=torch.int64, device=device) * 7919,
                    sample_positions=torch.arange(batch, dtype=torch.int64, device=device),
                    all_greedy=temperature == 0, any_filter=top_k is not None or top_p < 1 or min_p > 0)
                base = {"mode": mode, "batch": batch, "vocab": args.vocab, "dtype": "bfloat16"}
                torch_path = functools.partial(sampler.reference_sample, logits, t)
                fused = functools.partial(kernels.fused_sample, logits, t.temperatures, t.top_k, t.top_p, t.min_p,
                                          t.seeds, t.sample_positions)
                emit({**base, "path": "torch_full_sort", "ms": median_cuda_ms(torch_path, args.reps)})
                agree = (fused() == torch_path()).float().mean().item()
                emit({**base, "path": "fused_kernel", "ms": median_cuda_ms(fused, args.reps), "agree": agree})
                for block, num_warps, cap in SWEEP if args.sweep and mode != "greedy" else ():
                    config = {"block": block, "num_warps": num_warps, "cap": cap}
                    emit({**base, **config, "path": "fused_kernel_sweep",
                          "ms": median_cuda_ms(functools.partial(fused, **config), args.reps)})
                # what the engine runs, sample(): a torch argmax for an all-greedy batch, else the fused kernel
                emit({**base, "path": "sample_dispatch",
                      "ms": median_cuda_ms(functools.partial(sampler.sample, logits, t), args.reps)})
            scored = functools.partial(logprobs.compute_logprobs, logits, logits.argmax(dim=-1), 5)
            emit({"mode": "logprobs", "batch": batch, "vocab": args.vocab, "dtype": "bfloat16",
                  "path": "logprobs_k5", "ms": median_cuda_ms(scored, args.reps)})


if __name__ == "__main__":
    main()
