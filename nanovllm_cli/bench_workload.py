"""The rows `nanovllm bench` measures and how they run: random token ids whose prompt and output lengths follow a
distribution, the ShareGPT-like preset, a `run` input file, the warm-up; a run of them on an engine, and a
constrained run against an unconstrained one of the same lengths.

A length distribution is written `KIND:ARGS[:MIN,MAX]`: `uniform:LO,HI` (integers, inclusive), `lognormal:MEDIAN,SIGMA`
(the natural log of the length is normal with mean ln MEDIAN and standard deviation SIGMA) or `fixed:N`; every draw
is rounded and clipped to [MIN, MAX] (default [1, no limit]; an empty MAX: no limit)."""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

KINDS = {"uniform": ("LO", "HI"), "lognormal": ("MEDIAN", "SIGMA"), "fixed": ("N",)}
SPEC_HELP = "uniform:LO,HI | lognormal:MEDIAN,SIGMA | fixed:N, optionally clipped with :MIN,MAX"


@dataclass(frozen=True)
class LengthDistribution:
    kind: str  # a key of KINDS
    params: tuple[float, ...]  # KINDS[kind]'s values
    lo: int = 1  # every draw is clipped to [lo, hi]
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown length distribution {self.kind!r}: use {SPEC_HELP}")
        if len(self.params) != len(KINDS[self.kind]):
            raise ValueError(f"{self.kind} takes {','.join(KINDS[self.kind])}, got {len(self.params)} value(s)")
        if not (isinstance(self.lo, int) and self.lo >= 1 and (self.hi is None or self.hi >= self.lo)):
            raise ValueError(f"clip [{self.lo}, {self.hi}]: needs 1 <= MIN <= MAX")
        if self.kind == "uniform" and not (all(float(v).is_integer() for v in self.params)
                                           and 1 <= self.params[0] <= self.params[1]):
            raise ValueError(f"uniform:{self.spec_args}: needs integers 1 <= LO <= HI")
        if self.kind == "lognormal" and not (self.params[0] > 0 and self.params[1] >= 0):
            raise ValueError(f"lognormal:{self.spec_args}: needs MEDIAN > 0 and SIGMA >= 0")
        if self.kind == "fixed" and not (float(self.params[0]).is_integer() and self.params[0] >= 1):
            raise ValueError(f"fixed:{self.spec_args}: needs an integer N >= 1")

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        """From `KIND:ARGS[:MIN,MAX]` (see the module); ValueError saying the expected form."""
        parts = text.strip().split(":")
        if len(parts) not in (2, 3) or parts[0] not in KINDS:
            raise ValueError(f"{text!r} is not a length distribution: use {SPEC_HELP} "
                             "(e.g. lognormal:150,0.9:4,1024)")
        try:
            params = tuple(float(v) for v in parts[1].split(","))
            clip = parts[2].split(",") if len(parts) == 3 else ["1", ""]
            lo, hi = int(clip[0]), int(clip[1]) if clip[1] else None  # an empty MAX: no upper bound
        except (ValueError, IndexError):
            raise ValueError(f"{text!r}: use {SPEC_HELP}, numbers for ARGS and integers for MIN,MAX") from None
        if len(clip) != 2:
            raise ValueError(f"{text!r}: the clip is :MIN,MAX")
        return cls(parts[0], params, lo, hi)

    @property
    def spec_args(self) -> str:
        return ",".join(f"{v:g}" for v in self.params)

    @property
    def spec(self) -> str:
        """The `KIND:ARGS[:MIN,MAX]` text that parses back to this distribution."""
        clip = "" if (self.lo, self.hi) == (1, None) else f":{self.lo},{'' if self.hi is None else self.hi}"
        return f"{self.kind}:{self.spec_args}{clip}"

    def draw(self, rng: random.Random) -> int:
        if self.kind == "uniform":
            value = rng.randint(int(self.params[0]), int(self.params[1]))
        elif self.kind == "lognormal":
            value = int(rng.lognormvariate(math.log(self.params[0]), self.params[1]) + 0.5)
        else:
            value = int(self.params[0])
        return max(self.lo, value if self.hi is None else min(value, self.hi))

    def sample(self, n: int, seed: int) -> list[int]:
        rng = random.Random(seed)
        return [self.draw(rng) for _ in range(n)]


