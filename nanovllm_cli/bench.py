"""`nanovllm bench`: offline throughput of the sync and the async step loop, with an honest time split.

Every figure comes from the engine's step stats (docs/ARCHITECTURE.md): throughput over the wall clock of the steps, device
time from CUDA events, host phases from the host clock, the batch's occupancy and the steps by kind. On a GPU the
run is also set against its roofline: the ideal continuous-batching schedule of the lengths the run produced
(roofline.py). `--rounds N` repeats every run and reports the median and spread; `--sampling-matrix` and
`--structured-matrix` (bench_matrix.py) set many settings against their baselines on one engine."""
from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from nanovllm_cli import options as o
from nanovllm_cli.bench_matrix import CONSTRAINT_KINDS, SAMPLING_NAMES
from nanovllm_cli.bench_workload import (
    DATASETS,
    SPEC_HELP,
    Workload,
    dataset_workload,
    lengths_from_options,
    run_workload,
    save_workload,
    structured_pair,
    synthetic_workload,
    warmup_workload,
)
from nanovllm_cli.options import EngineOptions, ExitCode, with_engine_options

WORKLOAD = "Workload"
SAMPLING = "Sampling"
MODES = "What to measure"
THROUGHPUTS = ("output_tok_s", "total_tok_s", "prefill_tok_s", "roofline_frac")


def prepare_replica(llm, overlap: bool, warmup_seed: int | None, sampling: dict) -> None:
    """In a replica before a measured run: its step loop, the warm-up, then a cold prefix cache and fresh stats."""
    llm.set_async_scheduling(overlap)
    if warmup_seed is not None:
        run_workload(llm, warmup_workload(llm, warmup_seed), "warm-up", False, sampling)
    llm.reset_prefix_cache()
    llm.reset_stats()


def run_on_replicas(pool, workload: Workload, overlap: bool, warmup_seed: int | None, sampling: dict) -> dict:
    """The workload through the replicas (`replicas.ReplicaPool`, dispatched as `run` does), timed by the parent's
    clock from the first dispatch to the last answer. Totals over that wall clock; each replica's own step
    statistics under "replicas"; percentiles and shares only there (they do not add up)."""
    import time

    from nanovllm import SamplingParams
    from nanovllm_cli.admission import admission_groups
    from nanovllm_cli.job import RowFailure
    from nanovllm_cli.rows import RowRequest

    pool.call(prepare_replica, overlap, warmup_seed, sampling)
    settings = {"temperature": 0, **sampling}
    requests = [RowRequest(str(i), f"request {i}", "token_ids", prompt,
                           SamplingParams(**settings, max_tokens=max_tokens, ignore_eos=True), token_ids=prompt)
                for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens))]
    started = time.perf_counter()
    pool.add(admission_groups(requests, True, pool.block_size))
    failed = 0
    while not pool.idle():
        failed += sum(isinstance(r, RowFailure) or bool(r.error) for _, r in pool.step())
    wall = time.perf_counter() - started
    report = pool.report()
    stats, tokens = report["steps"], report["tokens"]
    decode_tokens = tokens["generated"] - stats["requests"]  # a request's first token comes from its prefill
    return {**stats, "wall_s": wall, "output_tok_s": stats["output_tokens"] / wall,
            "total_tok_s": (tokens["prefill"] + decode_tokens) / wall, "prefill_tok_s": tokens["prefill"] / wall,
            "rows_failed": failed, "roofline_s": None, "roofline_frac": None,
            "replicas": [{"index": r["index"], "pid": r["pid"], "devices": r["devices"], **r["engine"]}
                         for r in report["replicas"]]}


def compile_times(llm, structured) -> dict:
    """Structured outputs' one-off costs, apart from the throughput: what is left of the tokenizer's vocabulary
    tables when the first constraint comes (they build from engine start, beside the model's load), the schema's
    first compile (cold) and a repeat request of it (served by the cache)."""
    import time

    started = time.perf_counter()
    cache = llm.grammar_compile_cache()
    cache.vocabulary()
    ready = time.perf_counter()
    cache.request(structured).result()
    compiled = time.perf_counter()
    cache.request(structured).result()
    return {"tokenizer_info_s": ready - started, "cold_s": compiled - ready,
            "cached_s": time.perf_counter() - compiled}


