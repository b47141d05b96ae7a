"""nanovllm against HF transformers' continuous batching on one workload, in one run; prints JSON.

The workload is `nanovllm bench`'s synthetic one (random token ids, prompt lengths uniform in a range, a fixed
output length, EOS ignored, greedy). nanovllm runs first in a subprocess (`nanovllm bench --json`, which takes
most of the GPU memory for its KV cache and gives it back on exit), then HF `generate_batch` with paged SDPA
attention runs here on a model of the same shape with random weights.

    python scripts/bench_peers.py --model qwen3-0.6b --output-len 512 > peers.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a preset (dummy weights)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--input-len-range", type=int, nargs=2, default=(100, 1024))
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--nanovllm-args", default="", help="extra flags for `nanovllm bench`")
    return parser.parse_args()


def run_nanovllm(args) -> dict:
    command = ["nanovllm", "bench", "--model", args.model, "--load-format", "dummy", "--json",
               "--num-seqs", str(args.num_seqs), "--input-len-range", *map(str, args.input_len_range),
               "--output-len-range", str(args.output_len), str(args.output_len), "--seed", str(args.seed),
               *args.nanovllm_args.split()]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def run_hf(args) -> dict:
    from transformers import AutoModelForCausalLM
    from transformers.generation import GenerationConfig

    from nanovllm.loaders import resolve_model
    from nanovllm_cli.bench import synthetic_workload

    config = resolve_model(args.model, "dummy").hf_config
    workload = synthetic_workload(args.num_seqs, tuple(args.input_len_range), (args.output_len, args.output_len),
                                  config.vocab_size, args.seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="paged|sdpa")
    model.eval()
    generation = GenerationConfig(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
    model.generate_batch(inputs=workload.prompts[:8], generation_config=generation, progress_bar=False)  # warm-up
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=workload.prompts, generation_config=generation, progress_bar=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    generated = sum(len(o.generated_tokens) for o in outputs.values())
    return {"implementation": "transformers generate_batch, paged|sdpa", "requests": len(outputs),
            "output_tokens": generated, "wall_s": wall, "output_tok_s": generated / wall}


def main() -> None:
    args = parse_args()
    import transformers

    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "workload": vars(args)}
    report["nanovllm"] = run_nanovllm(args)
    if not args.skip_hf:
        report["hf"] = run_hf(args)
        mode = next(iter(report["nanovllm"]["modes"].values()))
        report["nanovllm_over_hf"] = mode["output_tok_s"] / report["hf"]["output_tok_s"]
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
