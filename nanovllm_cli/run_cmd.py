"""`nanovllm run`: a completion for every row of a JSONL / Parquet file, streamed into OUTPUT as rows finish."""
from __future__ import annotations

import dataclasses
import json
import math
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanovllm_cli import options as o
from nanovllm_cli.interrupts import interruptible
from nanovllm_cli.options import EngineOptions, ExitCode, with_engine_options

if TYPE_CHECKING:  # the engine imports torch: not needed for `--help`
    from rich.console import Console

    from nanovllm import LLM
    from nanovllm_cli.display import Snapshot
    from nanovllm_cli.job import BatchRunner, RunStats
    from nanovllm_cli.preflight import InputScan, OutputLock
    from nanovllm_cli.records import RecordLayout
    from nanovllm_cli.replicas import ReplicaPool
    from nanovllm_cli.rows import RowError, RowRequest
    from nanovllm_cli.writers import Answered

IO = "Input and output"
LONG = "Long jobs"
RAY = "Ray cluster"


@interruptible
@with_engine_options()
def run(
    input_path: Annotated[str, typer.Argument(
        metavar="INPUT", help="Rows to run: .jsonl or .parquet (with --ray also a directory, a glob or a URI).")],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="Results: .jsonl or .parquet (default: INPUT-stem.results.jsonl beside INPUT); with "
        "--ray a directory of shards named *.parquet or *.jsonl.", rich_help_panel=IO)] = None,
    input_format: Annotated[str | None, typer.Option(
        help="jsonl | parquet (default: from the suffix).", rich_help_panel=IO)] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Skip the ids already in OUTPUT (cutting a torn last line) and add the rest.",
        rich_help_panel=IO)] = False,
    retry_failed: Annotated[bool, typer.Option(
        "--retry-failed", help="With --resume (implied): also rerun the rows whose record in OUTPUT is an error, "
        "replacing those records.", rich_help_panel=IO)] = False,
    sync: Annotated[bool, typer.Option(
        "--sync", help="With --resume (implied): rerun the rows whose content changed since OUTPUT answered them and "
        "drop the records of rows no longer in INPUT (without it, either is an error).", rich_help_panel=IO)] = False,
    overwrite: Annotated[bool, typer.Option(
        "--overwrite", help="Replace an OUTPUT that already holds results (without it, and without --resume, "
        "that is an error).", rich_help_panel=IO)] = False,
    include_token_ids: Annotated[bool, typer.Option(
        "--include-token-ids", help="Add prompt_token_ids and token_ids to each result.",
        rich_help_panel=IO)] = False,
    drop_columns: Annotated[bool, typer.Option(
        "--drop-columns", help="Leave out of each record the row's own fields (those nanovllm does not read), "
        "which are carried through by default.", rich_help_panel=IO)] = False,
    reorder: Annotated[bool, typer.Option(
        "--reorder/--no-reorder", help="Prefix-aware admission inside the read-ahead window, or file order.",
        rich_help_panel=IO)] = True,
    window: Annotated[int, typer.Option(
        help="Rows read ahead of the engine: the reordering window, and what bounds memory (with --ray: the rows of "
        "each batch an engine runs).", min=1,
        rich_help_panel=IO)] = 1024,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No progress and no summary table (errors still go to stderr).",
        rich_help_panel=IO)] = False,
    json_summary: Annotated[bool, typer.Option(
        "--json", help="Print the summary as one JSON object on stdout.", rich_help_panel=IO)] = False,
    log_interval: Annotated[float, typer.Option(
        help="Seconds between progress lines when stderr is not a terminal.", rich_help_panel=IO)] = 10.0,
    metrics_file: Annotated[Path | None, typer.Option(
        help="Write the live figures (rows, tokens, errors, retries, each replica's) as JSON lines to this file, "
        "every --metrics-interval seconds and at the end, for a dashboard to tail.", rich_help_panel=LONG)] = None,
    metrics_interval: Annotated[float, typer.Option(
        help="Seconds between lines of --metrics-file.", rich_help_panel=LONG)] = 10.0,
    max_restarts: Annotated[int, typer.Option(
        help="Times each replica (--data-parallel-size process, --ray engine actor) is restarted after it dies; "
        "its rows go to the others meanwhile.", min=0, rich_help_panel=LONG)] = 3,
    max_tokens: o.MaxTokens = 64,
    temperature: o.Temperature = 0.0,
    top_p: o.TopP = 1.0,
    top_k: o.TopK = -1,
    min_p: o.MinP = 0.0,
    seed: o.Seed = 0,
    stop: o.Stop = None,
    ignore_eos: o.IgnoreEos = False,
    dimensions: Annotated[int | None, typer.Option(
        help="embed: keep the first N features of each embedding (Matryoshka models), then normalize; a row's own "
        "'dimensions' wins.", rich_help_panel=o.POOLING)] = None,
    ray: Annotated[bool, typer.Option(
        "--ray", help="Run on a Ray cluster (pip install 'nanovllm[ray]'): one engine per Ray actor, OUTPUT a "
        "folder of committed shards that --resume completes.",
        rich_help_panel=RAY)] = False,
    ray_address: Annotated[str | None, typer.Option(
        help="The cluster to join (default: RAY_ADDRESS, else a local one).", rich_help_panel=RAY)] = None,
    ray_replicas: Annotated[int | None, typer.Option(
        help="Engines (Ray actors), each on --tensor-parallel-size GPUs (default 1).", min=1,
        rich_help_panel=RAY)] = None,
    *,
    engine: EngineOptions,
) -> None:
    """Generate a completion for every row of INPUT, writing each result to OUTPUT as soon as it finishes.

    **Rows** (a JSON object per line, or a Parquet row): {"id", "prompt": str} | {"id", "messages":
    [{"role", "content"}, ...]} (the model's chat template) | {"id", "prompt_token_ids": [int, ...]} | an
    OpenAI batch line {"custom_id", "method": "POST", "url": "/v1/chat/completions" or "/v1/completions",
    "body": {"messages" or "prompt", "max_tokens", "temperature", "top_p", "stop", "seed", ...}}. A row without
    an id gets its line number (Parquet: row number, from 1); blank lines are skipped.

    **Per-row sampling**: max_tokens, temperature, top_p, top_k, min_p, stop, stop_token_ids, seed, ignore_eos,
    structured_outputs ({"json": schema} | {"json_object": true} | {"regex"} | {"choice"} | {"grammar"}) as
    fields of the row or of its "sampling_params" object (of the body for OpenAI lines, with "response_format"
    for the constraint) override the defaults below.

    **Output**: {"id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "error",
    "structured_complete"} per row (structured_complete false: cut by max_tokens, the text may not parse);
    OpenAI batch output lines for OpenAI input. A bad row gets an error record naming the row and the problem,
    and every other row still runs. A row's other fields are its own data, carried into its record (after the
    record's own fields, which win a name clash; not with --drop-columns), except a misspelled field or one
    another tool decodes with, which is the row's error.

    **Pooling** (an embedding or classification checkpoint, or --task embed|classify|score|reward): rows
    {"id", "text" | "prompt" | "messages" | "prompt_token_ids"} (score: {"id", "text_1", "text_2"} or {"id",
    "query", "documents": [...]}) or OpenAI /v1/embeddings lines; records {"id", "embedding"} | {"id", "probs",
    "label"} | {"id", "score"} / {"id", "scores"} | {"id", "reward"}, with "prompt_tokens", "cached_tokens",
    "error" (Parquet embeddings: fixed-size float32 lists).

    **Resume**: --resume answers only the rows OUTPUT lacks. Each record holds a fingerprint of its row: a row
    changed since, or a record of a row no longer in INPUT, is an error unless --sync reruns / drops them.

    **Before the model loads** INPUT is checked as a whole (readable, of its format, ids unique) and OUTPUT
    too (writable, not INPUT, not being written by another run: a lock is held for the whole job).

    **Exit codes**: 0 every row of OUTPUT succeeded; 1 OUTPUT holds error records (this run's, or earlier ones
    --resume kept: --retry-failed reruns them), every other row answered; 2 usage error (nothing run); 3 internal
    error mid-job; 130 interrupted. After 3 or 130, or a kill, run again with --resume.
    """
    from rich.console import Console

    from nanovllm import SamplingParams
    from nanovllm_cli.display import notice
    from nanovllm_cli.lora_modules import LoRAModules
    from nanovllm_cli.metrics import check_writable
    from nanovllm_cli.pooling_rows import PoolingRowParser
    from nanovllm_cli.preflight import OutputLock, PreflightError, duplicates_message, scan_input
    from nanovllm_cli.readers import detect_format, iter_rows
    from nanovllm_cli.rows import RowParser

    defaults = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "min_p": min_p, "stop": stop or [], "ignore_eos": ignore_eos}
    for name, value in (("--log-interval", log_interval), ("--metrics-interval", metrics_interval)):
        if not (math.isfinite(value) and value > 0):
            raise o.fail(f"{name} must be a positive number of seconds, not {value}")
    if ray or ray_address is not None or ray_replicas is not None:
        from nanovllm_cli.ray_job import ray_job

        unsupported = {"--ray-address/--ray-replicas without --ray": not ray,
                       "--data-parallel-size (use --ray-replicas)": engine.data_parallel_size > 1,
                       "--lora-modules": bool(engine.lora_modules)}
        summary = ray_job(input_path, output, input_format, engine, defaults, seed, unsupported,
                          include_token_ids=include_token_ids, reorder=reorder, window=window,
                          replicas=ray_replicas or 1, address=ray_address, overwrite=overwrite, quiet=quiet,
                          resume=resume or retry_failed or sync, retry_failed=retry_failed, sync=sync,
                          log_interval=log_interval, metrics_file=metrics_file, metrics_interval=metrics_interval,
                          max_restarts=max_restarts, pooling={"dimensions": dimensions})
        finish(summary, quiet, json_summary)
    input_path = Path(input_path)
    if not input_path.is_file():
        raise o.fail(f"INPUT {input_path} " + ("is a directory: a directory or a glob needs --ray"
                                               if input_path.is_dir() else "does not exist"))
    output = Path(output) if output else input_path.with_name(f"{input_path.stem}.results.jsonl")
    if output.suffix.lower() not in (".jsonl", ".parquet"):
        raise o.fail(f"OUTPUT must end in .jsonl or .parquet, not {output.name!r}")
    pooling = o.pooling_of(engine)
    task = pooling.task if pooling is not None else None
    try:
        fmt = detect_format(input_path, input_format)
        scan = scan_input(input_path, fmt, pooling=task is not None)
    except ValueError as exc:
        raise o.fail(f"cannot read {input_path}: {exc}") from None
    except PreflightError as exc:
        raise o.fail(str(exc)) from None
    label = "row" if fmt == "parquet" else "line"
    if scan.duplicates:
        raise o.fail(duplicates_message(scan, label))
    if scan.rows == 0:
        typer.echo(f"{input_path} has no rows: nothing to do", err=True)
        raise typer.Exit(ExitCode.OK)
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise o.fail(f"invalid sampling option: {exc}") from None
    try:
        lora = LoRAModules.parse(engine.lora_modules) if engine.lora_modules else None
        engine.chat_template_text()
    except ValueError as exc:
        raise o.fail(str(exc)) from None
    embedding_size = None
    if task == "embed" and output.suffix.lower() == ".parquet":  # one vector size for the fixed-size column
        embedding_size = dimensions or pooling.output_size
    layout = record_layout(scan, output, include_token_ids, drop_columns, task, embedding_size)
    resume = resume or retry_failed or sync
    try:
        check_writable(metrics_file)
    except OSError as exc:
        raise o.fail(f"cannot write --metrics-file {metrics_file}: {exc.strerror or exc}") from None
    lock = OutputLock(output)
    console = Console(stderr=True)
    try:
        answered = prepare_output(output, input_path, layout, lock, scan.fingerprints, resume=resume,
                                  retry_failed=retry_failed, sync=sync, overwrite=overwrite)
        if engine.data_parallel_size > 1:
            from nanovllm_cli.replicas import load_replicas

            source = load_replicas(engine, seed, max_restarts=max_restarts,
                                   on_event=lambda message: notice(console, message))
        else:
            source = o.load_llm(engine, seed)
        with source:
            try:
                lora = lora and lora.with_base_names(engine.model, source.info.model)
            except ValueError as exc:
                raise o.fail(str(exc)) from None
            parser = RowParser(defaults, seed, label, lora=lora) if task is None \
                else PoolingRowParser(seed, label, task, {"dimensions": dimensions})
            rows = (parser.parse(number, row) for number, row in iter_rows(input_path, fmt))
            code, summary = run_job(source, rows, scan.rows, layout, output, append=resume, skip_ids=answered.ids,
                                    failed_before=len(answered.failed), fingerprints=scan.fingerprints,
                                    window=window, reorder=reorder, quiet=quiet, log_interval=log_interval,
                                    console=console, metrics=(metrics_file, metrics_interval),
                                    max_tokens=max_tokens)
    finally:
        lock.release()
    finish({"input": str(input_path), **summary}, quiet, json_summary)


