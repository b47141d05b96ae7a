"""Accuracy of a quantized engine against the unquantized one on real text: perplexity from prompt logprobs, and
greedy divergence with the logit gap where it starts.

    python scripts/quant_accuracy.py --kv-cache-dtype fp8 [--model M] [--text README.md ...] [--json OUT]
    python scripts/quant_accuracy.py --quantization fp8          # passed through to LLM(...) as is

The baseline is `LLM(model, dtype=...)`; the candidate adds the quantization settings. Engines run one after the
other (one in memory at a time). Perplexity: the text, tokenized whole, is cut into windows of --window tokens
scored with prompt_logprobs (each window's first token has no logprob). Greedy: --num-prompts prompts of
--prompt-len tokens from the text, --max-tokens greedy tokens each (EOS ignored) with the top-5 logprobs; at the
first token where the candidate leaves the baseline's output, the context is still identical, so the baseline's
logprob gap between its own token and the candidate's is the logit gap the quantization had to cross (a small gap
is a near-tie; a large one would be a real error). Gaps past the baseline's top 5 are reported as a lower bound.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from nanovllm import LLM, SamplingParams

REPO = Path(__file__).resolve().parent.parent
TOP = 5


def text_tokens(llm: LLM, paths: list[Path]) -> list[int]:
    return llm.tokenize("\n\n".join(path.read_text() for path in paths))


def perplexity(llm: LLM, windows: list[list[int]]) -> tuple[float, list[list[float]]]:
    outputs = llm.generate(windows, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    failed = [out.error for out in outputs if out.error]
    if failed:
        raise RuntimeError(f"{len(failed)} windows failed: {failed[0]}")
    logprobs = [[entry[token].logprob for entry, token in zip(out.prompt_logprobs[1:], window[1:])]
                for out, window in zip(outputs, windows)]
    flat = [lp for window in logprobs for lp in window]
    return math.exp(-sum(flat) / len(flat)), logprobs


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    return llm.generate(prompts, params)


def divergence(base, cand) -> dict | None:
    """Where the candidate's greedy tokens first leave the baseline's, and the baseline's logprob gap there."""
    for index, (ours, theirs) in enumerate(zip(base.token_ids, cand.token_ids)):
        if ours != theirs:
            top = base.logprobs[index]
            floor = min(entry.logprob for entry in top.values())
            known = theirs in top
            gap = top[ours].logprob - (top[theirs].logprob if known else floor)
            return {"index": index, "baseline_gap": gap, "gap_is_lower_bound": not known}
    return None


def evaluate(args, extra: dict) -> tuple[dict, float, list, list]:
    longest = max(args.window + 1, args.prompt_len + args.max_tokens)
    engine_args = {"dtype": args.dtype, "max_model_len": longest, **extra}
    if args.device:
        engine_args["device"] = args.device
    with LLM(args.model, **engine_args) as llm:
        tokens = text_tokens(llm, args.text)
        windows = [tokens[start:start + args.window] for start in range(0, len(tokens) - args.window + 1, args.window)]
        windows = windows[:args.max_windows] or [tokens[:args.window]]
        ppl, logprobs = perplexity(llm, windows)
        step = max((len(tokens) - args.prompt_len) // args.num_prompts, 1)
        prompts = [tokens[i * step:i * step + args.prompt_len] for i in range(args.num_prompts)]
        outputs = greedy(llm, prompts, args.max_tokens)
        info = llm.info
        summary = {"engine_args": engine_args, "kv_cache_dtype": info.kv_cache_dtype, "dtype": info.dtype,
                   "kv_block_bytes": info.kv_block_bytes, "num_kv_blocks": info.num_kv_blocks,
                   "attention_backend": info.attention_backend, "device": info.device}
    return summary, ppl, logprobs, outputs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="Default: the embedded SmolLM2-135M-Instruct.")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default=None)
    parser.add_argument("--kv-cache-dtype", default="auto", help="The candidate's kv_cache_dtype.")
    parser.add_argument("--quantization", default=None, help="The candidate's quantization engine argument.")
    parser.add_argument("--text", type=Path, nargs="+",
                        default=[REPO / "README.md", REPO / "docs" / "ARCHITECTURE.md"])
    parser.add_argument("--window", type=int, default=1024, help="Tokens per perplexity window.")
    parser.add_argument("--max-windows", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="Also write the report here.")
    args = parser.parse_args()
    candidate_args = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.quantization is not None:
        candidate_args["quantization"] = args.quantization
    if candidate_args == {"kv_cache_dtype": "auto"}:
        parser.error("nothing to compare: give --kv-cache-dtype and/or --quantization")

    base, base_ppl, base_lp, base_out = evaluate(args, {})
    cand, cand_ppl, cand_lp, cand_out = evaluate(args, candidate_args)
    diffs = [abs(a - b) for x, y in zip(base_lp, cand_lp) for a, b in zip(x, y)]
    points = [divergence(b, c) for b, c in zip(base_out, cand_out)]
    diverged = [p for p in points if p is not None]
    gaps = [p["baseline_gap"] for p in diverged]
    report = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded)",
        "text": [str(path) for path in args.text],
        "baseline": base, "candidate": cand,
        "perplexity": {"tokens_scored": len(diffs), "baseline": base_ppl, "candidate": cand_ppl,
                       "ratio": cand_ppl / base_ppl},
        "prompt_logprob_abs_diff": {"mean": statistics.fmean(diffs), "max": max(diffs)},
        "greedy": {"prompts": len(points), "tokens_each": args.max_tokens,
                   "identical": len(points) - len(diverged),
                   "first_divergence": [p and p["index"] for p in points],
                   "baseline_gap_at_divergence": {"median": statistics.median(gaps) if gaps else None,
                                                  "max": max(gaps) if gaps else None,
                                                  "each": [round(g, 4) for g in gaps],
                                                  "lower_bounds": sum(p["gap_is_lower_bound"] for p in diverged)}},
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
