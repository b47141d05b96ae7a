"""The fused MoE experts (two grouped Triton GEMMs) against a per-expert torch loop, at one MoE layer of
Qwen3-30B-A3B by default (hidden 2048, 128 experts, top-8, expert intermediate 768, bf16, random weights and
routing). GPU; JSON lines to stdout, or to --out.

Per batch size: device time of each path from CUDA events (median of --repeats after a warm-up), the routing
computed once outside the timed region. Each call runs on the next of --layers distinct weight sets, as a
model's layers follow each other, so that a small batch's experts are not still in L2 from the call before.
Also: the fused path's expert sort (`align_by_expert`, kernel and torch ops) alone, the number of distinct
experts the batch selected, and the fraction of the copy bandwidth that reading those experts' weights in the
fused time would be. Target: fused >= 5x the loop at batch 256. `--sweep` also times a grid of tile
configurations per batch and reports the best beside the default (`choose_tiles`).
"""
from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

import torch

from nanovllm.kernels.fused_moe import MoeTiles, align_by_expert, choose_tiles, fused_moe
from nanovllm.layers.moe import moe_experts_torch, select_experts
from nanovllm_cli.roofline import measure_ceilings, median_cuda_ms


def on_each_layer(compute, layers, x, *args):
    """A thunk that runs `compute(x, w13, w2, *args)` on the next layer's weights at every call."""
    cycle = itertools.cycle(layers)
    return lambda: compute(x, *next(cycle), *args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default=None, help="JSON lines file (default stdout)")
    args = parser.parse_args()
    out = open(args.out, "w") if args.out else sys.stdout
    device = torch.device("cuda")
    ceilings = measure_ceilings(device)
    gen = torch.Generator(device=device).manual_seed(0)
    e, h, i = args.experts, args.hidden, args.inter
    layers = [((torch.randn(e, 2 * i, h, device=device, generator=gen) * 0.02).to(torch.bfloat16),
               (torch.randn(e, h, i, device=device, generator=gen) * 0.02).to(torch.bfloat16))
              for _ in range(args.layers)]
    w13, w2 = layers[0]
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    print(json.dumps({"device": ceilings.name, "copy_bytes_per_s": ceilings.copy_bytes_per_s, "hidden": h,
                      "experts": e, "top_k": args.top_k, "inter": i, "layers": args.layers}), file=out, flush=True)
    for batch in args.batches:
        x = torch.randn(batch, h, device=device, generator=gen).to(torch.bfloat16)
        weights, ids = select_experts(torch.randn(batch, e, device=device, generator=gen), args.top_k,
                                      renormalize=True)
        fused_ms = median_cuda_ms(on_each_layer(fused_moe, layers, x, weights, ids), args.repeats)
        loop_ms = median_cuda_ms(on_each_layer(moe_experts_torch, layers, x, weights, ids), args.repeats)
        tiles = choose_tiles(batch * args.top_k, e)
        align_ms = median_cuda_ms(functools.partial(align_by_expert, ids, e, tiles.block_m), args.repeats)
        align_torch_ms = median_cuda_ms(functools.partial(align_by_expert, ids, e, tiles.block_m, False),
                                        args.repeats)
        reference = moe_experts_torch(x, w13, w2, weights, ids).float()
        error = ((fused_moe(x, w13, w2, weights, ids).float() - reference).norm() / reference.norm()).item()
        distinct = int(ids.unique().numel())
        row = {"batch": batch, "fused_ms": fused_ms, "loop_ms": loop_ms, "speedup": loop_ms / fused_ms,
               "align_ms": align_ms, "align_torch_ms": align_torch_ms, "tiles": tiles._asdict(),
               "distinct_experts": distinct,
               "fused_bw_frac": distinct * expert_bytes / (fused_ms * 1e-3) / ceilings.copy_bytes_per_s,
               "relative_error": error}
        if args.sweep:
            best = None
            for config in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (4, 8), (3, 4)):
                candidate = MoeTiles(*config)
                try:
                    ms = median_cuda_ms(on_each_layer(fused_moe, layers, x, weights, ids, candidate), args.repeats)
                except Exception as exc:  # a config the compiler rejects (shared memory)
                    print(f"skip {candidate}: {type(exc).__name__}", file=sys.stderr)
                    continue
                if best is None or ms < best[0]:
                    best = (ms, candidate)
            row["best_ms"], row["best_tiles"] = best[0], best[1]._asdict()
        print(json.dumps(row), file=out, flush=True)


if __name__ == "__main__":
    main()
