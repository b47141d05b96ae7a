"""`nanovllm run`: a completion for every row of a JSONL / Parquet file, streamed into OUTPUT as rows finish."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
import traceback
from collections.abc import Iterable
from pathlib import Path, PurePosixPath
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
    from nanovllm_cli.locations import InputLocation, OutputLocation
    from nanovllm_cli.preflight import InputScan, OutputLock
    from nanovllm_cli.progress import RecentRates, Stages, TokenBudget
    from nanovllm_cli.records import RecordLayout
    from nanovllm_cli.replicas import ReplicaPool
    from nanovllm_cli.rows import RowError, RowRequest
    from nanovllm_cli.writers import Answered, Writer

IO = "Input and output"
LONG = "Long jobs"
RAY = "Ray cluster"


@interruptible
@with_engine_options()
def run(
    input_path: Annotated[str, typer.Argument(
        metavar="INPUT", help="Rows to run: .jsonl, .parquet or .csv, a Hugging Face datasets folder (save_to_disk), "
        "'-' for stdin, or a URL fsspec opens (s3://, gs://, ...); with --ray also a directory or a glob.")],
    output: Annotated[str | None, typer.Option(
        "--output", "-o", help="Results: .jsonl or .parquet, '-' for JSONL on stdout, or a URL (uploaded when the "
        "job ends). Default: beside INPUT, prompts.jsonl -> prompts.results.jsonl, prompts.parquet -> "
        "prompts.results.parquet, another name + .results.jsonl; stdout for stdin. With --ray a directory of shards "
        "named *.parquet or *.jsonl.", rich_help_panel=IO)] = None,
    input_format: Annotated[str | None, typer.Option(
        help="jsonl | parquet | csv | datasets (default: from the suffix; datasets with a Hub id as INPUT loads that "
        "dataset).", rich_help_panel=IO)] = None,
    hf_split: Annotated[str | None, typer.Option(
        help="The split of a datasets INPUT that has several.", rich_help_panel=IO)] = None,
    limit: Annotated[int | None, typer.Option(
        help="Run only the first N rows of INPUT (a quick check).", min=1, rich_help_panel=IO)] = None,
    ordered: Annotated[bool, typer.Option(
        "--ordered", help="Write the records in INPUT's order (finished rows wait for the ones before them; at most "
        "--window records are held).", rich_help_panel=IO)] = False,
    error_file: Annotated[str | None, typer.Option(
        metavar="FILE", help="Write the failed rows' records into this .jsonl file (the Batch API's error file) "
        "instead of OUTPUT.", rich_help_panel=IO)] = None,
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
    temperature: o.Temperature = None,
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
    from nanovllm_cli.locations import STDIO

    sampling = {"max_tokens": max_tokens, "top_p": top_p, "top_k": top_k, "min_p": min_p, "stop": stop or [],
                "ignore_eos": ignore_eos}
    if temperature is not None:  # given: it applies to OpenAI lines too (else they take OpenAI's default, 1)
        sampling["temperature"] = temperature
    for name, value in (("--log-interval", log_interval), ("--metrics-interval", metrics_interval)):
        if not (math.isfinite(value) and value > 0):
            raise o.fail(f"{name} must be a positive number of seconds, not {value}")
    if ray or ray_address is not None or ray_replicas is not None:
        from nanovllm_cli.ray_job import ray_job

        unsupported = {"--ray-address/--ray-replicas without --ray": not ray,
                       "--data-parallel-size (use --ray-replicas)": engine.data_parallel_size > 1,
                       "--lora-modules": bool(engine.lora_modules), "--limit": limit is not None,
                       "--ordered": ordered, "--error-file": error_file is not None, "--hf-split": hf_split is not None,
                       "INPUT or OUTPUT '-' (stdin, stdout)": STDIO in (input_path, output),
                       "--served-model-name": engine.served_model_name is not None}
        summary = ray_job(input_path, output, input_format, engine, sampling, seed, unsupported,
                          include_token_ids=include_token_ids, reorder=reorder, window=window,
                          replicas=ray_replicas or 1, address=ray_address, overwrite=overwrite, quiet=quiet,
                          resume=resume or retry_failed or sync, retry_failed=retry_failed, sync=sync,
                          log_interval=log_interval, metrics_file=metrics_file, metrics_interval=metrics_interval,
                          max_restarts=max_restarts, pooling={"dimensions": dimensions})
        finish(summary, quiet, json_summary)
    if output == STDIO and json_summary:
        raise o.fail("-o - writes the records on stdout: drop --json (the summary table goes to stderr)")
    job = JobOptions(resume=resume or retry_failed or sync, retry_failed=retry_failed, sync=sync,
                     overwrite=overwrite, include_token_ids=include_token_ids, drop_columns=drop_columns,
                     reorder=reorder, window=window, quiet=quiet, log_interval=log_interval, limit=limit,
                     ordered=ordered, error_file=error_file, dimensions=dimensions, metrics_file=metrics_file,
                     metrics_interval=metrics_interval, max_restarts=max_restarts)
    summary = run_local(input_path, output, input_format, hf_split, engine, sampling, seed, job)
    finish(summary, quiet, json_summary)


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """`run`'s options for a job in this process (one engine or its replicas)."""

    resume: bool  # --resume, or implied by --retry-failed / --sync
    retry_failed: bool
    sync: bool
    overwrite: bool
    include_token_ids: bool
    drop_columns: bool
    reorder: bool
    window: int
    quiet: bool
    log_interval: float
    limit: int | None
    ordered: bool
    error_file: str | None
    dimensions: int | None
    metrics_file: Path | None
    metrics_interval: float
    max_restarts: int