def record_layout(scan: InputScan, output: Path, include_token_ids: bool, drop_columns: bool, task: str | None,
                  embedding_size: int | None) -> RecordLayout:
    """The records' shape: a pooling task's or generation's, with the rows' own fields carried (a Parquet
    OUTPUT's columns from the input scan), or none. A row's field named as one of the record's own is not
    carried: say so once."""
    from nanovllm_cli.preflight import MAX_CARRIED_FIELDS
    from nanovllm_cli.records import RecordLayout

    layout = RecordLayout(openai=scan.openai, include_token_ids=include_token_ids, task=task,
                          embedding_size=embedding_size, drop_columns=drop_columns)
    if drop_columns:
        return layout
    clashes = scan.clashes(layout.own_fields)
    if clashes:
        typer.echo(f"note: the rows' field(s) {', '.join(map(repr, clashes[:5]))} share a name with the records' own; "
                   "the records keep their own (rename the input's to carry it)", err=True)
    if output.suffix.lower() == ".parquet":
        if scan.too_many_fields:
            raise o.fail(f"INPUT's rows carry more than {MAX_CARRIED_FIELDS} fields of their own: too many columns for "
                         "a Parquet OUTPUT; add --drop-columns or write JSONL")
        layout = dataclasses.replace(layout, passthrough=scan.passthrough(layout.own_fields))
    return layout