def run_lengths(outputs: list) -> tuple[list[int], list[int]]:
    """The (prompt, output) lengths of every completion that produced a token: what the roofline schedules."""
    prompts, produced = [], []
    for out in outputs:
        for completion in out.outputs:
            if completion.token_ids:
                prompts.append(out.num_prompt_tokens)
                produced.append(len(completion.token_ids))
    return prompts, produced


def over_rounds(runs: list[dict]) -> tuple[dict, int]:
    """The figures of the median round (by output tok/s) with each throughput figure the median over the rounds,
    and under "rounds" each throughput figure's median, min, max, spread ((max - min) / median) and values; and
    the median round's index."""
    order = sorted(range(len(runs)), key=lambda i: runs[i]["output_tok_s"] or 0.0)
    middle = order[(len(runs) - 1) // 2]
    merged, spread = dict(runs[middle]), {}
    for key in THROUGHPUTS:
        values = [run.get(key) for run in runs]
        if any(v is None for v in values):
            continue
        median = statistics.median(values)
        merged[key] = median
        spread[key] = {"median": median, "min": min(values), "max": max(values),
                       "spread": (max(values) - min(values)) / median if median else None, "values": values}
    merged["rounds"] = spread
    return merged, middle


def measure(llm, workload: Workload, modes: list[bool], rounds: int, warmup_seed: int | None, sampling: dict,
            show: bool, roofline, replicated: bool) -> tuple[dict, float | None, dict]:
    """The workload in each loop of `modes`, `rounds` times, interleaved (round 1: sync then async, round 2: ...),
    after one warm-up per loop. Each loop's figures over the rounds (`over_rounds`), the median over the rounds of
    async / sync output tok/s (None unless both loops ran), and each loop's median round's step timeline (None
    for replicas). `roofline(outputs)`: the seconds of the ideal schedule of a run's outputs, or
    None. `llm`: an engine, or the replicas' pool when `replicated`."""
    from nanovllm_cli.job import EngineFailure, JobFailed

    runs: dict[str, list[dict]] = {("async" if m else "sync"): [] for m in modes}
    timelines: dict[str, list] = {label: [] for label in runs}
    for round_index in range(rounds):
        for overlap in modes:
            label = "async" if overlap else "sync"
            warmup = warmup_seed if round_index == 0 else None
            title = label if rounds == 1 else f"{label} round {round_index + 1}"
            if replicated:
                try:
                    runs[label].append(run_on_replicas(llm, workload, overlap, warmup, sampling))
                except (JobFailed, EngineFailure) as exc:  # a replica died, or its engine cannot run any more
                    typer.echo(f"error: {exc}", err=True)
                    raise typer.Exit(ExitCode.INTERNAL) from None
                timelines[label].append(None)
                continue
            llm.set_async_scheduling(overlap)
            if warmup is not None:
                run_workload(llm, warmup_workload(llm, warmup), f"{label} warm-up", False, sampling)
            stats, outputs = run_workload(llm, workload, title, show, sampling)
            stats["roofline_s"] = roofline(outputs)
            stats["roofline_frac"] = stats["roofline_s"] / stats["wall_s"] if stats["roofline_s"] and stats["wall_s"] \
                else None
            runs[label].append(stats)
            timelines[label].append(llm.stats.timeline())
    results, chosen = {}, {}
    for label, label_runs in runs.items():
        results[label], middle = over_rounds(label_runs)
        chosen[label] = timelines[label][middle]
    async_over_sync = statistics.median(a["output_tok_s"] / s["output_tok_s"] for s, a in
                                        zip(runs["sync"], runs["async"])) if len(modes) == 2 else None
    return results, async_over_sync, chosen


@with_engine_options(exclude=("served_model_name",))
def bench(
    dataset_name: Annotated[str, typer.Option(
        metavar="random|sharegpt",
        help="random: random token ids with lengths from the options below (default: uniform in [100, 1024] in and "
             "out, 256 rows). sharegpt: a ShareGPT-like synthetic workload, no download (random token ids, lengths "
             "lognormal with median 150 and sigma 0.9, clipped to [4, 1024], in and out; 1,000 rows).",
        rich_help_panel=WORKLOAD)] = "random",
    num_prompts: Annotated[int | None, typer.Option(
        "--num-prompts", "--num-seqs", help="Rows (default: 256; 1,000 with --dataset-name sharegpt).",
        rich_help_panel=WORKLOAD)] = None,
    input_len: Annotated[int | None, typer.Option(
        help="Every prompt N tokens (vLLM's form); with --random-range-ratio R, uniform in [N(1-R), N(1+R)].",
        rich_help_panel=WORKLOAD)] = None,
    output_len: Annotated[int | None, typer.Option(
        help="Every output N tokens (EOS ignored); with --random-range-ratio R, uniform in [N(1-R), N(1+R)].",
        rich_help_panel=WORKLOAD)] = None,
    random_range_ratio: Annotated[float, typer.Option(
        help="R of --input-len and --output-len, in [0, 1).", rich_help_panel=WORKLOAD)] = 0.0,
    input_len_range: Annotated[tuple[int, int] | None, typer.Option(
        help="Prompt lengths uniform in [LO, HI].", rich_help_panel=WORKLOAD)] = None,
    output_len_range: Annotated[tuple[int, int] | None, typer.Option(
        help="Output lengths uniform in [LO, HI].", rich_help_panel=WORKLOAD)] = None,
    input_dist: Annotated[str | None, typer.Option(
        metavar="SPEC", help=f"Prompt lengths from a distribution: {SPEC_HELP} (e.g. lognormal:150,0.9:4,1024).",
        rich_help_panel=WORKLOAD)] = None,
    output_dist: Annotated[str | None, typer.Option(
        metavar="SPEC", help="Output lengths from a distribution, as --input-dist.", rich_help_panel=WORKLOAD)] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.", rich_help_panel=WORKLOAD)] = 0,
    dataset: Annotated[Path | None, typer.Option(
        help="A `run` input file instead of the synthetic workload.", exists=True, dir_okay=False,
        rich_help_panel=WORKLOAD)] = None,
    max_tokens: Annotated[int, typer.Option(
        help="Output tokens of --dataset rows without their own max_tokens.", rich_help_panel=WORKLOAD)] = 256,
    save_workload_path: Annotated[Path | None, typer.Option(
        "--save-workload", help="Also write the workload as a `run` input file (token ids, max_tokens), which "
        "`bench --dataset` replays row for row: the same rows on another commit, or on a model of another "
        "vocabulary (token ids are drawn below the model's vocabulary size, so vocabularies draw different rows).",
        dir_okay=False, rich_help_panel=WORKLOAD)] = None,
    compare: Annotated[bool, typer.Option(
        "--compare", help="Run the sync and the async loop on the same workload and engine, and compare.",
        rich_help_panel=MODES)] = False,
    rounds: Annotated[int | None, typer.Option(
        help="Measure N times, interleaved, and report each throughput's median and spread (default: 1; 2 for "
             "the matrices).", rich_help_panel=MODES)] = None,
    warmup: Annotated[bool, typer.Option(help="A warm-up run before the measured ones.", rich_help_panel=MODES)] = True,
    sampling_matrix: Annotated[bool, typer.Option(
        "--sampling-matrix", help="Greedy and nine sampling settings (top-k/top-p/min-p, penalties, logit_bias, "
        "logprobs, n=4) on one engine in interleaved rounds: each one's output tok/s over greedy's, and the "
        "minimum, in the engine's step loop or both with --compare.", rich_help_panel=MODES)] = False,
    structured_matrix: Annotated[bool, typer.Option(
        "--structured-matrix", help="choice, regex, json_object, a small and a large JSON schema, EBNF and a "
        "schema per row, each against unconstrained at equal lengths, in both loops, in interleaved rounds: each "
        "ratio and the minimum. Samples with the sampling options; needs a model with a tokenizer.",
        rich_help_panel=MODES)] = False,
    matrix_only: Annotated[str | None, typer.Option(
        metavar="NAMES", help="Only these settings of a matrix, comma-separated (sampling: "
        f"{', '.join(SAMPLING_NAMES)}; structured: {', '.join(CONSTRAINT_KINDS)}).", rich_help_panel=MODES)] = None,
    structured: Annotated[str | None, typer.Option(
        help="json-schema: constrain every request by --schema (docs/STRUCTURED_OUTPUTS.md), then run the same "
             "prompts unconstrained with the output lengths the constrained run gave, and compare.",
        rich_help_panel=MODES)] = None,
    schema: Annotated[Path | None, typer.Option(
        help="The JSON schema file of --structured json-schema.", exists=True, dir_okay=False,
        rich_help_panel=MODES)] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).",
                                               rich_help_panel=SAMPLING)] = 0.0,
    top_p: Annotated[float, typer.Option(help="Top-p (1: off).", rich_help_panel=SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(help="Top-k (-1: off).", rich_help_panel=SAMPLING)] = -1,
    min_p: Annotated[float, typer.Option(help="Min-p (0: off).", rich_help_panel=SAMPLING)] = 0.0,
    logprobs: Annotated[int | None, typer.Option(
        help="Logprobs of each generated token with the top K alternatives.", rich_help_panel=SAMPLING)] = None,
    plot: Annotated[Path | None, typer.Option(
        help="Draw throughput over time, batch occupancy and step time by kind into FILE.png or FILE.html, and "
             "write the report beside it as FILE.json (needs the `plot` extra: matplotlib).", dir_okay=False)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    lora: Annotated[int, typer.Option(
        help="N > 0: N random LoRA adapters of --lora-rank spread over the rows, then the same rows on the base "
             "model, in one engine, and compare.", rich_help_panel=MODES)] = 0,
    lora_rank: Annotated[int, typer.Option(help="The rank of --lora's adapters.", rich_help_panel=MODES)] = 16,
    *,
    engine: EngineOptions,
) -> None:
    """Measure offline throughput: by default 256 requests of random tokens, prompt and output lengths uniform in
    [100, 1024], EOS ignored, greedy (or the sampling options); `--dataset-name sharegpt` for ShareGPT-like
    lengths, `--input-len`/`--output-len` (vLLM's form) or `--input-dist`/`--output-dist` for others. `--compare`
    runs both step loops on one engine, `--rounds N` repeats; `--data-parallel-size N` spreads the workload over N
    replicas as `run` does; `--json` for machines. `--task embed|classify|score|reward` measures a pooling model
    instead (bench_pooling.py): rows/s and tokens/s against its prefill roofline, on uniform prompt lengths."""
    import torch
    from rich.console import Console

    from nanovllm import SamplingParams
    from nanovllm_cli.bench_matrix import matrix_settings, print_matrix, run_sampling_matrix, run_structured_matrix
    from nanovllm_cli.bench_plot import check_plot_path
    from nanovllm_cli.roofline import measure_ceilings, roofline_seconds

    if dataset_name not in DATASETS:
        raise o.fail(f"--dataset-name {dataset_name!r}: use {' or '.join(DATASETS)}")
    if not 0 <= random_range_ratio < 1:
        raise o.fail(f"--random-range-ratio must be in [0, 1), not {random_range_ratio}")
    default_lengths, default_rows = DATASETS[dataset_name]
    try:
        input_lengths = lengths_from_options("input", input_len, random_range_ratio, input_len_range, input_dist,
                                             default_lengths)
        output_lengths = lengths_from_options("output", output_len, random_range_ratio, output_len_range,
                                              output_dist, default_lengths)
    except ValueError as exc:
        raise o.fail(str(exc)) from None
    synthetic_options = (num_prompts, input_len, output_len, input_len_range, output_len_range, input_dist,
                         output_dist)
    if dataset is not None and (dataset_name != "random" or any(v is not None for v in synthetic_options)):
        raise o.fail("--dataset takes its rows and lengths from the file: drop --dataset-name, --num-prompts and "
                     "the length options")
    num_rows = default_rows if num_prompts is None else num_prompts
    if num_rows < 1:
        raise o.fail(f"--num-prompts must be at least 1, not {num_rows}")
    o.model_source(engine)  # a model shape needs --load-format dummy
    if engine.task is not None:
        from nanovllm_cli.bench_pooling import pooling_bench

        if input_lengths.kind != "uniform":
            raise o.fail("--task takes its prompt lengths uniform: --input-len-range LO HI, or --input-len N "
                         "(--random-range-ratio R)")
        lo, hi = (int(v) for v in input_lengths.params)
        return pooling_bench(engine, num_rows, (lo, hi), seed, warmup, json_output)
    if sum((sampling_matrix, structured_matrix, structured is not None)) > 1:
        raise o.fail("--sampling-matrix, --structured-matrix and --structured are separate runs: keep one")
    matrix = sampling_matrix or structured_matrix
    try:
        chosen = matrix_settings(sampling_matrix, structured_matrix, matrix_only)
    except ValueError as exc:
        raise o.fail(str(exc)) from None
    rounds = (2 if matrix else 1) if rounds is None else rounds
    if rounds < 1:
        raise o.fail(f"--rounds must be at least 1, not {rounds}")
    constraint = _structured_constraint(structured, schema)
    if constraint is not None and rounds > 1:
        raise o.fail("--structured runs once: --structured-matrix runs constraints in rounds")
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "logprobs": logprobs}
    try:
        given = SamplingParams(**sampling)
    except ValueError as exc:
        raise o.fail(str(exc).replace("SamplingParams.", "--").replace("_", "-")) from None
    if sampling_matrix and given != SamplingParams(temperature=0.0):
        raise o.fail("--sampling-matrix runs its own settings: drop the sampling options")
    replicated = engine.data_parallel_size > 1
    if replicated and (constraint is not None or matrix):
        raise o.fail("the structured run and the matrices measure one engine: drop --data-parallel-size")
    adapter_dir = None
    if lora:
        from nanovllm_cli.bench_lora import lora_engine

        if lora < 0 or lora_rank < 1 or replicated or constraint is not None or matrix or plot is not None:
            raise o.fail("--lora N needs N >= 1 and --lora-rank >= 1, on one engine without --structured, a matrix "
                         "or --plot")
        engine = lora_engine(engine, lora_rank)
        adapter_dir = tempfile.TemporaryDirectory(prefix="nanovllm-bench-lora-")
    if plot is not None:
        if matrix or constraint is not None:
            raise o.fail("--plot draws the steps of a plain run: drop --sampling-matrix, --structured-matrix or "
                         "--structured")
        if replicated:
            raise o.fail("--plot draws one engine's steps: drop --data-parallel-size")
        if problem := check_plot_path(plot):
            raise o.fail(problem)
    if save_workload_path is not None and not save_workload_path.parent.is_dir():
        raise o.fail(f"--save-workload {save_workload_path}: no directory {save_workload_path.parent}; create it first")
    if replicated:
        from nanovllm_cli.replica_start import load_replicas

        llm = load_replicas(engine)
    else:
        llm = o.load_llm(engine)
    console = Console(stderr=True)
    show = console.is_terminal and not json_output
    info = llm.info
    ceilings = None
    timelines = {}
    report = {"model": info.model, "device": info.device, "data_parallel_size": engine.data_parallel_size}
    try:
        if (structured_matrix or constraint is not None) and llm.tokenizer is None:
            raise o.fail(f"structured outputs compile against the model's tokenizer and {info.model} has none: "
                         "give a model directory with one (scripts/tokenized_preset.py PRESET DIR makes one of a "
                         "preset's shape) and --load-format dummy")
        if dataset is not None:
            workload = dataset_workload(llm, dataset, max_tokens)
        else:
            workload = synthetic_workload(num_rows, input_lengths, output_lengths, info.vocab_size, seed)
        too_long = [i for i, (p, n) in enumerate(zip(workload.prompt_lens, workload.output_lens))
                    if p + n > info.max_model_len]
        if too_long:
            raise o.fail(f"{len(too_long)} requests exceed max_model_len={info.max_model_len} (e.g. request "
                         f"{too_long[0]}): shorten the lengths or raise --max-model-len")
        if save_workload_path is not None:
            save_workload(workload, save_workload_path)
        warmup_seed = seed if warmup else None
        if sampling_matrix:
            loops = [False, True] if compare else [engine.async_scheduling]
            report["sampling_matrix"] = run_sampling_matrix(llm, workload, loops, rounds, warmup_seed, show,
                                                           chosen)
        elif structured_matrix:
            report["structured_matrix"] = run_structured_matrix(llm, workload, sampling, rounds, warmup_seed,
                                                               show, chosen)
        elif constraint is not None:
            report["structured"] = {"kind": structured, "schema": str(schema), "compile": compile_times(llm, constraint)}
            report["modes"] = {}
            for overlap in ([False, True] if compare else [engine.async_scheduling]):
                label = "async" if overlap else "sync"
                llm.set_async_scheduling(overlap)
                if warmup:
                    run_workload(llm, warmup_workload(llm, seed), f"{label} warm-up", False, sampling)
                    run_workload(llm, Workload(workload.prompts[:16], [8] * 16), f"{label} warm-up", False,
                                 {**sampling, "structured_outputs": constraint})  # the mask's buffers and kernel
                report["modes"][label] = structured_pair(llm, workload, sampling, constraint, label, show)
        elif lora:
            from nanovllm_cli.bench_lora import lora_pair, random_adapters

            adapters = random_adapters(llm, lora, lora_rank, seed, Path(adapter_dir.name))
            report["lora"] = {"adapters": lora, "rank": lora_rank, "max_loras": info.max_loras}
            report["modes"] = {}
            for overlap in ([False, True] if compare else [engine.async_scheduling]):
                label = "async" if overlap else "sync"
                llm.set_async_scheduling(overlap)
                report["modes"][label] = lora_pair(llm, workload, sampling, adapters, label, show, warmup_seed)
        else:
            if info.device.startswith("cuda") and not replicated:  # the parent of replicas has no device
                ceilings = measure_ceilings(torch.device(info.device))

            def roofline(outputs):
                return roofline_seconds(info.costs, *run_lengths(outputs), info.max_num_seqs, ceilings) \
                    if ceilings else None

            modes = [False, True] if compare else [engine.async_scheduling]
            report["modes"], async_over_sync, timelines = measure(llm, workload, modes, rounds, warmup_seed,
                                                                   sampling, show, roofline, replicated)
            if async_over_sync is not None:
                report["async_over_sync"] = async_over_sync
    finally:
        llm.exit()
        if adapter_dir is not None:
            adapter_dir.cleanup()

    report.update({
        "device": ceilings.name if ceilings else info.device,
        "rounds": rounds,
        "workload": {"requests": len(workload.prompts), "prompt_tokens": sum(workload.prompt_lens),
                     "output_tokens": sum(workload.output_lens),
                     "source": str(dataset) if dataset else {"dataset_name": dataset_name,
                                                             "input_lengths": input_lengths.spec,
                                                             "output_lengths": output_lengths.spec, "seed": seed},
                     "sampling": sampling},
        "engine": {"dtype": info.dtype, "kv_cache_dtype": info.kv_cache_dtype, "kv_block_bytes": info.kv_block_bytes,
                   "block_size": info.block_size, "max_num_seqs": info.max_num_seqs,
                   "max_num_batched_tokens": info.max_num_batched_tokens, "num_kv_blocks": info.num_kv_blocks,
                   "cuda_graphs": info.cuda_graphs, "attention_backend": info.attention_backend,
                   "quantization": info.quantization, "torch": torch.__version__},
        "ceilings": ({"copy_bytes_per_s": ceilings.copy_bytes_per_s,
                      "matmul_bf16_flops_per_s": ceilings.matmul_flops_per_s} if ceilings else None),
    })
    if plot is not None:
        from nanovllm_cli.bench_plot import write_plot

        headline = {"workload": _describe_workload(report), **{
            f"{label} output tok/s": _fmt(stats["output_tok_s"]) for label, stats in report["modes"].items()}}
        write_plot(plot, timelines, info.max_num_seqs, f"nanovllm bench — {report['model']} on {report['device']}",
                   headline)
        plot.with_suffix(".json").write_text(json.dumps(report, indent=1))
    if json_output:
        typer.echo(json.dumps(report))
        return
    out = Console()
    if sampling_matrix:
        print_matrix(f"nanovllm bench --sampling-matrix — {_describe_workload(report)}", report["sampling_matrix"], out)
    elif structured_matrix:
        print_matrix(f"nanovllm bench --structured-matrix — {_describe_workload(report)}", report["structured_matrix"],
                     out)
    elif constraint is not None:
        print_structured_report(report, out)
    elif lora:
        print_lora_report(report, out)
    else:
        print_report(report, out)