def run_local(input_name: str, output_name: str | None, input_format: str | None, hf_split: str | None,
              engine: EngineOptions, sampling: dict, seed: int, job: JobOptions) -> dict:
    """The job in this process: INPUT and OUTPUT located (stdin / stdout, URLs, Hub datasets: locations.py),
    checked, the model loaded, every row run into OUTPUT; returns the summary."""
    from rich.console import Console

    from nanovllm_cli.display import notice

    console = Console(stderr=True)
    replicas = None
    if engine.data_parallel_size > 1:  # started first, before this process imports the engine (replica_start.py):
        from nanovllm_cli.replica_start import spawn_engine_replicas  # they load while it reads and checks the files

        replicas = spawn_engine_replicas(engine, seed, max_restarts=job.max_restarts,
                                         on_event=lambda message: notice(console, message))
    try:
        from nanovllm_cli.locations import open_input, open_output
        from nanovllm_cli.progress import loading

        with loading(job.quiet) as stage:
            stage("reading INPUT")
            try:
                source_in = open_input(input_name, input_format, hf_split)
            except (ValueError, OSError) as exc:
                raise o.fail(str(exc)) from None
            try:
                try:
                    target = open_output(output_name or source_in.default_output(), resume=job.resume,
                                         overwrite=job.overwrite)
                except ValueError as exc:
                    raise o.fail(str(exc)) from None
                try:
                    return checked_job(source_in, target, engine, sampling, seed, job, stage, console, replicas)
                finally:
                    target.close()
            finally:
                source_in.close()
    finally:
        if replicas is not None:  # stopped however the job ends (a failed check included)
            replicas.close()


