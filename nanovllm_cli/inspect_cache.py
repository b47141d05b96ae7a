"""`nanovllm inspect-cache`: what the KV / prefix cache will do with a prompt file; model config and tokenizer only."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from nanovllm_cli import options as o
from nanovllm_cli.options import EngineOptions, with_engine_options


@with_engine_options("model", "revision", "block_size", "kv_cache_gib", "gpu_memory_utilization", "dtype",
                     "kv_cache_dtype", "device", "max_model_len", "chat_template", "tokenizer")
def inspect_cache(
    input_path: Annotated[Path, typer.Argument(
        metavar="INPUT", help="Rows, as for `run`: .jsonl or .parquet.", exists=True, dir_okay=False,
        readable=True)],
    input_format: Annotated[str | None, typer.Option(help="jsonl | parquet (default: from the suffix).")] = None,
    num_blocks: Annotated[int | None, typer.Option(
        help="Cache size in blocks (default: what the configured memory would give).", min=1)] = None,
    window: Annotated[int, typer.Option(help="`run`'s read-ahead window, which prefix-aware order sorts.",
                                        min=1)] = 1024,
    top: Annotated[int, typer.Option(help="How many shared prefixes to list.", min=0)] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object on stdout.")] = False,
    *,
    engine: EngineOptions,
) -> None:
    """Dry run of the KV and prefix cache over INPUT: needs the model's config and tokenizer, no weights, no GPU.

    Rows are tokenized as `run` does (chat templates included) and replayed through the engine's block manager,
    one at a time, in file order and in `run`'s prefix-aware order. Reports rows, prompt tokens, blocks needed,
    unique vs shared blocks, the prefix-cache hit tokens and rate a cache of --num-blocks gives the prompts in
    each order, bytes per block, the most shared prefixes and a prompt-length histogram. Rows that `run` would
    reject are counted as failed. Exit code 0, or 2 for a usage error.
    """
    from nanovllm import plan_kv_cache
    from nanovllm_cli.cache_analysis import CacheAnalysis
    from nanovllm_cli.preflight import PreflightError, scan_input
    from nanovllm_cli.readers import detect_format
    from nanovllm_cli.rows import RowError, RowParser
    from nanovllm_cli.tokenize import tokenized_rows

    try:
        fmt = detect_format(input_path, input_format)
        scan_input(input_path, fmt)
        plan = plan_kv_cache(engine.model, num_blocks, **engine.args())
    except (ValueError, OSError, PreflightError) as exc:
        raise o.fail(str(exc)) from None

    prompts, limit = plan.prompts, plan.max_model_len
    o.use_chat_template(engine, prompts)
    memory = {"block_size": plan.block_size, "kv_cache_dtype": plan.kv_cache_dtype, "dtype_bytes": plan.dtype_bytes,
              "bytes_per_block": plan.bytes_per_block,
              "num_blocks": plan.num_blocks, "num_blocks_source": plan.num_blocks_source,
              "cache_bytes": plan.cache_bytes, "kv_groups": len(plan.kv_windows)}
    parser = RowParser({}, 0, "row" if fmt == "parquet" else "line")
    analysis = CacheAnalysis(plan.block_size, memory["num_blocks"], window, plan.kv_windows)
    rows = 0
    errors: list[str] = []
    for row in tokenized_rows(input_path, fmt, parser, prompts):
        rows += 1
        if not isinstance(row, RowError) and len(row.token_ids) >= limit:
            row = RowError(row.id, row.where, f"prompt has {len(row.token_ids)} tokens, but max_model_len is {limit}")
        if isinstance(row, RowError):
            errors.append(row.message)
            continue
        analysis.add(row)

    report = {"input": str(input_path), "model": plan.model, **memory, "rows": rows,
              "rows_ok": rows - len(errors), "rows_failed": len(errors), "errors": errors[:10],
              **analysis.report(top)}
    for prefix in report["top_prefixes"]:
        prefix["text"] = prefix_text(prefix.pop("token_ids"), prompts.tokenizer)
    if json_out:
        typer.echo(json.dumps(report))
    else:
        print_report(report)


def prefix_text(token_ids: list[int], tokenizer: object | None, words: int = 12) -> str:
    if tokenizer is None:
        shown = " ".join(map(str, token_ids[:words]))
        return f"token ids {shown}" + (" ..." if len(token_ids) > words else "")
    split = tokenizer.decode(token_ids).split()
    return " ".join(split[:words]) + (" ..." if len(split) > words else "")


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console()
    head = Table(title=f"inspect-cache: {report['input']} on {report['model']}", show_header=False,
                 title_justify="left")
    head.add_column("figure", style="bold")
    head.add_column("value")
    gib = report["cache_bytes"] / (1 << 30)
    for label, value in [
        ("rows (ok / failed)", f"{report['rows']:,} ({report['rows_ok']:,} / {report['rows_failed']:,})"),
        ("prompt tokens (min / mean / max)",
         (f"{report['prompt_tokens']:,} ({report['prompt_tokens_min']} / {report['prompt_tokens_mean']:.1f} / "
          f"{report['prompt_tokens_max']})")),
        ("block size / bytes per block",
         f"{report['block_size']} / {report['bytes_per_block']:,} ({report['kv_cache_dtype']})"),
        ("cache", f"{report['num_blocks']:,} blocks = {gib:.2f} GiB ({report['num_blocks_source']})"),
        ("KV groups (blocks per token span)", f"{report['kv_groups']}"),
        ("blocks needed (no sharing, per group)", f"{report['blocks_needed']:,}"),
        ("unique / shared blocks", f"{report['unique_blocks']:,} / {report['shared_blocks']:,}"),
    ]:
        head.add_row(label, value)
    console.print(head)

    hits = Table(title="expected prefix-cache hits (prompts only, one row at a time)", title_justify="left")
    for column in ("order", "hit tokens", "hit rate", "evictions", "rows larger than the cache"):
        hits.add_column(column, justify="left" if column == "order" else "right")
    for name in ("file_order", "prefix_aware"):
        r = report[name]
        hits.add_row(name.replace("_", " "), f"{r['hit_tokens']:,}", f"{r['hit_rate']:.1%}", f"{r['evictions']:,}",
                     f"{r['rows_not_fitting']:,}")
    console.print(hits)

    if report["top_prefixes"]:
        table = Table(title="most shared prefixes", title_justify="left")
        for column in ("rows", "tokens", "starts with"):
            table.add_column(column, justify="right" if column != "starts with" else "left")
        for p in report["top_prefixes"]:
            table.add_row(f"{p['rows']:,}", f"{p['tokens']:,}", p["text"])
        console.print(table)

    if report["histogram"]:
        table = Table(title="prompt lengths", title_justify="left")
        for column in ("tokens", "rows", ""):
            table.add_column(column, justify="right" if column else "left")
        peak = max(b["rows"] for b in report["histogram"])
        for b in report["histogram"]:
            table.add_row(f"{b['min_tokens']}-{b['max_tokens']}", f"{b['rows']:,}", "#" * round(30 * b["rows"] / peak))
        console.print(table)
    for message in report["errors"]:
        console.print(Text.assemble(("row error ", "red"), message))