def finish(summary: dict, quiet: bool, json_summary: bool) -> None:
    """Print the summary (a table on stderr, and/or JSON on stdout) and exit with its code."""
    if not quiet:
        from nanovllm_cli.display import print_summary

        print_summary(summary)
    if json_summary:
        typer.echo(json.dumps(summary))
    raise typer.Exit(summary["exit_code"])


def prepare_output(output: Path, input_path: Path, layout: RecordLayout, lock: OutputLock,
                   fingerprints: dict[str, str], *, resume: bool, retry_failed: bool, sync: bool,
                   overwrite: bool) -> Answered:
    """Lock OUTPUT and check it (see `preflight`); returns what earlier runs answered (with --resume), the
    records to answer again already dropped: failed rows' with --retry-failed, with --sync the records of rows
    changed or removed since (without --sync those are an error)."""
    from nanovllm_cli.preflight import (
        PreflightError,
        check_not_input,
        check_output,
        check_output_kind,
        prepare_output_dir,
        stale_message,
        stale_records,
    )
    from nanovllm_cli.writers import Answered, OutputError, drop_records, resume_ids

    try:
        prepare_output_dir(output)
        check_output_kind(output)
        check_not_input(output, input_path, lock.path)
        lock.acquire()
        check_output(output, resume=resume, overwrite=overwrite)
        answered = resume_ids(output, layout) if resume else Answered()
        retried = answered.failed if retry_failed else set()
        kept = answered.without(retried)
        stale = stale_records(kept, fingerprints)
        if stale and not sync:
            raise PreflightError(stale_message(output, kept, fingerprints))
        drop_records(output, layout, retried | stale)
        answered = kept.without(stale)
    except (PreflightError, OutputError) as exc:
        raise o.fail(str(exc)) from None
    except OSError as exc:
        raise o.fail(f"cannot use {output}: {exc.strerror or exc}") from None
    return answered