def checked_job(source_in: InputLocation, target: OutputLocation, engine: EngineOptions, sampling: dict, seed: int,
                job: JobOptions, stage: Stages, console: Console, replicas: ReplicaPool | None) -> dict:
    """The whole-file checks (before the model loads; `replicas`, the data-parallel replicas, are already
    starting), then the job."""
    from nanovllm import SamplingParams
    from nanovllm_cli.lora_modules import LoRAModules
    from nanovllm_cli.metrics import check_writable
    from nanovllm_cli.pooling_rows import PoolingRowParser
    from nanovllm_cli.preflight import OutputLock, PreflightError, duplicates_message, input_label, scan_input
    from nanovllm_cli.progress import TokenBudget, declared_budget, startup_line
    from nanovllm_cli.readers import iter_rows
    from nanovllm_cli.rows import RowParser

    output = target.path
    if output is not None and output.suffix.lower() not in (".jsonl", ".parquet"):
        raise o.fail(f"OUTPUT must end in .jsonl or .parquet, not {PurePosixPath(target.name).name!r}")
    error_file = Path(job.error_file) if job.error_file is not None else None
    if error_file is not None and (error_file.suffix.lower() != ".jsonl" or "://" in job.error_file):
        raise o.fail(f"--error-file must be a local .jsonl file (OpenAI's error file is JSON Lines), not "
                     f"{job.error_file!r}")
    stage("resolving the model")
    model = o.model_source(engine)
    pooling = model.pooling if model is not None else None
    task = pooling.task if pooling is not None else None
    stage("checking INPUT")
    input_path, fmt = source_in.path, source_in.fmt
    try:
        scan = scan_input(input_path, fmt, pooling=task is not None, limit=job.limit, split=source_in.split,
                          token_budget=lambda row: declared_budget(row, sampling["max_tokens"]))
    except ValueError as exc:
        raise o.fail(f"cannot read {source_in.name}: {exc}") from None
    except PreflightError as exc:
        raise o.fail(str(exc)) from None
    label = input_label(fmt)
    if scan.duplicates:
        raise o.fail(duplicates_message(scan, label))
    if scan.rows == 0:
        typer.echo(f"{source_in.name} has no rows: nothing to do", err=True)
        raise typer.Exit(ExitCode.OK)
    if model is not None and not model.has_tokenizer and scan.first_text_row is not None:
        raise o.fail(f"INPUT gives text ({label} {scan.first_text_row} is the first such row) but the model "
                     f"{model.name} has no tokenizer: give the rows as prompt_token_ids, add --tokenizer PATH, or "
                     "use a model with a tokenizer")
    try:
        SamplingParams(**sampling)
    except ValueError as exc:
        raise o.fail(f"invalid sampling option: {exc}") from None
    try:
        lora = LoRAModules.parse(engine.lora_modules) if engine.lora_modules else None
        engine.chat_template_text()
    except ValueError as exc:
        raise o.fail(str(exc)) from None
    embedding_size = None
    if task == "embed" and output is not None and output.suffix.lower() == ".parquet":  # one fixed-size column
        embedding_size = job.dimensions or pooling.output_size
    layout = record_layout(scan, output, job.include_token_ids, job.drop_columns, task, embedding_size)
    try:
        check_writable(job.metrics_file)
    except OSError as exc:
        raise o.fail(f"cannot write --metrics-file {job.metrics_file}: {exc.strerror or exc}") from None
    locks = [OutputLock(path) for path in (output, error_file) if path is not None and target.remote is None]
    try:
        answered = prepare_outputs(target, error_file, input_path, layout, locks, scan.fingerprints, job)
        stage("loading the model" + (f" ({engine.data_parallel_size} replicas)" if engine.data_parallel_size > 1
                                     else ""), log=True)
        if replicas is not None:
            from nanovllm_cli.replica_start import ready_replicas

            source = ready_replicas(replicas, engine)
        else:
            source = o.load_llm(engine, seed)
        with source:
            stage.done(startup_line(source.info.startup_s))
            try:
                lora = lora and lora.with_base_names(engine.model, source.info.model, engine.served_model_name)
            except ValueError as exc:
                raise o.fail(str(exc)) from None
            parser = RowParser(sampling, seed, label, lora=lora) if task is None \
                else PoolingRowParser(seed, label, task, {"dimensions": job.dimensions})
            budget = TokenBudget(scan.token_budget, layout.id_key, answered.ids, sampling["max_tokens"])
            rows = (parser.parse(number, row) for number, row in budget.rows(
                iter_rows(input_path, fmt, job.limit, source_in.split)))
            code, summary = run_job(source, rows, scan.rows, layout, target, error_file, budget, answered,
                                    scan.fingerprints, job, engine.served_model_name, console)
    finally:
        for lock in locks:
            lock.release()
    return {"input": source_in.name, **summary}


