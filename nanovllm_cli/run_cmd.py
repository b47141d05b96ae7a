"""`nanovllm run`: a completion for every row of a JSONL / Parquet file, streamed into OUTPUT as rows finish."""
from __future__ import annotations

import json
import signal
import time
import traceback
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanovllm_cli import options as o
from nanovllm_cli.options import ExitCode

if TYPE_CHECKING:  # the engine imports torch: not needed for `--help`
    from nanovllm import LLM
    from nanovllm_cli.display import Snapshot
    from nanovllm_cli.records import RecordLayout
    from nanovllm_cli.rows import RowError, RowRequest
    from nanovllm_cli.runner import RunStats

IO = "Input and output"


def run(
    input_path: Annotated[Path, typer.Argument(
        metavar="INPUT", help="Rows to run: .jsonl or .parquet.", exists=True, dir_okay=False, readable=True)],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="Results: .jsonl or .parquet (default: INPUT-stem.results.jsonl beside INPUT).",
        rich_help_panel=IO)] = None,
    input_format: Annotated[str | None, typer.Option(
        help="jsonl | parquet (default: from the suffix).", rich_help_panel=IO)] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Skip the ids already in OUTPUT (cutting a torn last line) and add the rest. "
        "Without it OUTPUT is replaced.", rich_help_panel=IO)] = False,
    include_token_ids: Annotated[bool, typer.Option(
        "--include-token-ids", help="Add prompt_token_ids and token_ids to each result.",
        rich_help_panel=IO)] = False,
    reorder: Annotated[bool, typer.Option(
        "--reorder/--no-reorder", help="Prefix-aware admission inside the read-ahead window, or file order.",
        rich_help_panel=IO)] = True,
    window: Annotated[int, typer.Option(
        help="Rows read ahead of the engine: the reordering window, and what bounds memory.", min=1,
        rich_help_panel=IO)] = 1024,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No progress and no summary table (errors still go to stderr).",
        rich_help_panel=IO)] = False,
    json_summary: Annotated[bool, typer.Option(
        "--json", help="Print the summary as one JSON object on stdout.", rich_help_panel=IO)] = False,
    log_interval: Annotated[float, typer.Option(
        help="Seconds between progress lines when stderr is not a terminal.", rich_help_panel=IO)] = 10.0,
    model: o.Model = None,
    dtype: o.Dtype = None,
    max_model_len: o.MaxModelLen = None,
    max_num_seqs: o.MaxNumSeqs = None,
    max_num_batched_tokens: o.MaxNumBatchedTokens = None,
    gpu_memory_utilization: o.GpuMemoryUtilization = None,
    tensor_parallel_size: o.TensorParallelSize = None,
    enforce_eager: o.EnforceEager = False,
    no_fused_ops: o.NoFusedOps = False,
    load_format: o.LoadFormat = None,
    block_size: o.BlockSize = None,
    no_prefix_caching: o.NoPrefixCaching = False,
    async_scheduling: o.Async = False,
    num_kv_blocks: o.NumKvBlocks = None,
    kv_cache_gib: o.KvCacheGib = None,
    device: o.Device = None,
    attention_backend: o.AttentionBackend = None,
    max_tokens: o.MaxTokens = 64,
    temperature: o.Temperature = 0.0,
    top_p: o.TopP = 1.0,
    top_k: o.TopK = -1,
    min_p: o.MinP = 0.0,
    seed: o.Seed = 0,
    stop: o.Stop = None,
    ignore_eos: o.IgnoreEos = False,
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
    and every other row still runs.

    **Exit codes**: 0 every row succeeded; 1 some rows failed (their error records are written, every other row
    answered); 2 usage error (nothing run); 3 internal error mid-job; 130 interrupted. After 3 or 130, or a
    kill, run again with --resume.
    """
    from nanovllm import SamplingParams
    from nanovllm_cli.readers import count_rows, detect_format, first_object, iter_rows
    from nanovllm_cli.records import RecordLayout
    from nanovllm_cli.rows import RowParser, is_openai_row
    from nanovllm_cli.writers import OutputError, resume_ids

    output = output or input_path.with_name(f"{input_path.stem}.results.jsonl")
    if output.suffix.lower() not in (".jsonl", ".parquet"):
        raise o.fail(f"OUTPUT must end in .jsonl or .parquet, not {output.name!r}")
    if output.resolve() == input_path.resolve():
        raise o.fail("OUTPUT must not be INPUT")
    try:
        fmt = detect_format(input_path, input_format)
        layout = RecordLayout(openai=is_openai_row(first_object(input_path, fmt)),
                              include_token_ids=include_token_ids)
        rows_total = count_rows(input_path, fmt)
    except (ValueError, OSError) as exc:
        raise o.fail(f"cannot read {input_path}: {exc}") from None
    defaults = {"max_tokens": max_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k,
                "min_p": min_p, "stop": stop or [], "ignore_eos": ignore_eos}
    try:
        SamplingParams(**defaults)
    except ValueError as exc:
        raise o.fail(f"invalid sampling option: {exc}") from None
    try:
        done_ids = resume_ids(output, layout) if resume else set()
    except (OutputError, OSError) as exc:
        raise o.fail(str(exc)) from None

    llm = o.load_llm(model, o.engine_args(
        dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, gpu_memory_utilization=gpu_memory_utilization,
        tensor_parallel_size=tensor_parallel_size, enforce_eager=enforce_eager, no_fused_ops=no_fused_ops,
        load_format=load_format,
        block_size=block_size, no_prefix_caching=no_prefix_caching, async_scheduling=async_scheduling,
        num_kv_blocks=num_kv_blocks, kv_cache_gib=kv_cache_gib, device=device,
        attention_backend=attention_backend, seed=seed))
    parser = RowParser(defaults, seed, "row" if fmt == "parquet" else "line")
    rows = (parser.parse(number, row) for number, row in iter_rows(input_path, fmt))
    with llm:
        code, summary = run_job(llm, rows, rows_total, layout, output, append=resume, skip_ids=done_ids,
                                window=window, reorder=reorder, quiet=quiet, log_interval=log_interval)
    summary = {"input": str(input_path), **summary}
    if not quiet:
        from nanovllm_cli.display import print_summary

        print_summary(summary)
    if json_summary:
        typer.echo(json.dumps(summary))
    raise typer.Exit(code)


def run_job(llm: LLM, rows: Iterable[RowRequest | RowError], rows_total: int, layout: RecordLayout, output: Path, *,
            append: bool, skip_ids: set[str], window: int, reorder: bool, quiet: bool,
            log_interval: float) -> tuple[ExitCode, dict]:
    """Run every row into OUTPUT; returns the exit code and the summary."""
    from nanovllm_cli.display import ProgressDisplay
    from nanovllm_cli.records import RecordBuilder
    from nanovllm_cli.runner import BatchRunner, RunStats
    from nanovllm_cli.writers import open_writer

    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        writer = open_writer(output, layout, append)
    except OSError as exc:
        raise o.fail(f"cannot write {output}: {exc}") from None
    stats = RunStats(rows_total=rows_total)
    display = ProgressDisplay(lambda: snapshot(stats, llm), quiet=quiet, log_interval=log_interval)
    runner = BatchRunner(llm, writer, RecordBuilder(layout, llm.model_name), stats, window=window,
                         reorder=reorder, skip_ids=skip_ids, on_step=display.tick)
    code = ExitCode.OK
    previous_sigterm = signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends it like Ctrl-C
    try:
        with display:
            runner.run(rows)
    except KeyboardInterrupt:
        code = ExitCode.INTERRUPTED
    except Exception:  # noqa: BLE001 (a bug or an engine failure: keep what is written, say how to go on)
        traceback.print_exc()
        code = ExitCode.INTERNAL
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
    stats.ended = time.perf_counter()
    try:
        writer.close()
    except Exception:  # noqa: BLE001 (e.g. a full disk while merging Parquet: the journal stays for --resume)
        traceback.print_exc()
        code = ExitCode.INTERNAL
    if code == ExitCode.OK and stats.rows_failed:
        code = ExitCode.ROWS_FAILED
    if code in (ExitCode.INTERRUPTED, ExitCode.INTERNAL):
        typer.echo(f"stopped after {stats.rows_done} rows, all written to {output}; run again with --resume "
                   "to finish", err=True)
    return code, build_summary(stats, llm, output, layout, code)


def snapshot(stats: RunStats, llm: LLM) -> Snapshot:
    from nanovllm_cli.display import Snapshot

    metrics = llm.get_metrics()
    elapsed = stats.elapsed_s
    return Snapshot(
        rows_done=stats.rows_done + stats.rows_skipped, rows_total=stats.rows_total, rows_failed=stats.rows_failed,
        rows_per_s=stats.rows_done / elapsed, output_tok_s=stats.completion_tokens / elapsed,
        prefill_tok_s=llm.stats.prefill_tokens / elapsed, kv_cache_usage=metrics["kv_cache_usage"],
        prefix_hit_rate=metrics["prefix_cache"]["hit_rate"], elapsed_s=elapsed)


def build_summary(stats: RunStats, llm: LLM, output: Path, layout: RecordLayout, code: ExitCode) -> dict:
    """Job figures over the job's wall clock, the engine's cache metrics and its honest step statistics."""
    elapsed = stats.elapsed_s
    return {
        "output": str(output),
        "output_format": "openai" if layout.openai else "plain",
        "model": llm.model_name,
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
        "prefill_tok_s": llm.stats.prefill_tokens / elapsed,
        "exit_code": int(code),
        "kv_cache": llm.get_metrics(),
        "engine": llm.get_stats(),
    }
