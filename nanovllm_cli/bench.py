"""`nanovllm bench`: offline throughput of the sync and the async step loop, with an honest time split.

Every figure comes from the engine's step stats (docs/ARCHITECTURE.md): throughput over the wall clock of the steps, device
time from CUDA events, host phases from the host clock. On a GPU the run is also set against its roofline."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from nanovllm_cli import options as o
from nanovllm_cli.options import EngineOptions, ExitCode, with_engine_options

WORKLOAD = "Workload"
SAMPLING = "Sampling"


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompts]


def synthetic_workload(num_seqs: int, input_range: tuple[int, int], output_range: tuple[int, int],
                       vocab_size: int, seed: int) -> Workload:
    """Random token ids (no prefix-cache hits) and lengths drawn uniformly from the ranges, inclusive."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab_size) for _ in range(rng.randint(*input_range))] for _ in range(num_seqs)]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_seqs)])


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
                 sampling: dict | None = None) -> tuple[dict, list]:
    """Every request of `workload` (EOS ignored) with the `sampling` settings (SamplingParams fields, a
    structured-output constraint included; greedy by default). Returns the engine's step stats and the outputs in
    workload order."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from nanovllm import SamplingParams

    llm.reset_prefix_cache()
    llm.reset_stats()
    settings = {"temperature": 0, **(sampling or {})}
    request_ids = [llm.add_request(prompt, SamplingParams(**settings, max_tokens=max_tokens, ignore_eos=True))
                   for prompt, max_tokens in zip(workload.prompts, workload.output_lens)]
    outputs = {}
    with Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  disable=not show_progress, transient=True) as progress:
        task = progress.add_task(label, total=len(workload.prompts))
        while llm.has_unfinished_requests():
            finished = llm.step()
            outputs.update((out.request_id, out) for out in finished)
            progress.advance(task, len(finished))
    return llm.report()["steps"], [outputs[r] for r in request_ids]


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
    from nanovllm_cli.rows import RowRequest
    from nanovllm_cli.runner import RowFailure

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
    """Structured outputs' one-off costs, apart from the throughput: the tokenizer's vocabulary tables (once per
    engine), the schema's first compile (cold) and a repeat request of it (served by the cache)."""
    import time

    started = time.perf_counter()
    cache = llm.grammar_compile_cache()
    ready = time.perf_counter()
    cache.request(structured).result()
    compiled = time.perf_counter()
    cache.request(structured).result()
    return {"tokenizer_info_s": ready - started, "cold_s": compiled - ready,
            "cached_s": time.perf_counter() - compiled}


def structured_pair(llm, workload: Workload, sampling: dict, structured, label: str, show_progress: bool) -> dict:
    """The workload constrained, then the same prompts unconstrained with each request's output length as the
    constrained run gave it (EOS ignored): the same tokens, so the throughputs compare like for like."""
    stats, outputs = run_workload(llm, workload, f"{label} structured", show_progress,
                                  {**sampling, "structured_outputs": structured})
    stats["rows_complete"] = sum(bool(out.structured_complete) for out in outputs)
    stats["rows_failed"] = sum(out.finish_reason == "error" for out in outputs)
    same_lengths = Workload(workload.prompts, [max(len(out.token_ids), 1) for out in outputs])
    unstructured, _ = run_workload(llm, same_lengths, f"{label} unstructured", show_progress, sampling)
    return {"structured": stats, "unstructured": unstructured,
            "structured_over_unstructured": stats["output_tok_s"] / unstructured["output_tok_s"]}