def uniform(lo: int, hi: int) -> LengthDistribution:
    return LengthDistribution("uniform", (lo, hi))


DEFAULT_LENGTHS = uniform(100, 1024)
# ShareGPT-like: lognormal, median 150, sigma 0.9, clipped to [4, 1024] (the filter that vLLM's ShareGPT loader
# applies). Sigma 0.9 gives a mean of ~217 tokens per row after the clip, between the per-row means of vLLM's
# 1,000-row ShareGPT sample on Llama-3.1's tokenizer (~230 prompt, ~203 output tokens), a 10th-90th percentile
# range of ~47-474, and ~1.6 % of rows at the 1,024 cap.
SHAREGPT_LIKE = LengthDistribution("lognormal", (150, 0.9), 4, 1024)
DATASETS = {"random": (DEFAULT_LENGTHS, 256), "sharegpt": (SHAREGPT_LIKE, 1000)}  # lengths of both sides, rows


def lengths_from_options(side: str, length: int | None, range_ratio: float, length_range: tuple[int, int] | None,
                         dist: str | None, default: LengthDistribution) -> LengthDistribution:
    """One side's lengths (side: "input" or "output") from whichever form the options give: `--{side}-len N`
    (vLLM's: N, or uniform in [N (1 - R), N (1 + R)] with --random-range-ratio R), `--{side}-len-range LO HI`,
    `--{side}-dist SPEC`, else `default`. ValueError naming the options when more than one is given."""
    given = [name for name, value in ((f"--{side}-len", length), (f"--{side}-len-range", length_range),
                                      (f"--{side}-dist", dist)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} both set the {side} lengths: keep one")
    if length is not None:
        if length < 1:
            raise ValueError(f"--{side}-len must be at least 1, not {length}")
        if range_ratio == 0:
            return LengthDistribution("fixed", (length,))
        return uniform(max(1, int(length * (1 - range_ratio))), int(length * (1 + range_ratio)))
    if length_range is not None:
        lo, hi = length_range
        if not 1 <= lo <= hi:
            raise ValueError(f"--{side}-len-range needs 1 <= LO <= HI, got {lo} {hi}")
        return uniform(lo, hi)
    if dist is not None:
        try:
            return LengthDistribution.parse(dist)
        except ValueError as exc:
            raise ValueError(f"--{side}-dist {exc}") from None
    return default


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]

    def every(self, step: int) -> Workload:
        """Every `step`-th row (a subsample of the same distribution)."""
        return Workload(self.prompts[::step], self.output_lens[::step])


def as_distribution(lengths: LengthDistribution | tuple[int, int]) -> LengthDistribution:
    return lengths if isinstance(lengths, LengthDistribution) else uniform(*lengths)


def synthetic_workload(num_seqs: int, input_lengths: LengthDistribution | tuple[int, int],
                       output_lengths: LengthDistribution | tuple[int, int], vocab_size: int, seed: int) -> Workload:
    """Random token ids (no prefix-cache hits) with lengths drawn from the distributions (a (LO, HI) pair:
    uniform, inclusive). One generator draws each prompt's length then its ids, then every output length: a
    uniform workload of a seed is the same rows as bench has always drawn. How many draws an id takes depends on
    `vocab_size`, so two vocabularies draw different rows (`save_workload` + `--dataset` replay one set)."""
    rng = random.Random(seed)
    inputs, outputs = as_distribution(input_lengths), as_distribution(output_lengths)
    prompts = [[rng.randrange(vocab_size) for _ in range(inputs.draw(rng))] for _ in range(num_seqs)]
    return Workload(prompts, [outputs.draw(rng) for _ in range(num_seqs)])


def dataset_workload(llm, path: Path, max_tokens: int) -> Workload:
    """The prompts of a `run` input file, tokenized as `run` does; each row's max_tokens or the default."""
    from nanovllm_cli.readers import detect_format
    from nanovllm_cli.rows import RowParser, RowRequest
    from nanovllm_cli.tokenize import tokenized_rows

    fmt = detect_format(path, None)
    parser = RowParser({"max_tokens": max_tokens}, 0, "row" if fmt == "parquet" else "line")
    prompts, output_lens = [], []
    for row in tokenized_rows(path, fmt, parser, llm.prompts):
        if isinstance(row, RowRequest):
            prompts.append(row.token_ids)
            output_lens.append(row.params.max_tokens)
    if not prompts:
        raise ValueError(f"{path} has no valid rows")
    return Workload(prompts, output_lens)


