"""Structured-output costs per phase, on the host (and the mask kernel on a GPU); JSON lines. Runs on the CPU.

For each constraint (`--constraints`; the defaults are the kinds of a labelling job: a small and a nested schema,
a regex, any JSON object, a choice; and `bench --structured-matrix`'s EBNF grammar):
- compile: cold (a fresh key), cached (the same key again);
- step: `--rows` rows of it, each walked a random number of tokens along random allowed tokens (so they sit at
  different places: keys, strings, numbers), then one step's host phases as GrammarManager runs them: the
  batched accepts and fills on its worker (`accept_ms`, `fill_ms`), the step loop thread's wait for them plus
  its own fills (`step_mask_ms`), and the whole critical path from the sampled tokens to the mask (`host_ms`),
  with the fill on the default threads and on one;
- rows: a new row's cost (`start_row_us`: matcher creation and the cached compile lookup);
and once: the tokenizer tables (`tokenizer_tables_s`, built in the background from engine start), and
`--distinct` distinct schemas compiled on the pool against one (`distinct_s` / `shared_s`).
On a GPU also `apply`: the mask kernel on [rows, --vocab-size] bf16 logits against the torch path and xgrammar's.

    python scripts/bench_structured.py --output $OUT/bench_structured.jsonl
"""
from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import AutoTokenizer

from nanovllm.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton, bitmask_width
from nanovllm.loaders.resolve import resolve_model
from nanovllm.structured import GrammarCompileCache, GrammarManager, StructuredOutputsParams
from nanovllm.structured.compile_cache import host_cpus
from nanovllm_cli.bench_matrix import EBNF
from nanovllm_cli.roofline import median_cuda_ms

ROOT = Path(__file__).resolve().parent.parent
LABEL = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 20}, "score": {"type": "integer"}},
         "required": ["label", "score"]}
NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9-]+\\.[a-z]{2,6}$"},
        "age": {"type": "integer", "minimum": 16, "maximum": 100},
        "seniority": {"enum": ["intern", "junior", "mid", "senior", "principal"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 6},
        "employer": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 60},
                                                      "remote": {"type": "boolean"}},
                     "required": ["name"]},
        "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"},
    },
    "required": ["name", "age", "seniority", "skills", "employer"],
}
CONSTRAINTS = {
    "label_schema": {"json": LABEL},
    "nested_schema": {"json": NESTED},
    "regex": {"regex": r"\d{4}-\d{2}-\d{2}( [A-Za-z]+){1,8}"},
    "json_object": {"json_object": True},
    "choice": {"choice": ["positive", "negative", "neutral", "mixed", "off-topic"]},
    "ebnf": {"grammar": EBNF},  # bench --structured-matrix's grammar
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", default=None, help="model whose tokenizer to use (default: the embedded SmolLM2)")
    parser.add_argument("--vocab-size", type=int, default=151_936, help="the model's logits width (Qwen3: 151,936)")
    parser.add_argument("--constraints", default=",".join(CONSTRAINTS), help=f"any of {', '.join(CONSTRAINTS)}")
    parser.add_argument("--schema", default=None, help="a JSON schema file to measure as well")
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-advance", type=int, default=40, help="rows are advanced 0..this many tokens")
    parser.add_argument("--distinct", type=int, default=64, help="distinct schemas compiled at once")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--output", default=None, help="JSON lines file (default: $OUT/bench_structured.jsonl, else stdout)")
    return parser.parse_args()


def emit(out, record: dict) -> None:
    out.write(json.dumps(record) + "\n")
    out.flush()


def summary(times_ms: list[float]) -> dict:
    return {"median_ms": statistics.median(times_ms), "min_ms": min(times_ms), "max_ms": max(times_ms)}


class Row:
    """What the manager reads of a sequence."""

    def __init__(self, future):
        self.grammar_future, self.grammar = future, None
        self.params = SimpleNamespace(stop_token_ids=[])
        self.epoch, self.max_len, self.output_token_ids = 0, 10**9, []

    @property
    def num_tokens(self) -> int:
        return len(self.output_token_ids)


def allowed(line: torch.Tensor, vocab: int) -> list[int]:
    shifts = torch.arange(32, dtype=torch.int32)
    return ((line.unsqueeze(-1) >> shifts) & 1).flatten()[:vocab].nonzero().flatten().tolist()


def advance_rows(rows: list[Row], vocab: int, max_advance: int, rng: random.Random) -> None:
    """Walk each row a random number of tokens along random allowed non-stop tokens."""
    mask = torch.empty(1, bitmask_width(vocab), dtype=torch.int32)
    for row in rows:
        grammar = row.grammar
        for _ in range(rng.randint(0, max_advance)):
            grammar.fill_bitmask(mask, 0)
            choices = [t for t in allowed(mask[0], vocab) if t not in grammar.stop_token_ids]
            if not choices:
                break
            assert grammar.accept(rng.choice(choices))


def next_tokens(rows: list[Row], vocab: int, rng: random.Random) -> list[int]:
    """An allowed next token per row (a stop token where nothing else is)."""
    mask = torch.empty(1, bitmask_width(vocab), dtype=torch.int32)
    tokens = []
    for row in rows:
        row.grammar.fill_bitmask(mask, 0)
        choices = allowed(mask[0], vocab)
        tokens.append(rng.choice([t for t in choices if t not in row.grammar.stop_token_ids] or choices))
    return tokens


def bench_step(manager: GrammarManager, rows: list[Row], tokens: list[int], repeats: int) -> dict:
    """One step's host phases: start_accepts (the worker accepts, then fills) -> step_mask, as the loop runs them
    with nothing else to do; each repeat rolls the accepted tokens back."""
    batch = [(i, row, 0) for i, row in enumerate(rows)]
    from nanovllm.structured.manager import StepGrammars

    grammars = StepGrammars(batch)
    manager.step_mask(manager.plan(rows, [True] * len(rows), [0] * len(rows)))  # slots
    host, step_mask = [], []
    times = manager.times
    accept_before, fill_before = times.accept_s, times.fill_s
    for _ in range(repeats):
        started = time.perf_counter()
        manager.start_accepts(grammars, tokens)
        joining = time.perf_counter()
        manager.step_mask(grammars)
        done = time.perf_counter()
        host.append((done - started) * 1000)
        step_mask.append((done - joining) * 1000)
        for row in rows:
            if row.grammar.num_accepted:
                row.grammar.rollback(1)
    return {"host": summary(host), "step_mask": summary(step_mask),
            "accept_ms": (times.accept_s - accept_before) * 1000 / repeats,
            "fill_ms": (times.fill_s - fill_before) * 1000 / repeats}


def main() -> None:
    args = parse_args()
    output = args.output or (os.path.join(os.environ["OUT"], "bench_structured.jsonl") if "OUT" in os.environ else None)
    out = open(output, "w") if output else sys.stdout
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = resolve_model(args.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(str(resolved.tokenizer_dir))
    common = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "cpus": host_cpus(),
              "tokenizer": resolved.name, "vocab_size": args.vocab_size, "rows": args.rows,
              "xgrammar": importlib.metadata.version("xgrammar")}
    constraints = {name: CONSTRAINTS[name] for name in args.constraints.split(",") if name}
    if args.schema:
        constraints[Path(args.schema).name] = {"json": json.loads(Path(args.schema).read_text())}

    started = time.perf_counter()
    cache = GrammarCompileCache(tokenizer, args.vocab_size)
    vocab = cache.mask_vocab_size
    emit(out, {**common, "bench": "tokenizer_tables", "tokenizer_tables_s": time.perf_counter() - started,
               "mask_vocab_size": vocab})
    rng = random.Random(0)
    eos = {tokenizer.eos_token_id}
    for name, fields in constraints.items():
        params = StructuredOutputsParams(**fields)
        started = time.perf_counter()
        cache.request(params).result()
        cold_s = time.perf_counter() - started
        started = time.perf_counter()
        cache.request(params).result()
        cached_s = time.perf_counter() - started
        record = {**common, "bench": "constraint", "constraint": name, "compile_cold_s": cold_s,
                  "compile_cached_ms": cached_s * 1000}
        for threads in (None, 1):
            manager = GrammarManager(cache, eos, args.rows, pin_memory=False, fill_threads=threads)
            started = time.perf_counter()
            rows = [Row(manager.request(params)) for _ in range(args.rows)]
            for row in rows:
                manager.start_row(row)
            if threads is None:
                record["start_row_us"] = (time.perf_counter() - started) * 1e6 / args.rows
                record["fill_threads"] = manager.fill_threads
            advance_rows(rows, vocab, args.max_advance, random.Random(1))
            tokens = next_tokens(rows, vocab, rng)
            record["one_thread" if threads == 1 else "threads"] = bench_step(manager, rows, tokens, args.repeats)
            manager.shutdown()
        emit(out, record)
    emit(out, {**common, "bench": "compile_many", **bench_distinct(tokenizer, args.vocab_size, args.distinct)})
    cache.shutdown()
    if device.type == "cuda":
        for constrained in (args.rows, args.rows // 2):
            emit(out, {**common, "bench": "apply", "constrained_rows": constrained,
                       **bench_apply(args.rows, constrained, args.vocab_size, args.repeats)})


def bench_distinct(tokenizer, vocab_size: int, count: int) -> dict:
    """Wall seconds to compile `count` distinct variants of the label schema on a fresh cache's pool, and one."""
    results = {}
    for label, n in (("shared_s", 1), ("distinct_s", count)):
        cache = GrammarCompileCache(tokenizer, vocab_size)
        cache.vocabulary()
        variants = []
        for i in range(n):
            schema = copy.deepcopy(LABEL)
            schema["properties"][f"extra_{i}"] = {"type": "integer", "minimum": 0, "maximum": i + 1}
            variants.append(StructuredOutputsParams(json=schema))
        started = time.perf_counter()
        futures = [cache.request(p) for p in variants]
        for future in futures:
            future.result()
        results[label] = time.perf_counter() - started
        cache.shutdown()
    return {**results, "distinct": count}


def bench_apply(num_rows: int, constrained: int, vocab_size: int, repeats: int) -> dict:
    """Device ms of masking `constrained` of `num_rows` bf16 logits rows: our kernel, the torch path, xgrammar."""
    import xgrammar as xgr

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