@with_engine_options()
def bench(
    num_seqs: Annotated[int, typer.Option(help="Synthetic requests.", rich_help_panel=WORKLOAD)] = 256,
    input_len_range: Annotated[tuple[int, int], typer.Option(
        help="Prompt lengths, uniform in [LO, HI].", rich_help_panel=WORKLOAD)] = (100, 1024),
    output_len_range: Annotated[tuple[int, int], typer.Option(
        help="Output lengths (EOS ignored), uniform in [LO, HI].", rich_help_panel=WORKLOAD)] = (100, 1024),
    seed: Annotated[int, typer.Option(help="Workload seed.", rich_help_panel=WORKLOAD)] = 0,
    dataset: Annotated[Path | None, typer.Option(
        help="A `run` input file instead of the synthetic workload.", exists=True, dir_okay=False,
        rich_help_panel=WORKLOAD)] = None,
    max_tokens: Annotated[int, typer.Option(
        help="Output tokens of --dataset rows without their own max_tokens.", rich_help_panel=WORKLOAD)] = 256,
    compare: Annotated[bool, typer.Option(
        "--compare", help="Run the sync and the async loop on the same workload and engine, and compare.")] = False,
    warmup: Annotated[bool, typer.Option(help="A warm-up run before each measured one.")] = True,
    structured: Annotated[str | None, typer.Option(
        help="json-schema: constrain every request by --schema (docs/STRUCTURED_OUTPUTS.md), then run the same "
             "prompts unconstrained with the output lengths the constrained run gave, and compare.",
        rich_help_panel=WORKLOAD)] = None,
    schema: Annotated[Path | None, typer.Option(
        help="The JSON schema file of --structured json-schema.", exists=True, dir_okay=False,
        rich_help_panel=WORKLOAD)] = None,
    temperature: Annotated[float, typer.Option(help="Sampling temperature (0: greedy).",
                                               rich_help_panel=SAMPLING)] = 0.0,
    top_p: Annotated[float, typer.Option(help="Top-p (1: off).", rich_help_panel=SAMPLING)] = 1.0,
    top_k: Annotated[int, typer.Option(help="Top-k (-1: off).", rich_help_panel=SAMPLING)] = -1,
    min_p: Annotated[float, typer.Option(help="Min-p (0: off).", rich_help_panel=SAMPLING)] = 0.0,
    logprobs: Annotated[int | None, typer.Option(
        help="Logprobs of each generated token with the top K alternatives.", rich_help_panel=SAMPLING)] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout.")] = False,
    *,
    engine: EngineOptions,
) -> None:
    """Measure offline throughput: by default 256 requests of random tokens, prompt and output lengths uniform in
    [100, 1024], EOS ignored, greedy (or the sampling options). `--compare` runs both step loops on one engine;
    `--data-parallel-size N` spreads the workload over N replicas as `run` does; `--json` for machines.
    `--task embed|classify|score|reward` measures a pooling model instead (bench_pooling.py): rows/s and tokens/s
    against its prefill roofline."""
    if engine.task is not None:
        from nanovllm_cli.bench_pooling import pooling_bench

        return pooling_bench(engine, num_seqs, input_len_range, seed, warmup, json_output)
    import torch
    from rich.console import Console

    from nanovllm_cli.roofline import measure_ceilings, roofline_seconds

    for name, (lo, hi) in (("--input-len-range", input_len_range), ("--output-len-range", output_len_range)):
        if not 1 <= lo <= hi:
            raise o.fail(f"{name} needs 1 <= LO <= HI, got {lo} {hi}")
    constraint = _structured_constraint(structured, schema)

    from nanovllm import SamplingParams

    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p, "logprobs": logprobs}
    try:
        SamplingParams(**sampling)
    except ValueError as exc:
        raise o.fail(str(exc).replace("SamplingParams.", "--").replace("_", "-")) from None
    replicated = engine.data_parallel_size > 1
    if replicated and constraint is not None:
        raise o.fail("--structured measures one engine: drop --data-parallel-size")
    if replicated:
        from nanovllm_cli.replicas import load_replicas

        llm = load_replicas(engine)
    else:
        llm = o.load_llm(engine)
    console = Console(stderr=True)
    info = llm.info
    ceilings = roofline_s = None
    try:
        if dataset is not None:
            workload = dataset_workload(llm, dataset, max_tokens)
        else:
            workload = synthetic_workload(num_seqs, input_len_range, output_len_range, info.vocab_size, seed)
        too_long = [i for i, (p, n) in enumerate(zip(workload.prompt_lens, workload.output_lens))
                    if p + n > info.max_model_len]
        if too_long:
            raise o.fail(f"{len(too_long)} requests exceed max_model_len={info.max_model_len} (e.g. request "
                         f"{too_long[0]}): shorten the ranges or raise --max-model-len")

        if info.device.startswith("cuda") and not replicated:  # the parent of replicas has no device
            ceilings = measure_ceilings(torch.device(info.device))
            roofline_s = roofline_seconds(info.costs, workload.prompt_lens, workload.output_lens, info.max_num_seqs,
                                          ceilings)

        compile_s = compile_times(llm, constraint) if constraint is not None else None  # before any run: cold
        modes = [False, True] if compare else [engine.async_scheduling]
        results = {}
        for overlap in modes:
            label = "async" if overlap else "sync"
            if replicated:
                from nanovllm_cli.runner import EngineFailure, JobFailed

                try:
                    results[label] = run_on_replicas(llm, workload, overlap, seed if warmup else None, sampling)
                except (JobFailed, EngineFailure) as exc:  # a replica died, or its engine cannot run any more
                    typer.echo(f"error: {exc}", err=True)
                    raise typer.Exit(ExitCode.INTERNAL) from None
                continue
            llm.set_async_scheduling(overlap)
            if warmup:
                run_workload(llm, warmup_workload(llm, seed), f"{label} warm-up", False, sampling)
            show = console.is_terminal and not json_output
            if constraint is not None:
                if warmup:  # the mask's buffers and kernel, first used here
                    run_workload(llm, Workload(workload.prompts[:16], [8] * 16), f"{label} warm-up", False,
                                 {**sampling, "structured_outputs": constraint})
                results[label] = structured_pair(llm, workload, sampling, constraint, label, show)
                continue
            stats, _ = run_workload(llm, workload, label, show, sampling)
            stats["roofline_s"] = roofline_s
            stats["roofline_frac"] = roofline_s / stats["wall_s"] if roofline_s and stats["wall_s"] else None
            results[label] = stats
    finally:
        llm.exit()

    report = {
        "model": info.model,
        "device": ceilings.name if ceilings else info.device,
        "data_parallel_size": engine.data_parallel_size,
        "workload": {"requests": len(workload.prompts), "prompt_tokens": sum(workload.prompt_lens),
                     "output_tokens": sum(workload.output_lens),
                     "source": str(dataset) if dataset else {"input_len_range": list(input_len_range),
                                                             "output_len_range": list(output_len_range),
                                                             "seed": seed},
                     "sampling": sampling},
        "engine": {"dtype": info.dtype, "kv_cache_dtype": info.kv_cache_dtype, "kv_block_bytes": info.kv_block_bytes,
                   "block_size": info.block_size, "max_num_seqs": info.max_num_seqs,
                   "max_num_batched_tokens": info.max_num_batched_tokens, "num_kv_blocks": info.num_kv_blocks,
                   "cuda_graphs": info.cuda_graphs, "attention_backend": info.attention_backend,
                   "quantization": info.quantization, "torch": torch.__version__},
        "ceilings": ({"copy_bytes_per_s": ceilings.copy_bytes_per_s,
                      "matmul_bf16_flops_per_s": ceilings.matmul_flops_per_s} if ceilings else None),
        "modes": results,
    }
    if constraint is not None:
        report["structured"] = {"kind": structured, "schema": str(schema), "compile": compile_s}
    elif compare:
        report["async_over_sync"] = results["async"]["output_tok_s"] / results["sync"]["output_tok_s"]
    if json_output:
        typer.echo(json.dumps(report))
    elif constraint is not None:
        print_structured_report(report, Console())
    else:
        print_report(report, Console())


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
    console.print(f"compile: tokenizer tables {compile_s['tokenizer_info_s']:.3f} s (once per engine), schema cold "
                  f"{compile_s['cold_s']:.3f} s, cached {compile_s['cached_s'] * 1e3:.3f} ms")


def print_report(report: dict, console) -> None:
    from rich.table import Table

    modes = report["modes"]
    table = Table(title=f"nanovllm bench — {report['model']} on {report['device']}")
    table.add_column("metric")
    for name in modes:
        table.add_column(name, justify="right")
    rows = ["requests", "prompt_tokens", "output_tokens", "steps", "preemptions", "wall_s", "output_tok_s",
            "total_tok_s", "prefill_tok_s", "gpu_busy_frac", "gpu_idle_frac", "cpu_schedule_s", "cpu_prepare_s",
            "cpu_execute_s", "cpu_wait_s", "cpu_postprocess_s", "host_ms_per_decode_step",
            "largest_decode_batch", "host_ms_per_largest_decode_step", "ttft_p50_s",
            "ttft_p99_s", "tpot_p50_s", "tpot_p99_s", "roofline_s", "roofline_frac"]
    for row in rows:
        table.add_row(row, *(_fmt(stats.get(row)) for stats in modes.values()))
    console.print(table)
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