def run_job(source: LLM | ReplicaPool, rows: Iterable[RowRequest | RowError], rows_total: int, layout: RecordLayout,
            output: Path, *, append: bool, skip_ids: set[str], failed_before: int, fingerprints: dict[str, str],
            window: int, reorder: bool, quiet: bool, log_interval: float, console: Console | None = None,
            metrics: tuple[Path | None, float] = (None, 10.0), max_tokens: int = 64) -> tuple[ExitCode, dict]:
    """Run every row into OUTPUT through one engine or the replicas of `source`; returns the exit code and the
    summary. `failed_before`: error records of earlier runs that stay in OUTPUT; `metrics`: the metrics file and
    its interval; `max_tokens`: the default of rows without their own (it bounds the ETA)."""
    from nanovllm import LLM
    from nanovllm_cli.display import ProgressDisplay
    from nanovllm_cli.job import BatchRunner, EngineFeeder, JobFailed, RunStats
    from nanovllm_cli.metrics import MetricsLog
    from nanovllm_cli.records import RecordBuilder
    from nanovllm_cli.writers import OutputWriteError, open_writer

    try:
        writer = open_writer(output, layout, append)
    except OSError as exc:
        raise o.fail(f"cannot write {output}: {exc.strerror or exc}") from None
    metrics_log = MetricsLog(*metrics, lambda: snapshot(stats, source, runner, max_tokens))
    stats = RunStats(rows_total=rows_total)
    display = ProgressDisplay(lambda: snapshot(stats, source, runner, max_tokens), quiet=quiet,
                              log_interval=log_interval, console=console)
    engine = EngineFeeder(source) if isinstance(source, LLM) else source

    def on_step() -> None:
        display.tick()
        metrics_log.tick()

    runner = BatchRunner(engine, writer, RecordBuilder(layout, source.info.model, fingerprints), stats,
                         window=window, reorder=reorder, skip_ids=skip_ids, on_step=on_step,
                         on_error=display.row_error)
    code = ExitCode.OK
    try:
        with display, metrics_log:
            runner.run(rows)
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except (JobFailed, OutputWriteError) as exc:
        typer.echo(f"error: {exc}", err=True)
        code = ExitCode.INTERNAL
    except Exception:  # noqa: BLE001 (a bug or an engine failure: keep what is written, say how to go on)
        traceback.print_exc()
        code = ExitCode.INTERNAL
    stats.ended = time.perf_counter()
    try:
        writer.close()
    except (OutputWriteError, OSError) as exc:  # e.g. a full disk while merging Parquet: the journal stays
        typer.echo(f"error: {exc}", err=True)
        code = ExitCode.INTERNAL
    if code == ExitCode.OK and (stats.rows_failed or failed_before):
        code = ExitCode.ROWS_FAILED
    if code in (ExitCode.INTERRUPTED, ExitCode.INTERNAL):
        typer.echo(stop_message(stats.rows_done, writer.records_kept, output), err=True)
    return code, {**build_summary(stats, source, output, layout, code), "records_written": writer.records_kept,
                  "rows_failed_before": failed_before}