def save_workload(workload: Workload, path: Path) -> None:
    """The workload as a `run` input file (token ids and max_tokens per row), which `bench --dataset` (of this
    version or an older one) replays row for row."""
    with open(path, "w") as out:
        for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens)):
            out.write(json.dumps({"id": str(i), "prompt_token_ids": prompt, "max_tokens": max_tokens}) + "\n")


def warmup_workload(llm, seed: int) -> Workload:
    """A full batch of short prompts (whole prefill chunks) whose decode steps pass every CUDA graph size once,
    largest first: first-use costs (a graph's first launch, Triton compiling a kernel variant) must not land in
    whichever loop is measured first."""
    sizes = list(llm.info.decode_batch_sizes)
    # Requests of output length n decode n - 1 times; at decode step d exactly sizes[-d] of them are running.
    output_lens = [len(sizes) + 1 - i for i, size in enumerate(sizes) for _ in range(size - ([0] + sizes)[i])]
    prompts = synthetic_workload(len(output_lens), (16, 64), (1, 1), llm.info.vocab_size, seed + 1).prompts
    return Workload(prompts, output_lens)


def run_workload(llm, workload: Workload, label: str, show_progress: bool,
                 sampling: dict | list[dict] | None = None, lora_requests: list | None = None) -> tuple[dict, list]:
    """Every request of `workload` (EOS ignored) with the `sampling` settings (SamplingParams fields, a
    structured-output constraint included; one dict for every row or a list of one per row; greedy by default),
    each row on the LoRA adapter `lora_requests` gives it (None: the base model). Returns the engine's step stats
    with the batch's occupancy at the engine's max_num_seqs, and the outputs in workload order."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from nanovllm import SamplingParams

    llm.reset_prefix_cache()
    llm.reset_stats()
    per_row = sampling if isinstance(sampling, list) else [sampling or {}] * len(workload.prompts)
    adapters = [{"lora_request": r} for r in lora_requests] if lora_requests else [{}] * len(workload.prompts)
    request_ids = [llm.add_request(prompt, SamplingParams(**{"temperature": 0, **settings}, max_tokens=max_tokens,
                                                          ignore_eos=True), **adapter)
                   for prompt, max_tokens, settings, adapter in zip(workload.prompts, workload.output_lens, per_row,
                                                                    adapters)]
    outputs = {}
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not show_progress, transient=True) as progress:
        task = progress.add_task(label, total=len(workload.prompts))
        while llm.has_unfinished_requests():
            finished = llm.step()
            outputs.update((out.request_id, out) for out in finished)
            progress.advance(task, len(finished))
    stats = llm.report()["steps"]
    stats.update(llm.stats.occupancy(llm.info.max_num_seqs))
    return stats, [outputs[r] for r in request_ids]


def structured_pair(llm, workload: Workload, sampling: dict, structured, label: str, show_progress: bool) -> dict:
    """The workload constrained by `structured` (one StructuredOutputsParams for every row, or a list of one per
    row), then the same prompts unconstrained with each request's output length as the constrained run gave it
    (EOS ignored): the same tokens, so the throughputs compare like for like."""
    per_row = structured if isinstance(structured, list) else [structured] * len(workload.prompts)
    stats, outputs = run_workload(llm, workload, f"{label} structured", show_progress,
                                  [{**sampling, "structured_outputs": c} for c in per_row])
    stats["rows_complete"] = sum(bool(out.structured_complete) for out in outputs)
    stats["rows_failed"] = sum(out.finish_reason == "error" for out in outputs)
    same_lengths = Workload(workload.prompts, [max(len(out.token_ids), 1) for out in outputs])
    unstructured, _ = run_workload(llm, same_lengths, f"{label} unstructured", show_progress, sampling)
    return {"structured": stats, "unstructured": unstructured,
            "structured_over_unstructured": stats["output_tok_s"] / unstructured["output_tok_s"]}