def record_layout(scan: InputScan, output: Path | None, include_token_ids: bool, drop_columns: bool, task: str | None,
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
    if output is not None and output.suffix.lower() == ".parquet":
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


def prepare_outputs(target: OutputLocation, error_file: Path | None, input_path: Path, layout: RecordLayout,
                    locks: list[OutputLock], fingerprints: dict[str, str], job: JobOptions) -> Answered:
    """Lock OUTPUT (and the --error-file) and check them (see `preflight`); returns what earlier runs answered
    (with --resume: the records of both files), the records to answer again already dropped: failed rows' with
    --retry-failed, with --sync the records of rows changed or removed since (without --sync those are an error).
    stdout needs no check: nothing is read back from it."""
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

    files = [path for path in (target.path, error_file) if path is not None]
    try:
        if error_file is not None and target.path is not None and error_file.resolve() == target.path.resolve():
            raise PreflightError(f"--error-file {error_file} is OUTPUT: give the failed rows a file of their own")
        for path in files:
            prepare_output_dir(path)
            check_output_kind(path)
            lock = next((lock for lock in locks if lock.output == path), None)
            check_not_input(path, input_path, lock.path if lock else path.with_name(path.name + ".lock"))
            if lock is not None:
                lock.acquire()
            check_output(path, resume=job.resume, overwrite=job.overwrite)
        answered = Answered()
        if job.resume:
            for path in files:
                answered |= resume_ids(path, layout)
        retried = answered.failed if job.retry_failed else set()
        kept = answered.without(retried)
        stale = stale_records(kept, fingerprints, partial=job.limit is not None)
        if stale and not job.sync:
            raise PreflightError(stale_message(files[0], kept, fingerprints, partial=job.limit is not None))
        for path in files:
            drop_records(path, layout, retried | stale)
        answered = kept.without(stale)
    except (PreflightError, OutputError) as exc:
        raise o.fail(str(exc)) from None
    except OSError as exc:
        raise o.fail(f"cannot use {target.name}: {exc.strerror or exc}") from None
    return answered


def open_writers(target: OutputLocation, error_file: Path | None, layout: RecordLayout, append: bool) -> Writer:
    """The writer of OUTPUT (stdout's for -o -), the failed rows' records split off into --error-file."""
    from nanovllm_cli.writers import JsonlWriter, SplitWriter, StreamWriter, open_writer

    try:
        writer = StreamWriter(sys.stdout) if target.stdout else open_writer(target.path, layout, append)
        if error_file is not None:
            writer = SplitWriter(writer, JsonlWriter(error_file, append))
    except OSError as exc:
        raise o.fail(f"cannot write {target.name}: {exc.strerror or exc}") from None
    return writer


def run_job(source: LLM | ReplicaPool, rows: Iterable[RowRequest | RowError], rows_total: int, layout: RecordLayout,
            target: OutputLocation, error_file: Path | None, budget: TokenBudget, answered: Answered,
            fingerprints: dict[str, str], job: JobOptions, served_model_name: str | None,
            console: Console | None = None) -> tuple[ExitCode, dict]:
    """Run every row into OUTPUT through one engine or the replicas of `source`; returns the exit code and the
    summary. `answered`: the records earlier runs left in OUTPUT (skipped; their errors count); `budget`: the
    tokens the rows may still generate (it bounds the ETA)."""
    from nanovllm import LLM
    from nanovllm_cli.display import ProgressDisplay
    from nanovllm_cli.job import BatchRunner, EngineFeeder, JobFailed, RunStats
    from nanovllm_cli.metrics import MetricsLog
    from nanovllm_cli.ordering import OrderedEngine, OrderedWriter
    from nanovllm_cli.progress import RecentRates, RecordTap
    from nanovllm_cli.records import RecordBuilder
    from nanovllm_cli.writers import OutputWriteError

    writer = open_writers(target, error_file, layout, job.resume)
    stats = RunStats(rows_total=rows_total)
    rates = RecentRates()
    rates.update(*rate_counters(source))  # the job's start: the first line's rates count from it
    metrics_log = MetricsLog(job.metrics_file, job.metrics_interval, lambda: snapshot(stats, source, runner, budget, rates))
    display = ProgressDisplay(lambda: snapshot(stats, source, runner, budget, rates), quiet=job.quiet,
                              log_interval=job.log_interval, console=console)
    engine = EngineFeeder(source) if isinstance(source, LLM) else source
    if job.ordered:
        writer = OrderedWriter(writer, layout.id_key)
        rows = writer.rows(rows, answered.ids)
        engine = OrderedEngine(engine, writer, job.window)

    def on_step() -> None:
        display.tick()
        metrics_log.tick()

    model_name = served_model_name or source.info.model  # as records and the summary name it
    records = RecordBuilder(layout, model_name, fingerprints, source.prompts)
    runner = BatchRunner(engine, RecordTap(writer, budget.answered), records, stats, window=job.window,
                         reorder=job.reorder, skip_ids=answered.ids, on_step=on_step, on_error=display.row_error)
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
        target.upload()
    except (OutputWriteError, OSError, ValueError) as exc:  # a full disk while merging Parquet, a failed upload
        typer.echo(f"error: {exc}", err=True)
        code = ExitCode.INTERNAL
    failed_before = len(answered.failed)
    if code == ExitCode.OK and (stats.rows_failed or failed_before):
        code = ExitCode.ROWS_FAILED
    if code in (ExitCode.INTERRUPTED, ExitCode.INTERNAL):
        typer.echo(stop_message(stats.rows_done, writer.records_kept, target), err=True)
    summary = build_summary(stats, source, target.name, model_name, layout, code)
    return code, {**summary, "records_written": writer.records_kept, "rows_failed_before": failed_before}


def stop_message(rows_done: int, records_kept: int, target: OutputLocation) -> str:
    """What a stopped job leaves: never more records than OUTPUT holds."""
    where = target.name if target.remote is None else f"{target.path} (not uploaded to {target.remote})"
    if records_kept == rows_done:
        done = f"stopped after {rows_done} rows, their records in {where}"
    else:
        done = (f"stopped after {rows_done} rows, {records_kept or 'none'} of their records in {where} "
                "(writing failed)")
    if target.stdout or target.remote is not None:
        return f"{done}; run the rows without a record again"
    return f"{done}; run again with --resume to finish"


def rate_counters(source: LLM | ReplicaPool, report: dict | None = None) -> tuple[float, ...]:
    """What the job's recent rates follow: generated and prefill tokens, then each replica's generated tokens by
    index (0 before it is spawned), so that over the same window the replicas' rates add up to the job's."""
    report = report or source.report()
    per_replica = [0] * len(getattr(source, "replicas", ()))
    for replica in report.get("replicas", ()):
        per_replica[replica["index"]] = replica["generated_tokens"]
    return report["tokens"]["generated"], report["tokens"]["prefill"], *per_replica


def snapshot(stats: RunStats, source: LLM | ReplicaPool, runner: BatchRunner, budget: TokenBudget,
             rates: RecentRates) -> Snapshot:
    """The live figures from the engine's report (with replicas: their merged one, and each one's): rates over
    the recent window, the ETA within the bound of what the rows may still generate (progress.py)."""
    from nanovllm_cli.display import ReplicaProgress, Snapshot, eta_seconds
    from nanovllm_cli.progress import bounded_eta

    report = source.report()
    metrics = report["kv_cache"]
    elapsed = stats.elapsed_s
    generated = report["tokens"]["generated"]
    output_tok_s, prefill_tok_s, *replica_tok_s = rates.update(*rate_counters(source, report))
    rows_done = stats.rows_done + stats.rows_skipped
    in_flight = generated - stats.completion_tokens
    left = runner.output_tokens_left(stats.completion_tokens / stats.rows_ok, budget.default_max_tokens) \
        if stats.rows_ok else None
    eta, bound = bounded_eta(eta_seconds(left, in_flight, output_tok_s), budget.left(in_flight), output_tok_s)
    if source.info.pooling is not None and stats.rows_done:  # a pooling job generates nothing: by its row rate
        eta, bound = (stats.rows_total - rows_done) * elapsed / stats.rows_done, None
    replicas = [ReplicaProgress(r["index"], r["pid"], r["state"], r["rows"], r["outstanding"], r["generated_tokens"],
                                replica_tok_s[r["index"]], r["restarts"]) for r in report.get("replicas", ())]
    return Snapshot(
        rows_done=rows_done, rows_total=stats.rows_total, rows_failed=stats.rows_failed,
        rows_per_s=stats.rows_done / elapsed, output_tok_s=output_tok_s, eta_s=eta, eta_bound_s=bound,
        prefill_tok_s=prefill_tok_s, kv_cache_usage=metrics["kv_cache_usage"],
        prefix_hit_rate=metrics["prefix_cache"]["hit_rate"], elapsed_s=elapsed, generated_tokens=generated,
        completion_tokens=stats.completion_tokens, replicas=replicas or None, retries=report.get("retries"))


def build_summary(stats: RunStats, source: LLM | ReplicaPool, output: str, model: str, layout: RecordLayout,
                  code: ExitCode) -> dict:
    """Job figures over the job's wall clock, the engine's cache metrics and its honest step statistics (with
    replicas: merged, and each replica's share under "replicas")."""
    elapsed = stats.elapsed_s
    report = source.report()
    replicas = {"data_parallel_size": len(report["replicas"]),
                "replicas": [{**r, "output_tok_s": r["completion_tokens"] / elapsed} for r in report["replicas"]],
                "retries": report["retries"]} if "replicas" in report else {}
    return {
        "output": output,
        "output_format": "openai" if layout.openai else "plain",
        "model": model,
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