def _describe_workload(report: dict) -> str:
    workload = report["workload"]
    source = workload["source"]
    lengths = source if isinstance(source, str) else f"in {source['input_lengths']}, out {source['output_lengths']}"
    return f"{workload['requests']:,} rows, {lengths}, {report['model']} on {report['device']}"


def _structured_constraint(kind: str | None, schema: Path | None):
    if kind is None:
        if schema is not None:
            raise o.fail("--schema needs --structured json-schema")
        return None
    if kind != "json-schema":
        raise o.fail(f"--structured {kind!r}: the supported workload is json-schema")
    if schema is None:
        raise o.fail("--structured json-schema needs --schema FILE")
    from nanovllm import StructuredOutputsParams

    try:
        return StructuredOutputsParams(json=json.loads(schema.read_text()))
    except ValueError as exc:
        raise o.fail(f"--schema {schema}: {exc}") from None


def print_structured_report(report: dict, console) -> None:
    from rich.table import Table

    table = Table(title=f"nanovllm bench --structured — {report['model']} on {report['device']}")
    table.add_column("metric")
    modes = report["modes"]
    for name in modes:
        table.add_column(f"{name} structured", justify="right")
        table.add_column(f"{name} unstructured", justify="right")
    for row in ("requests", "output_tokens", "steps", "wall_s", "output_tok_s", "gpu_busy_frac",
                "host_ms_per_decode_step", "rows_complete", "rows_failed"):
        table.add_row(row, *(_fmt(pair[side].get(row)) for pair in modes.values()
                             for side in ("structured", "unstructured")))
    console.print(table)
    for name, pair in modes.items():
        console.print(f"{name}: structured / unstructured output throughput {pair['structured_over_unstructured']:.3f}x")
    compile_s = report["structured"]["compile"]
    console.print(f"compile: tokenizer tables {compile_s['tokenizer_info_s']:.3f} s left to wait (built from engine "
                  f"start), schema cold {compile_s['cold_s']:.3f} s, cached {compile_s['cached_s'] * 1e3:.3f} ms")