def stop_message(rows_done: int, records_kept: int, output: Path) -> str:
    """What a stopped job leaves: never more records than OUTPUT holds."""
    if records_kept == rows_done:
        done = f"stopped after {rows_done} rows, their records in {output}"
    else:
        done = (f"stopped after {rows_done} rows, {records_kept or 'none'} of their records in {output} "
                "(writing failed)")
    return f"{done}; run again with --resume to finish"


def snapshot(stats: RunStats, source: LLM | ReplicaPool, runner: BatchRunner, max_tokens: int) -> Snapshot:
    """The live figures from the engine's report (with replicas: their merged one, and each one's)."""
    from nanovllm_cli.display import ReplicaProgress, Snapshot, eta_seconds

    report = source.report()
    metrics = report["kv_cache"]
    elapsed = stats.elapsed_s
    generated = report["tokens"]["generated"]
    rows_done = stats.rows_done + stats.rows_skipped
    left = runner.output_tokens_left(stats.completion_tokens / stats.rows_ok, max_tokens) if stats.rows_ok else None
    eta = eta_seconds(left, generated - stats.completion_tokens, generated / elapsed)
    if source.info.pooling is not None and stats.rows_done:  # a pooling job generates nothing: by its row rate
        eta = (stats.rows_total - rows_done) * elapsed / stats.rows_done
    replicas = [ReplicaProgress(r["index"], r["pid"], r["state"], r["rows"], r["outstanding"], r["generated_tokens"],
                                r["generated_tokens"] / elapsed, r["restarts"]) for r in report.get("replicas", ())]
    return Snapshot(
        rows_done=rows_done, rows_total=stats.rows_total, rows_failed=stats.rows_failed,
        rows_per_s=stats.rows_done / elapsed, output_tok_s=generated / elapsed, eta_s=eta,
        prefill_tok_s=report["tokens"]["prefill"] / elapsed, kv_cache_usage=metrics["kv_cache_usage"],
        prefix_hit_rate=metrics["prefix_cache"]["hit_rate"], elapsed_s=elapsed, generated_tokens=generated,
        completion_tokens=stats.completion_tokens, replicas=replicas or None, retries=report.get("retries"))


