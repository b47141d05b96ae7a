"""Data parallelism on one host, end to end: job time (start-up included) of `nanovllm run` at DP=1 and DP=N on a
uniform and a ShareGPT-like workload, the start-up of N replicas against one engine's (after a warm-up job, so
compile caches are warm for both), DP=N/2 x TP=2, and a job whose busiest replica is killed mid-job (it must
finish, every row once; its job time and throughput against the clean run's).

Rows are random token ids (no download, no tokenizer work) with `max_tokens` per row and EOS ignored, so every
run generates the same tokens. Each run is a `nanovllm run` process: its wall clock is the job time with start-up;
its `--json` summary gives the job's own clock (`elapsed_s`, from the first replica ready), output tok/s and each
replica's start; start-up = wall - elapsed. Writes OUT/dp_scale.json (and each run's summary, metrics and stderr
under OUT; rows and records under --work) and prints it.

    python scripts/dp_scale.py --out "$OUT"                    # 4 GPUs, qwen3-0.6b (dummy weights), 8,000 rows
    python scripts/dp_scale.py --out /tmp/dp --device cpu --model tiny-qwen3 --gpus 2 --rows 300 --max-tokens 24 \
        --sharegpt-cap 24
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from nanovllm_cli.bench_workload import SHAREGPT_LIKE, synthetic_workload, uniform  # noqa: E402


def write_rows(path: Path, workload: str, rows: int, vocab: int, max_tokens: int | None) -> Path:
    """uniform: prompts of 100-512 tokens, outputs of `max_tokens`; sharegpt: both sides ShareGPT-like, outputs
    capped at `max_tokens`."""
    if workload == "uniform":
        work = synthetic_workload(rows, uniform(100, 512), uniform(max_tokens, max_tokens), vocab, seed=0)
    else:
        work = synthetic_workload(rows, SHAREGPT_LIKE, SHAREGPT_LIKE, vocab, seed=0)
    with open(path, "w") as f:
        for i, (prompt, out) in enumerate(zip(work.prompts, work.output_lens)):
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": prompt, "max_tokens": min(out, max_tokens),
                                "ignore_eos": True}) + "\n")
    return path


def run(out: Path, work: Path, label: str, rows: Path, engine: list[str], dp: int, tp: int,
        kill_at: float | None = None, limit_s: float | None = None) -> dict:
    """One `nanovllm run` (records under `work`, the rest under `out`); with `kill_at`, the replica holding the most
    rows is killed (SIGKILL) once that share of the rows is done. A run still going after `limit_s` is killed with
    its replicas and reported as timed out (the report goes on with the other runs)."""
    nanovllm = shutil.which("nanovllm") or str(Path(sys.executable).parent / "nanovllm")
    results, metrics = work / f"{label}.results.jsonl", out / f"{label}.metrics.jsonl"
    command = [nanovllm, "run", str(rows), "-o", str(results), "--overwrite", "--json", "-q", "--window", "4096",
               "--data-parallel-size", str(dp), "--tensor-parallel-size", str(tp), "--metrics-file", str(metrics),
               "--metrics-interval", "0.5", *engine]
    total = sum(1 for _ in open(rows))
    started = time.perf_counter()
    # stdout to a file, not a pipe: nothing reads a pipe while the kill loop polls, and a child writing there
    # (a replica inherits it) would block once its buffer is full
    stdout_path = out / f"{label}.stdout"
    proc = subprocess.Popen(command, stdout=open(stdout_path, "w"), stderr=open(out / f"{label}.stderr", "w"),
                            start_new_session=True)
    killed = None
    while kill_at is not None and killed is None and proc.poll() is None:
        lines = metrics.read_text().splitlines() if metrics.exists() else []
        last = json.loads(lines[-1]) if lines else None
        busy = [r for r in last["replicas"] if r["state"] == "ready" and r["outstanding"]] if last else []
        if last and last["rows_done"] >= kill_at * total and busy:
            victim = max(busy, key=lambda r: r["outstanding"])
            killed = {**victim, "at_s": time.perf_counter() - started, "rows_done": last["rows_done"]}
            os.kill(victim["pid"], signal.SIGKILL)
        time.sleep(0.1)
    try:
        proc.wait(timeout=None if limit_s is None else max(limit_s - (time.perf_counter() - started), 1))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"{label}: timed out after {limit_s:g} s", file=sys.stderr, flush=True)
        return {"label": label, "dp": dp, "tp": tp, "rows": total, "timed_out": limit_s}
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        sys.exit(f"{label} exited {proc.returncode}; see {out / (label + '.stderr')}")
    summary = json.loads(stdout_path.read_text().splitlines()[-1])  # the --json summary is the last line
    (out / f"{label}.summary.json").write_text(json.dumps(summary, indent=1))
    ids = [json.loads(line)["id"] for line in open(results)]
    replicas = summary.get("replicas") or []
    return {"label": label, "dp": dp, "tp": tp, "rows": total, "wall_s": wall, "job_s": summary["elapsed_s"],
            "start_s": wall - summary["elapsed_s"], "output_tok_s": summary["output_tok_s"],
            "completion_tokens": summary["completion_tokens"], "rows_failed": summary["rows_failed"],
            "every_row_once": sorted(ids) == sorted(f"r{i}" for i in range(total)),
            "replica_start_s": [r["start_s"] for r in replicas], "replica_rows": [r["rows"] for r in replicas],
            "retries": summary.get("retries"), "killed": killed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the report, summaries, metrics and logs")
    parser.add_argument("--work", type=Path, default=Path("/tmp/nanovllm-dp-scale"), help="rows and records")
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--gpus", type=int, default=4, help="N: the DP=N runs (and DP=N/2 x TP=2)")
    parser.add_argument("--rows", type=int, default=8000)
    parser.add_argument("--max-tokens", type=int, default=128, help="uniform: every row's output")
    parser.add_argument("--sharegpt-cap", type=int, default=1024, help="sharegpt: the most output tokens of a row")
    parser.add_argument("--device", default=None)
    parser.add_argument("--dp-tp-limit", type=float, default=None, help="seconds before the DP x TP=2 run is killed")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    vocab = json.loads((ROOT / "core" / "presets" / f"{args.model}.json").read_text())["vocab_size"]
    engine = ["--model", args.model, "--load-format", "dummy"] + (["--device", args.device] if args.device else [])
    n = args.gpus
    report: dict = {"model": args.model, "gpus": n, "rows": args.rows, "max_tokens": args.max_tokens, "runs": []}
    # One small job first, so that every measured start finds the compile caches (Triton) warm.
    run(args.out, args.work, "warmup", write_rows(args.work / "warmup.jsonl", "uniform", 32, vocab, 8), engine, 1, 1)
    clean = {}
    for workload in ("uniform", "sharegpt"):
        rows = write_rows(args.work / f"{workload}.jsonl", workload, args.rows, vocab,
                          args.max_tokens if workload == "uniform" else args.sharegpt_cap)
        one = run(args.out, args.work, f"{workload}-dp1", rows, engine, 1, 1)
        many = clean[workload] = run(args.out, args.work, f"{workload}-dp{n}", rows, engine, n, 1)
        report["runs"] += [one, many]
        # start_s: to the first replica ready (the job starts then); all replicas: the parent's part, then the
        # slowest replica's start
        all_ready = many["start_s"] - min(many["replica_start_s"]) + max(many["replica_start_s"])
        report[workload] = {"speedup_job_time": one["wall_s"] / many["wall_s"],
                            "speedup_output_tok_s": many["output_tok_s"] / one["output_tok_s"],
                            "start_ratio": many["start_s"] / one["start_s"],
                            "start_ratio_all_replicas": all_ready / one["start_s"]}
        if workload == "uniform" and n >= 4:
            mixed = run(args.out, args.work, f"{workload}-dp{n // 2}-tp2", rows, engine, n // 2, 2,
                        limit_s=args.dp_tp_limit)
            report["runs"].append(mixed)
            report[workload]["dp_tp_vs_dp"] = (None if "timed_out" in mixed
                                               else mixed["output_tok_s"] / many["output_tok_s"])
        print(json.dumps(report[workload]), file=sys.stderr, flush=True)
    killed = run(args.out, args.work, f"uniform-dp{n}-killed", args.work / "uniform.jsonl", engine, n, 1, kill_at=0.3)
    report["runs"].append(killed)
    report["uniform"]["killed_replica"] = {
        "finished": killed["every_row_once"], "killed": killed["killed"], "retries": killed["retries"],
        "job_time_vs_clean": killed["wall_s"] / clean["uniform"]["wall_s"],
        "throughput_loss": 1 - killed["output_tok_s"] / clean["uniform"]["output_tok_s"]}
    (args.out / "dp_scale.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