def print_lora_report(report: dict, console) -> None:
    from rich.table import Table

    settings = report["lora"]
    table = Table(title=f"nanovllm bench --lora {settings['adapters']} (rank {settings['rank']}, "
                        f"{settings['max_loras']} slots) — {report['model']} on {report['device']}")
    table.add_column("metric")
    modes = report["modes"]
    for name in modes:
        table.add_column(f"{name} lora", justify="right")
        table.add_column(f"{name} base", justify="right")
    for row in ("requests", "output_tokens", "steps", "wall_s", "output_tok_s", "total_tok_s", "gpu_busy_frac",
                "host_ms_per_decode_step", "tpot_p50_s", "rows_failed"):
        table.add_row(row, *(_fmt(pair[side].get(row)) for pair in modes.values() for side in ("lora", "base")))
    console.print(table)
    for name, pair in modes.items():
        console.print(f"{name}: lora / base output throughput {pair['lora_over_base']:.3f}x")


def print_report(report: dict, console) -> None:
    from rich.table import Table

    modes = report["modes"]
    table = Table(title=f"nanovllm bench — {_describe_workload(report)}")
    table.add_column("metric")
    for name in modes:
        table.add_column(name, justify="right")
    rows = ["requests", "prompt_tokens", "output_tokens", "steps", "preemptions", "wall_s", "output_tok_s",
            "total_tok_s", "prefill_tok_s", "gpu_busy_frac", "gpu_idle_frac", "cpu_schedule_s", "cpu_prepare_s",
            "cpu_execute_s", "cpu_wait_s", "cpu_postprocess_s", "host_ms_per_decode_step",
            "largest_decode_batch", "host_ms_per_largest_decode_step", "ttft_p50_s",
            "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "mean_running_rows", "full_batch_decode_share",
            "tail_below_half_steps", "tail_below_half_s", "steps_decode_only", "steps_mixed", "steps_prefill_only",
            "steps_graph", "steps_eager", "roofline_s", "roofline_frac"]
    for row in rows:
        table.add_row(row, *(_fmt(stats.get(row)) for stats in modes.values()))
    console.print(table)
    console.print(f"batch: max_num_seqs {report['engine']['max_num_seqs']}; roofline: the ideal continuous-batching "
                  "schedule of the run's lengths at that batch")
    if report["rounds"] > 1:
        for name, stats in modes.items():
            spread = stats["rounds"]["output_tok_s"]
            console.print(f"{name}: output tok/s over {report['rounds']} rounds: median {_fmt(spread['median'])}, "
                          f"min {_fmt(spread['min'])}, max {_fmt(spread['max'])} (spread {spread['spread']:.1%})")
    for name, stats in modes.items():
        for r in stats.get("replicas", ()):
            console.print(f"{name} replica {r['index']} ({','.join(r['devices']) if r['devices'] else 'CPU'}): "
                          f"{r['requests']} requests, {_fmt(r['output_tok_s'])} output tok/s over its "
                          f"{_fmt(r['wall_s'])} s of steps")
    if "async_over_sync" in report:
        console.print(f"async / sync output throughput: {report['async_over_sync']:.3f}x")
    if report["device"] == "cpu":
        console.print("On the CPU there is no device to overlap with: the async loop cannot gain here, and GPU "
                      "fields are empty.")


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)
