"""Data parallelism on one GPU (`scripts/gpu_check.sh dp`): two replicas sharing the GPU at
--gpu-memory-utilization 0.45 each must write the records one engine writes (greedy), and split the rows.

The same rows (half in groups sharing a 2-block prefix, half unique, random token ids of the preset's vocabulary)
run through `nanovllm run` with --data-parallel-size 1, then 2, with the top-5 logprobs of every token. Even in
fp32 the rounding depends on the batch a row lands in (the GEMMs pick other tiles), so with random weights a
greedy choice may flip where two logits nearly tie: a row may differ only where DP=1's own logprobs put DP=2's
token within NEAR_TIE of its choice (fp32; bf16 reports the figures without requiring them). Prints one JSON
object; exits 1 when the check fails.

    CUDA_VISIBLE_DEVICES=0 python scripts/dp_check.py --out dp-check
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEAR_TIE = 1e-3  # fp32 logprob gap: batch-dependent fp32 rounding moves logits by ~1e-5 here


def make_rows(vocab_size: int, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(32)] for _ in range(4)]
    rows = []
    for i in range(count):
        tail = [rng.randrange(vocab_size) for _ in range(rng.randint(8, 200))]
        rows.append({"id": f"r{i}", "prompt_token_ids": (prefixes[i % 4] + tail) if i % 2 else tail, "logprobs": 5})
    return rows


def divergence_gap(one: dict, two: dict) -> float | None:
    """At the first token where DP=2 left DP=1's output (same context up to there): DP=1's logprob of its own
    token minus its logprob of DP=2's, or None when DP=2's token is not in DP=1's top 5 (not a near-tie)."""
    for position, (ours, theirs) in enumerate(zip(one["token_ids"], two["token_ids"])):
        if ours != theirs:
            entry = one["logprobs"][position]
            top = {t["token_id"]: t["logprob"] for t in entry["top_logprobs"]}
            return entry["logprob"] - top[theirs] if theirs in top else None
    return None


def run(path: Path, output: Path, dp: int, engine: list[str]) -> dict:
    nanovllm = shutil.which("nanovllm") or str(Path(sys.executable).parent / "nanovllm")
    command = [nanovllm, "run", str(path), "-o", str(output), "--overwrite", "--json", "-q", "--include-token-ids",
               "--data-parallel-size", str(dp), *engine]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"dp={dp} exited {done.returncode}:\n{done.stderr}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", default="qwen3-0.6b")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((ROOT / "core" / "presets" / f"{args.model}.json").read_text())["vocab_size"]
    path = args.out / "dp_rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in make_rows(vocab, args.rows, 0)))
    engine = ["--model", args.model, "--load-format", "dummy", "--dtype", args.dtype, "--max-tokens",
              str(args.max_tokens), "--ignore-eos", "--gpu-memory-utilization", "0.45"]
    summaries, records = {}, {}
    for dp in (1, 2):
        output = args.out / f"dp_check_dp{dp}.jsonl"
        summaries[dp] = run(path, output, dp, engine)
        records[dp] = {r["id"]: r for r in map(json.loads, output.read_text().splitlines())}
    same = [rid for rid in records[1] if records[1][rid]["token_ids"] == records[2].get(rid, {}).get("token_ids")]
    gaps = [divergence_gap(records[1][rid], records[2][rid]) for rid in records[1]
            if rid not in same and rid in records[2]]
    replicas = summaries[2]["replicas"]
    result = {
        "model": args.model, "dtype": args.dtype, "rows": args.rows, "max_tokens": args.max_tokens,
        "identical_frac": len(same) / len(records[1]),
        "gap_at_divergence": gaps,
        "cached_tokens": {"dp1": summaries[1]["cached_tokens"], "dp2": summaries[2]["cached_tokens"]},
        "elapsed_s": {"dp1": summaries[1]["elapsed_s"], "dp2": summaries[2]["elapsed_s"]},
        "output_tok_s": {"dp1": summaries[1]["output_tok_s"], "dp2": summaries[2]["output_tok_s"]},
        "replicas": [{k: r[k] for k in ("index", "devices", "rows", "cached_tokens", "output_tok_s")}
                     | {"num_kv_blocks": r["kv_cache"]["num_kv_blocks"]} for r in replicas],
        "dp1_num_kv_blocks": summaries[1]["kv_cache"]["num_kv_blocks"],
    }
    problems = []
    if len(records[2]) != len(records[1]) or any(r["error"] for r in records[2].values()):
        problems.append("dp=2 did not answer every row without error")
    if args.dtype == "float32" and any(gap is None or gap > NEAR_TIE for gap in gaps):
        problems.append(f"rows differ between dp=1 and dp=2 beyond a near-tie (gaps {gaps}; at most {NEAR_TIE})")
    if len({tuple(r["devices"] or ()) for r in replicas}) != 1 or not all(r["rows"] for r in replicas):
        problems.append("the two replicas did not share the one GPU, or one got no rows")
    result["problems"] = problems
    print(json.dumps(result))
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
