"""The multi-LoRA updates (kernels/lora.py's grouped kernels, kernels/lora_dense.py's dense products) against the
base projections they add to, at one decoder layer of
Qwen3-8B by default (hidden 4096, intermediate 12288, 32 q / 8 kv heads of 128; bf16, random weights). GPU; JSON
lines to stdout, or to --out.

Per rank and batch size: --adapters adapters of that rank (in a pool of --max-loras slots of that rank) spread
round-robin over the rows, every --base-every-th row on the base model (0: none). Device time from CUDA events
(median of --repeats after a warm-up) of each projection's base matmul (F.linear) and of its LoRA update
(`add_lora`: shrink + expand; `add_lora_dense`), and of the step's token sort (`sort_tokens_by_slot`, once
per step for every layer) and slot mask (`off_slot_mask`, the dense update's). `stacked_ms`: base and update
together as the engine runs them on a plain weight (every A stacked under the weight: one product, then
`add_dense_expand`). `layer_ratio`, `dense_layer_ratio` and `stacked_layer_ratio`: base time / (base + update
time) over the layer's four projections with the per-step work spread over --layers layers: the share of the
linear layers' throughput that adapters keep (attention excluded). Eager launches: at small batches the
host's launch time, not the device's, may decide a figure (a decode step replays a CUDA graph).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys

import torch
import torch.nn.functional as F

from nanovllm.kernels.lora import add_lora, sort_tokens_by_slot
from nanovllm.kernels.lora_dense import add_dense_expand, add_lora_dense, off_slot_mask
from nanovllm_cli.roofline import median_cuda_ms


def projections(hidden: int, inter: int, q_heads: int, kv_heads: int, head_dim: int) -> dict:
    """name -> (in features, the output widths of its slices)"""
    return {"qkv_proj": (hidden, [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]),
            "o_proj": (q_heads * head_dim, [hidden]), "gate_up_proj": (hidden, [inter, inter]),
            "down_proj": (inter, [hidden])}


def stacked_product(x: torch.Tensor, stacked: torch.Tensor, lora_b: torch.Tensor, starts: list[int],
                    off_slot: torch.Tensor) -> torch.Tensor:
    """The base product and the update with every A stacked under the weight (core/lora/layers.py's way)."""
    y = F.linear(x, stacked)
    return add_dense_expand(y[:, :starts[-1]], y[:, starts[-1]:], lora_b, starts, off_slot)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096])
    parser.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--base-every", type=int, default=0)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=12288)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--out", default=None, help="JSON lines file (default stdout)")
    args = parser.parse_args()
    out = open(args.out, "w") if args.out else sys.stdout
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = projections(args.hidden, args.inter, args.q_heads, args.kv_heads, args.head_dim)
    print(json.dumps({"device": torch.cuda.get_device_name(), "shapes": shapes, "adapters": args.adapters,
                      "max_loras": args.max_loras, "base_every": args.base_every}), file=out, flush=True)
    for rank in args.ranks:
        pools = {}
        for name, (in_features, widths) in shapes.items():
            out_features = sum(widths)
            starts = torch.tensor([0, *torch.tensor(widths).cumsum(0).tolist()], dtype=torch.int32, device=device)
            pools[name] = dict(
                weight=(torch.randn(out_features, in_features, device=device, generator=gen) * 0.02).to(dtype),
                # slot-second storage, slot-first views (as core/lora/layers.py keeps them)
                lora_a=(torch.randn(len(widths), args.max_loras, rank, in_features, device=device, generator=gen)
                        * 0.02).to(dtype).transpose(0, 1),
                lora_b=(torch.randn(out_features, args.max_loras, rank, device=device, generator=gen)
                        * 0.02).to(dtype).transpose(0, 1),
                ranks=torch.full((args.max_loras, len(widths)), rank, dtype=torch.int32, device=device),
                slice_starts=starts,
                starts_host=starts.tolist(), max_slice_width=max(widths))
            pool = pools[name]
            pool["stacked"] = torch.cat([pool["weight"], pool["lora_a"].transpose(0, 1).reshape(-1, in_features)])
        for batch in args.batches:
            slots = torch.arange(batch, device=device, dtype=torch.int32) % args.adapters
            if args.base_every:
                slots[:: args.base_every] = -1
            sorted_batch = sort_tokens_by_slot(slots, args.max_loras)
            sort_ms = median_cuda_ms(functools.partial(sort_tokens_by_slot, slots, args.max_loras), args.repeats)
            slot_ids = torch.arange(args.max_loras, device=device, dtype=torch.int32)
            mask_ms = median_cuda_ms(functools.partial(off_slot_mask, slots, slot_ids), args.repeats)
            off_slot = off_slot_mask(slots, slot_ids)
            row = {"rank": rank, "batch": batch, "block_m": sorted_batch.block_m, "sort_ms": sort_ms,
                   "mask_ms": mask_ms}
            base_total = lora_total = dense_total = stacked_total = 0.0
            for name, (in_features, _) in shapes.items():
                pool = pools[name]
                x = torch.randn(batch, in_features, device=device, generator=gen).to(dtype)
                y = F.linear(x, pool["weight"])
                base_ms = median_cuda_ms(functools.partial(F.linear, x, pool["weight"]), args.repeats)
                lora_ms = median_cuda_ms(functools.partial(
                    add_lora, y, x, pool["lora_a"], pool["lora_b"], pool["ranks"], pool["slice_starts"],
                    pool["max_slice_width"], sorted_batch), args.repeats)
                dense_ms = median_cuda_ms(functools.partial(
                    add_lora_dense, y, x, pool["lora_a"], pool["lora_b"], pool["starts_host"], off_slot),
                    args.repeats)
                stacked_ms = median_cuda_ms(functools.partial(
                    stacked_product, x, pool["stacked"], pool["lora_b"], pool["starts_host"], off_slot), args.repeats)
                row[name] = {"base_ms": base_ms, "lora_ms": lora_ms, "dense_ms": dense_ms, "stacked_ms": stacked_ms}
                base_total += base_ms
                lora_total += lora_ms
                dense_total += dense_ms
                stacked_total += stacked_ms
            row["layer_ratio"] = base_total / (base_total + lora_total + sort_ms / args.layers)
            row["dense_layer_ratio"] = base_total / (base_total + dense_total + mask_ms / args.layers)
            row["stacked_layer_ratio"] = base_total / (stacked_total + mask_ms / args.layers)
            print(json.dumps(row), file=out, flush=True)


if __name__ == "__main__":
    main()
