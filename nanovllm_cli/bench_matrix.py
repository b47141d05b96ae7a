"""`bench --sampling-matrix` and `bench --structured-matrix`: many settings on one engine, each against its baseline
in the same round, in interleaved rounds (every setting once per round), so that a drift of the machine or of the
engine's state touches every setting alike.

Sampling: greedy is the baseline of each round and loop; every setting runs the same rows (`n=4`: every fourth
row, four completions each, so as many sequences). Structured outputs: each constraint kind runs its rows
constrained, then the same rows unconstrained with each row's constrained output length (EOS ignored), in the
sync and the async loop. A setting's ratio is the median over rounds of (its output tok/s / its baseline's); the
report names the smallest."""
from __future__ import annotations

import random
import statistics
from collections import defaultdict

from nanovllm_cli.bench_workload import Workload, run_workload, structured_pair, warmup_workload

BASELINE = "greedy"
# The sampling matrix's settings (SamplingParams fields), the baseline first; logit_bias64's ids depend on the
# vocabulary (`sampling_settings`).
SAMPLING_SETTINGS = {
    BASELINE: {"temperature": 0.0},
    "T0.8 top-p0.95 top-k50": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
    "T1.0 min-p0.05 rep1.1": {"temperature": 1.0, "min_p": 0.05, "repetition_penalty": 1.1},
    "T0.7 top-p0.9": {"temperature": 0.7, "top_p": 0.9},
    "greedy logprobs5": {"temperature": 0.0, "logprobs": 5},
    "top-p0.9": {"temperature": 1.0, "top_p": 0.9},
    "T0.8": {"temperature": 0.8},
    "presence0.5 frequency0.5": {"temperature": 1.0, "presence_penalty": 0.5, "frequency_penalty": 0.5},
    "logit_bias64": {"temperature": 1.0},
    "n4": {"temperature": 1.0, "n": 4},
}
SAMPLING_NAMES = tuple(SAMPLING_SETTINGS)[1:]
CONSTRAINT_KINDS = ("choice", "regex", "json_object", "small_schema", "large_schema", "ebnf", "per_row_schemas")


def sampling_settings(vocab_size: int, seed: int) -> dict[str, dict]:
    """SAMPLING_SETTINGS for a vocabulary. logit_bias64: 64 token ids spread over it, half banned (-100), half
    favoured (+2), as a job that steers its labels would."""
    settings = {name: dict(params) for name, params in SAMPLING_SETTINGS.items()}
    bias_ids = random.Random(seed).sample(range(vocab_size), min(64, vocab_size))
    settings["logit_bias64"]["logit_bias"] = {t: (-100.0 if i % 2 else 2.0) for i, t in enumerate(bias_ids)}
    return settings


def matrix_settings(sampling: bool, structured: bool, only: str | None) -> tuple[str, ...]:
    """The settings a matrix runs: `only` (comma-separated names) or all of them. ValueError naming the choices."""
    if only is None:
        return CONSTRAINT_KINDS if structured else SAMPLING_NAMES
    if not (sampling or structured):
        raise ValueError("--matrix-only needs --sampling-matrix or --structured-matrix")
    known = CONSTRAINT_KINDS if structured else SAMPLING_NAMES
    names = tuple(name.strip() for name in only.split(","))
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--matrix-only: unknown {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    return names


# A record-extraction schema: nesting, string patterns and lengths, enums, integer and number bounds, arrays.
LARGE_SCHEMA = {
    "type": "object",
    "properties": {
        "full_name": {"type": "string", "minLength": 1, "maxLength": 60},
        "email": {"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9-]+\\.[a-z]{2,6}$"},
        "age": {"type": "integer", "minimum": 16, "maximum": 100},
        "seniority": {"enum": ["intern", "junior", "mid", "senior", "principal"]},
        "years_experience": {"type": "number", "minimum": 0, "maximum": 60},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 8},
        "employer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "industry": {"enum": ["software", "finance", "health", "education", "retail", "other"]},
            "remote": {"type": "boolean"}}, "required": ["name", "industry"]},
        "location": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 40},
            "country_code": {"type": "string", "pattern": "^[A-Z]{2}$"}}, "required": ["country_code"]},
        "summary": {"type": "string", "maxLength": 200},
    },
    "required": ["full_name", "seniority", "skills", "employer"],
}
SMALL_SCHEMA = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 20},
                                                 "score": {"type": "integer"}},
                "required": ["label", "score"], "additionalProperties": False}
