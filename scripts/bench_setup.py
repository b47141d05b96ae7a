"""What the per-step scripts share: `nanovllm bench`'s synthetic workloads (default: lengths U[100, --max-len], seed 0;
`--dataset-name sharegpt`: the ShareGPT-like lengths) on a preset with dummy weights, behind bench's warm-up."""
from __future__ import annotations

import argparse

from nanovllm import LLM
from nanovllm_cli.bench import Workload, run_workload, synthetic_workload, warmup_workload
from nanovllm_cli.bench_workload import SHAREGPT_LIKE


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024, help="prompt and output lengths are U[100, this]")
    parser.add_argument("--dataset-name", choices=("random", "sharegpt"), default="random",
                        help="sharegpt: bench's ShareGPT-like lengths (lognormal, median 150, clipped to [4, 1024]) "
                             "instead of U[100, --max-len]")


def warmed_up_engine(args: argparse.Namespace) -> tuple[LLM, Workload]:
    """The engine, after bench's warm-up, and the workload to measure on it."""
    llm = LLM(args.model, load_format="dummy")
    lengths = SHAREGPT_LIKE if args.dataset_name == "sharegpt" else (100, args.max_len)
    workload = synthetic_workload(args.num_seqs, lengths, lengths, llm.info.vocab_size, 0)
    run_workload(llm, warmup_workload(llm, 0), "warm-up", False)
    return llm, workload
