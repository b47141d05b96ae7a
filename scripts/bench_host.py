"""Host cost of one decode step: schedule + prepare at N running sequences, timed phase by phase.

Fills the engine with N sequences, runs until every one is decoding, then times `--steps` pure-decode steps of
the real step loop's phases (schedule, prepare, execute launch, wait, postprocess). `--profile` prints a cProfile
of schedule + prepare. Runs on the CPU (tiny model) or on a GPU (e.g. --model qwen3-0.6b).

`--skip-forward` (CPU): postprocess gets token 0 for every sequence instead of running the model, so the host
phases run back to back as on a GPU host, whose forward runs asynchronously; on the CPU a real forward between
them evicts the host's caches and inflates every phase."""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

from nanovllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-qwen3")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--skip-forward", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.model, load_format="dummy", max_num_seqs=args.num_seqs, enforce_eager=args.enforce_eager,
              enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.steps + 64, ignore_eos=True, temperature=args.temperature, seed=0)
    for i in range(args.num_seqs):
        llm.add_request([(i * 7 + j) % 500 + 3 for j in range(args.prompt_len)], params)
    loop, scheduler, runner = llm._loop, llm._scheduler, llm._runner
    while len(scheduler.running) < args.num_seqs or any(s.num_computed_tokens < s.num_prompt_tokens
                                                         for s in scheduler.running):
        loop.step()

    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "prepare", "execute", "wait", "postprocess")}
    profiler = cProfile.Profile() if args.profile else None
    for _ in range(args.steps):
        t0 = time.perf_counter()
        if profiler:
            profiler.enable()
        batch = scheduler.schedule()
        t1 = time.perf_counter()
        inputs = runner.prepare(batch)
        t2 = time.perf_counter()
        if profiler:
            profiler.disable()
        assert batch.num_tokens == len(batch) == args.num_seqs  # a pure decode step
        if args.skip_forward:
            t3 = t4 = time.perf_counter()
            tokens = [0] * len(batch)
            runner.persistent.last_sampled = torch.zeros(len(batch), dtype=torch.int64, device=runner.device)
        else:
            handle = runner.execute(inputs)
            t3 = time.perf_counter()
            tokens, _ = runner.wait(handle)
            t4 = time.perf_counter()
        scheduler.postprocess(batch, tokens)
        t5 = time.perf_counter()
        for name, seconds in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            phases[name].append(seconds * 1e3)
    llm.exit()

    summary = {name: {"median_ms": statistics.median(v), "mean_ms": statistics.fmean(v)} for name, v in phases.items()}
    host = [s + p for s, p in zip(phases["schedule"], phases["prepare"])]
    summary["schedule+prepare"] = {"median_ms": statistics.median(host), "mean_ms": statistics.fmean(host)}
    result = {"model": args.model, "device": str(runner.device), "num_seqs": args.num_seqs,
              "skip_forward": args.skip_forward,
              "graphs": runner.graphs is not None, "temperature": args.temperature, "steps": args.steps,
              "phases": summary}
    if args.json:
        print(json.dumps(result))
    else:
        for name, v in summary.items():
            print(f"{name:>18}: median {v['median_ms']:.3f} ms, mean {v['mean_ms']:.3f} ms")
    if profiler:
        for order in ("cumulative", "tottime"):
            pstats.Stats(profiler).sort_stats(order).print_stats(25)


if __name__ == "__main__":
    main()
