"""One workload through whichever nanovllm is importable, with the public API only, so that two trees (e.g. the
working tree and an older commit installed elsewhere) run the same rows on one machine in one go. Prints one JSON
line per round: wall time of the steps, output tok/s, steps, a digest of every row's tokens (equal digests: the
same tokens), the engine's start-up seconds, its batch size.

    python scripts/ab_compare.py --model qwen3-8b --workload sharegpt --rows 1000 --rounds 2 --label new
    PYTHONPATH=/tmp/old python scripts/ab_compare.py ... --label old

Workloads: `sharegpt` (prompt and output lengths lognormal, median 150, sigma 1.0, clipped to [4, 1024]: the
shape of ShareGPT conversations) and `uniform` (prompts U[--min-len, --max-len], every output --output-len); random
token ids below --id-range, EOS ignored. `--sampling` takes SamplingParams fields as JSON."""
from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
import time

import numpy as np


def workload(kind: str, rows: int, seed: int, id_range: int, min_len: int, max_len: int,
             output_len: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    if kind == "sharegpt":
        lengths = np.random.default_rng(seed)
        prompt_lens = np.clip(np.round(np.exp(lengths.normal(np.log(150), 1.0, rows))), 4, 1024).astype(int)
        output_lens = np.clip(np.round(np.exp(lengths.normal(np.log(150), 1.0, rows))), 4, 1024).astype(int)
    else:
        prompt_lens = [rng.randint(min_len, max_len) for _ in range(rows)]
        output_lens = [output_len] * rows
    prompts = [[rng.randrange(id_range) for _ in range(int(n))] for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def run(llm, prompts: list[list[int]], output_lens: list[int], sampling: dict) -> dict:
    from nanovllm import SamplingParams

    llm.reset_prefix_cache()
    llm.reset_stats()
    ids = [llm.add_request(None, SamplingParams(**sampling, max_tokens=n, ignore_eos=True), prompt_token_ids=p)
           for p, n in zip(prompts, output_lens)]
    produced = {}
    started = time.perf_counter()
    while llm.has_unfinished_requests():
        for out in llm.step():
            produced[out.request_id] = out.token_ids if out.error is None else None
    wall = time.perf_counter() - started
    failed = sum(produced[i] is None for i in ids)
    tokens = sum(len(produced[i] or ()) for i in ids)
    digest = hashlib.sha1(json.dumps([produced[i] for i in ids]).encode()).hexdigest()[:12]
    return {"wall_s": round(wall, 3), "output_tok_s": round(tokens / wall, 1), "output_tokens": tokens,
            "rows_failed": failed, "steps": llm.get_stats().get("steps"), "tokens_digest": digest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--workload", choices=["sharegpt", "uniform"], default="sharegpt")
    parser.add_argument("--rows", type=int, default=1000)
    parser.add_argument("--min-len", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--id-range", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--sampling", default="{}", help="SamplingParams fields as JSON (default greedy)")
    parser.add_argument("--engine-args", default="{}", help="LLM arguments as JSON")
    parser.add_argument("--label", default="")
    parser.add_argument("--cold", action="store_true",
                        help="no warm-up run: the first round is the engine's first request (first-use costs in it)")
    args = parser.parse_args()
    from nanovllm import LLM

    started = time.perf_counter()
    llm = LLM(args.model, load_format="dummy", **json.loads(args.engine_args))
    startup = time.perf_counter() - started
    info = llm.info
    prompts, output_lens = workload(args.workload, args.rows, args.seed, args.id_range, args.min_len, args.max_len,
                                    args.output_len)
    sampling = {"temperature": 0.0, **json.loads(args.sampling)}
    if not args.cold:
        run(llm, prompts[:64], [8] * 64, sampling)  # first-use costs stay out of the rounds
    for round_ in range(args.rounds):
        record = {"label": args.label, "model": args.model, "workload": args.workload, "rows": args.rows,
                  "sampling": sampling, "engine_args": json.loads(args.engine_args), "round": round_ + 1,
                  "startup_s": round(startup, 2), "max_num_seqs": info.max_num_seqs,
                  "startup_phases": getattr(info, "startup_s", None), **run(llm, prompts, output_lens, sampling)}
        print(json.dumps(record), flush=True)
    llm.exit()


if __name__ == "__main__":
    sys.exit(main())