EBNF = """root ::= "Answer: " verdict " because " word (" " word){0,7} "."
verdict ::= "yes" | "no" | "maybe"
word ::= [a-z]{1,10}
"""
def row_schema(row: int, salt: int) -> dict:
    """A small schema of its own for each row (and round: `salt`), so each one is compiled."""
    return {"type": "object", "properties": {f"label_{salt}_{row}": {"type": "string", "maxLength": 20},
                                             "score": {"type": "integer", "minimum": 0, "maximum": 100 + row}},
            "required": [f"label_{salt}_{row}", "score"], "additionalProperties": False}


def constraints(kind: str, num_rows: int, salt: int) -> list:
    """Each row's constraint (StructuredOutputsParams) of the matrix entry `kind`."""
    from nanovllm import StructuredOutputsParams

    if kind == "per_row_schemas":
        return [StructuredOutputsParams(json=row_schema(i, salt)) for i in range(num_rows)]
    one = {"choice": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed", "unknown"]),
           "regex": StructuredOutputsParams(regex=r"\d{4}-\d{2}-\d{2}( [a-z]{1,12}){1,8}"),
           "json_object": StructuredOutputsParams(json_object=True),
           "small_schema": StructuredOutputsParams(json=SMALL_SCHEMA),
           "large_schema": StructuredOutputsParams(json=LARGE_SCHEMA),
           "ebnf": StructuredOutputsParams(grammar=EBNF)}[kind]
    return [one] * num_rows


def ratio_table(cells: dict[str, dict[str, list[tuple[float, float]]]], details: dict | None = None) -> dict:
    """`cells[loop][setting]`: (output tok/s, its baseline's) per round. Each setting's per-round values and
    ratios, the median ratio, and the smallest median over every loop and setting."""
    loops, worst = {}, None
    for loop, settings in cells.items():
        loops[loop] = {}
        for name, pairs in settings.items():
            ratios = [value / base for value, base in pairs]
            ratio = statistics.median(ratios)
            loops[loop][name] = {"output_tok_s": [v for v, _ in pairs], "baseline_tok_s": [b for _, b in pairs],
                                 "ratios": ratios, "ratio": ratio, **((details or {}).get((loop, name), {}))}
            if worst is None or ratio < worst[0]:
                worst = (ratio, loop, name)
    return {"loops": loops, "min_ratio": worst[0] if worst else None,
            "min_at": {"loop": worst[1], "setting": worst[2]} if worst else None}


def run_sampling_matrix(llm, workload: Workload, loops: list[bool], rounds: int, warmup_seed: int | None,
                        show_progress: bool, names: tuple[str, ...] = SAMPLING_NAMES) -> dict:
    """Greedy and the settings `names` of `sampling_settings` on `workload`, in interleaved rounds, in each loop
    of `loops` (False: sync, True: async)."""
    every = sampling_settings(llm.info.vocab_size, 0)
    settings = {name: every[name] for name in (BASELINE, *names)}
    rows = {name: workload.every(params.get("n", 1)) for name, params in settings.items()}
    if warmup_seed is not None:
        for overlap in loops:
            llm.set_async_scheduling(overlap)
            for params in settings.values():
                run_workload(llm, warmup_workload(llm, warmup_seed), "warm-up", False, params)
    measured: dict[str, dict[str, list[float]]] = {_loop(o): {name: [] for name in settings} for o in loops}
    for round_index in range(rounds):
        for overlap in loops:
            llm.set_async_scheduling(overlap)
            for name, params in settings.items():
                label = f"round {round_index + 1} {_loop(overlap)} {name}"
                stats, _ = run_workload(llm, rows[name], label, show_progress, params)
                measured[_loop(overlap)][name].append(stats["output_tok_s"])
    cells = {loop: {name: list(zip(values, by_name[BASELINE])) for name, values in by_name.items() if name != BASELINE}
             for loop, by_name in measured.items()}
    report = ratio_table(cells)
    report["baseline"] = BASELINE
    report["settings"] = {name: {k: v if k != "logit_bias" else f"{len(v)} token ids" for k, v in params.items()}
                          for name, params in settings.items()}
    return report


