"""Host time (schedule + prepare) of every decode step of the `nanovllm bench` default workload, by batch size.

Runs the bench's synthetic workload (256 requests, lengths U[100, 1024], seed 0) once in the sync loop and once
in the async loop after a short warm-up, and prints one JSON line: per batch-size range [steps, mean, median,
p90, max] in ms, and the sum of the 20 slowest steps. `bench --json` reports the mean over all decode steps and
the median at the largest batch; this shows where in the run the host time goes.

    python scripts/bench_host_by_batch.py [--model qwen3-0.6b] [--label NAME] [--num-seqs 256] [--max-len 1024]
"""
import argparse
import json

import numpy as np

from nanovllm import LLM
from nanovllm_cli.bench import run_workload, synthetic_workload, warmup_workload

RANGES = ((1, 64), (65, 128), (129, 192), (193, 255), (256, 256))


def summarise(ms: np.ndarray) -> list:
    return [len(ms), *(round(float(v), 3) for v in (ms.mean(), np.median(ms), np.percentile(ms, 90), ms.max()))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--label", default="")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024, help="prompt and output lengths are U[100, this]")
    args = parser.parse_args()
    llm = LLM(args.model, load_format="dummy")
    vocab = llm.runner.vocab_size
    workload = synthetic_workload(args.num_seqs, (100, args.max_len), (100, args.max_len), vocab, 0)
    run_workload(llm, warmup_workload(llm, 0), "warm-up", False)
    result = {"label": args.label}
    for overlap in (False, True):
        llm.set_async_scheduling(overlap)
        run_workload(llm, workload, "run", False)
        steps = np.array(llm.stats.decode_host_s)
        batch, ms = steps[:, 0], steps[:, 1] * 1000
        rows = {f"{lo}-{hi}": summarise(ms[(batch >= lo) & (batch <= hi)]) for lo, hi in RANGES
                if ((batch >= lo) & (batch <= hi)).any()}
        rows["all"] = summarise(ms)
        rows["sum_top20_ms"] = round(float(np.sort(ms)[-20:].sum()), 1)
        result["async" if overlap else "sync"] = rows
    llm.exit()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
