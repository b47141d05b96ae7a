"""Host time (schedule + prepare) of every decode step of the `nanovllm bench` default workload, by batch size.

Runs the bench's synthetic workload (256 requests, lengths U[100, 1024], seed 0) once in the sync loop and once
in the async loop after bench's warm-up, and prints one JSON line: per batch-size range [steps, mean, median,
p90, max] in ms, and the sum of the 20 slowest steps. `bench --json` reports the mean over all decode steps and
the median at the largest batch; this shows where in the run the host time goes.

    python scripts/bench_host_by_batch.py [--model qwen3-0.6b] [--label NAME] [--num-seqs 256] [--max-len 1024]
"""
import argparse
import json

import numpy as np
from bench_setup import add_workload_arguments, warmed_up_engine

from nanovllm_cli.bench import run_workload

RANGES = ((1, 64), (65, 128), (129, 192), (193, 255), (256, 256))


def summarise(ms: np.ndarray) -> list:
    return [len(ms), *(round(float(v), 3) for v in (ms.mean(), np.median(ms), np.percentile(ms, 90), ms.max()))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    llm, workload = warmed_up_engine(args)
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