def run_structured_matrix(llm, workload: Workload, sampling: dict, rounds: int, warmup_seed: int | None,
                          show_progress: bool, kinds: tuple[str, ...] = CONSTRAINT_KINDS) -> dict:
    """Each of `kinds` (CONSTRAINT_KINDS) against unconstrained at equal lengths, in the sync and the async loop, in
    interleaved rounds. The first round includes each kind's first compile (and the engine's first constrained
    request); later rounds find one-schema kinds compiled, while per-row schemas are new every round."""
    loops = [False, True]
    if warmup_seed is not None:
        for overlap in loops:
            llm.set_async_scheduling(overlap)
            run_workload(llm, warmup_workload(llm, warmup_seed), "warm-up", False, sampling)
    cells = {_loop(o): {kind: [] for kind in kinds} for o in loops}
    details = {}
    for round_index in range(rounds):
        for overlap in loops:
            llm.set_async_scheduling(overlap)
            for kind in kinds:
                salt = 2 * round_index + overlap  # per-row schemas: new ones in every run
                pair = structured_pair(llm, workload, sampling, constraints(kind, len(workload.prompts), salt),
                                       f"round {round_index + 1} {_loop(overlap)} {kind}", show_progress)
                constrained, free = pair["structured"], pair["unstructured"]
                cells[_loop(overlap)][kind].append((constrained["output_tok_s"], free["output_tok_s"]))
                entry = details.setdefault((_loop(overlap), kind), defaultdict(list))  # per round, constrained
                entry["wall_s"].append(constrained["wall_s"])
                entry["baseline_wall_s"].append(free["wall_s"])
                entry["mean_output_tokens"].append(constrained["output_tokens"] / max(constrained["requests"], 1))
                entry["rows_complete"].append(constrained["rows_complete"])
                entry["rows_failed"].append(constrained["rows_failed"])
    return {**ratio_table(cells, details), "kinds": list(kinds)}


def _loop(overlap: bool) -> str:
    return "async" if overlap else "sync"


def print_matrix(title: str, matrix: dict, console) -> None:
    from rich.table import Table

    loops = matrix["loops"]
    table = Table(title=title)
    table.add_column("setting")
    for loop in loops:
        table.add_column(f"{loop} ratio (rounds)", justify="right")
        table.add_column(f"{loop} tok/s (baseline)", justify="right")
    names = list(next(iter(loops.values())))
    for name in names:
        cells = []
        for entries in loops.values():
            cell = entries[name]
            per_round = f" ({' / '.join(f'{r:.3f}' for r in cell['ratios'])})" if len(cell["ratios"]) > 1 else ""
            cells += [f"{cell['ratio']:.3f}{per_round}",
                      f"{statistics.median(cell['output_tok_s']):,.0f} ({statistics.median(cell['baseline_tok_s']):,.0f})"]
        table.add_row(name, *cells)
    console.print(table)
    worst = matrix["min_at"]
    console.print(f"minimum ratio (median over rounds): {matrix['min_ratio']:.3f} — {worst['loop']}, {worst['setting']}")