def build_summary(stats: RunStats, source: LLM | ReplicaPool, output: Path, layout: RecordLayout,
                  code: ExitCode) -> dict:
    """Job figures over the job's wall clock, the engine's cache metrics and its honest step statistics (with
    replicas: merged, and each replica's share under "replicas")."""
    elapsed = stats.elapsed_s
    report = source.report()
    replicas = {"data_parallel_size": len(report["replicas"]),
                "replicas": [{**r, "output_tok_s": r["completion_tokens"] / elapsed} for r in report["replicas"]],
                "retries": report["retries"]} if "replicas" in report else {}
    return {
        "output": str(output),
        "output_format": "openai" if layout.openai else "plain",
        "model": source.info.model,
        "rows_total": stats.rows_total,
        "rows_ok": stats.rows_ok,
        "rows_failed": stats.rows_failed,
        "rows_skipped": stats.rows_skipped,
        "prompt_tokens": stats.prompt_tokens,
        "cached_tokens": stats.cached_tokens,
        "completion_tokens": stats.completion_tokens,
        "prefix_hit_rate": stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0,
        "elapsed_s": elapsed,
        "rows_per_s": stats.rows_done / elapsed,
        "output_tok_s": stats.completion_tokens / elapsed,
        "prefill_tok_s": report["steps"]["prefill_tok_s"] or 0.0,  # over the steps' wall clock
        "exit_code": int(code),
        "kv_cache": report["kv_cache"],
        "engine": report["steps"],
        **replicas,
    }
