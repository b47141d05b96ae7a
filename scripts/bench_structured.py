"""Structured-output costs per step and per constraint (JSON lines; GPU for the device part, runs on the CPU too).

- compile: the sample schema compiled cold (a fresh cache) and cached (the same key again), and the one-off
  TokenizerInfo build;
- fill: the host filling the bitmask of `--rows` rows of that schema, each advanced to a different place in it,
  through BatchBitmask (xgrammar's threads), alone and with the copy to the device;
- accept: the host advancing those rows by one token each (what postprocess adds per step);
- apply: the mask kernel on [rows, --vocab-size] bf16 logits (all rows constrained, and half of them), against
  the torch path and xgrammar's own apply, timed with CUDA events.

    python scripts/bench_structured.py --output $OUT/bench_structured.jsonl
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from nanovllm.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton, bitmask_width
from nanovllm.loaders.resolve import resolve_model
from nanovllm.structured import BatchBitmask, GrammarCompileCache, RowGrammar, StructuredOutputsParams
from nanovllm_cli.roofline import median_cuda_ms

ROOT = Path(__file__).resolve().parent.parent


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None, help="model whose tokenizer to use (default: the embedded SmolLM2)")
    parser.add_argument("--vocab-size", type=int, default=151_936, help="the model's logits width (Qwen3: 151,936)")
    parser.add_argument("--schema", default=str(ROOT / "samples" / "extraction_schema.json"))
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-advance", type=int, default=60, help="rows are advanced 0..this many tokens")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--output", default=None, help="JSON lines file (default: $OUT/bench_structured.jsonl, else stdout)")
    return parser.parse_args()


def emit(out, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def summary(times_ms: list[float]) -> dict:
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms)}


def host_ms(fn, repeats: int) -> dict:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return summary(times)


def advance_rows(rows: list[RowGrammar], vocab_size: int, max_advance: int, seed: int = 0) -> list[int]:
    """Walk each row a random number of tokens along random allowed non-stop tokens, so that the rows sit at
    different places of the schema (keys, strings, numbers, nested objects); the tokens each took."""
    rng = random.Random(seed)
    mask = torch.empty(1, bitmask_width(vocab_size), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    taken = []
    for row in rows:
        steps = rng.randint(0, max_advance)
        for _ in range(steps):
            row.fill_bitmask(mask, 0)
            allowed = ((mask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab_size].nonzero().flatten().tolist()
            allowed = [t for t in allowed if t not in row.stop_token_ids]
            if not allowed:
                break
            assert row.accept(rng.choice(allowed))
        taken.append(row.num_accepted)
    return taken


def main() -> None:
    args = parse_args()
    output = args.output or (os.path.join(os.environ["OUT"], "bench_structured.jsonl") if "OUT" in os.environ else None)
    out = open(output, "w") if output else sys.stdout
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = resolve_model(args.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.tokenizer_dir))
    schema = json.loads(Path(args.schema).read_text())
    params = StructuredOutputsParams(json=schema)
    common = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "tokenizer": resolved.name,
              "tokenizer_vocab": len(tokenizer), "vocab_size": args.vocab_size, "schema": Path(args.schema).name,
              "xgrammar": importlib.metadata.version("xgrammar")}

    start = time.perf_counter()
    cache = GrammarCompileCache(tokenizer, args.vocab_size)
    tokenizer_info_s = time.perf_counter() - start
    start = time.perf_counter()
    compiled = cache.request(params).result()
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    assert cache.request(params).result() is compiled
    cached_s = time.perf_counter() - start
    emit(out, {**common, "bench": "compile", "tokenizer_info_s": tokenizer_info_s, "cold_s": cold_s,
               "cached_s": cached_s, "num_compiles": cache.num_compiles})

    rows = [compiled.new_row([tokenizer.eos_token_id]) for _ in range(args.rows)]
    mask_vocab = cache.mask_vocab_size  # what the host side works over: the tokenizer's ids
    common["mask_vocab_size"] = mask_vocab
    advanced = advance_rows(rows, mask_vocab, args.max_advance)
    for threads in ("auto", 1):
        emit(out, {**common, "bench": "fill", "rows": args.rows, "fill_threads": threads,
                   "tokens_advanced_mean": statistics.mean(advanced),
                   **bench_fill(rows, mask_vocab, device, threads, args.repeats)})
    emit(out, {**common, "bench": "accept", "rows": args.rows, **bench_accept(rows, mask_vocab, args.repeats)})
    cache.shutdown()
    if device.type == "cuda":
        for constrained in (args.rows, args.rows // 2):
            emit(out, {**common, "bench": "apply", "rows": args.rows, "constrained_rows": constrained,
                       **bench_apply(args.rows, constrained, args.vocab_size, args.repeats)})


def bench_fill(rows: list[RowGrammar], mask_vocab: int, device: torch.device, threads: int | str,
               repeats: int) -> dict:
    bitmask = BatchBitmask(len(rows), mask_vocab, device, fill_threads=threads)
    host_mask = torch.empty(len(rows), bitmask_width(mask_vocab), dtype=torch.int32)
    host_rows = torch.empty(len(rows), dtype=torch.int64)
    logits_rows = list(range(len(rows)))
    fill = host_ms(lambda: bitmask.fill_host(rows, logits_rows, host_mask, host_rows), repeats)
    prepare = host_ms(lambda: bitmask.prepare(rows, logits_rows), repeats)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"fill_host": fill, "prepare_with_copy": prepare}


def bench_accept(rows: list[RowGrammar], vocab_size: int, repeats: int) -> dict:
    """Host ms of accepting one allowed token in every row (as postprocess does each step), rolled back after."""
    mask = torch.empty(1, bitmask_width(vocab_size), dtype=torch.int32)
    shifts = torch.arange(32, dtype=torch.int32)
    pairs = []
    for row in rows:
        row.fill_bitmask(mask, 0)
        allowed = ((mask[0].unsqueeze(-1) >> shifts) & 1).flatten()[:vocab_size].nonzero().flatten().tolist()
        token = next((t for t in allowed if t not in row.stop_token_ids), None)
        if token is not None:  # a finished object allows only stop tokens: such a row is left out
            pairs.append((row, token))
    rows = [row for row, _ in pairs]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for row, token in pairs:
            row.accept(token)
        times.append((time.perf_counter() - start) * 1000)
        for row in rows:
            row.rollback(1)
    return {"rows_accepting": len(rows), "accept_all_rows": summary(times)}


def bench_apply(num_rows: int, constrained: int, vocab_size: int, repeats: int) -> dict:
    """Device ms of masking `constrained` of `num_rows` bf16 logits rows: our kernel, the torch path, xgrammar."""
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(num_rows, vocab_size, device=device, generator=gen).to(torch.bfloat16)
    masks = torch.randint(-2**31, 2**31 - 1, (constrained, bitmask_width(vocab_size)), device=device,
                          generator=gen, dtype=torch.int64).to(torch.int32)
    row_indices = torch.arange(0, num_rows, num_rows // constrained, device=device)[:constrained]
    full = torch.full((num_rows, masks.shape[1]), -1, dtype=torch.int32, device=device)  # xgrammar's layout
    full[row_indices] = masks
    indices = row_indices.tolist()
    return {
        "triton_ms": median_cuda_ms(lambda: apply_token_bitmask_triton(logits, masks, row_indices), repeats),
        "torch_ms": median_cuda_ms(lambda: apply_token_bitmask_torch(logits, masks, row_indices), repeats),
        "xgrammar_ms": median_cuda_ms(
            lambda: xgr.apply_token_bitmask_inplace(logits, full, vocab_size=vocab_size, indices=indices), repeats),
        "logits_bytes_per_row": vocab_size * logits.element_size(),
    }

if __name__ == "__main__":
    main()
