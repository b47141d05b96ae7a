"""`nanovllm inspect-cache`: what the KV / prefix cache will do with a prompt file; model config and tokenizer only."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from nanovllm_cli import options as o

if TYPE_CHECKING:
    from nanovllm.config import EngineConfig


def inspect_cache(
    input_path: Annotated[Path, typer.Argument(
        metavar="INPUT", help="Rows, as for `run`: .jsonl or .parquet.", exists=True, dir_okay=False,
        readable=True)],
    input_format: Annotated[str | None, typer.Option(help="jsonl | parquet (default: from the suffix).")] = None,
    model: o.Model = None,
    block_size: Annotated[int, typer.Option(help="KV-cache block size in tokens.")] = 16,
    num_blocks: Annotated[int | None, typer.Option(
        help="Cache size in blocks (default: what the configured memory would give).", min=1)] = None,
    kv_cache_gib: o.KvCacheGib = None,
    gpu_memory_utilization: o.GpuMemoryUtilization = None,
    dtype: o.Dtype = None,
    device: o.Device = None,
    max_model_len: o.MaxModelLen = None,
    window: Annotated[int, typer.Option(help="`run`'s read-ahead window, which prefix-aware order sorts.",
                                        min=1)] = 1024,
    top: Annotated[int, typer.Option(help="How many shared prefixes to list.", min=0)] = 5,
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as one JSON object on stdout.")] = False,
) -> None:
    """Dry run of the KV and prefix cache over INPUT: needs the model's config and tokenizer, no weights, no GPU.

    Rows are tokenized as `run` does (chat templates included) and replayed through the engine's block manager,
    one at a time, in file order and in `run`'s prefix-aware order. Reports rows, prompt tokens, blocks needed,
    unique vs shared blocks, the prefix-cache hit tokens and rate a cache of --num-blocks gives the prompts in
    each order, bytes per block, the most shared prefixes and a prompt-length histogram. Rows that `run` would
    reject are counted as failed. Exit code 0, or 2 for a usage error.
    """
    from nanovllm import PromptTokenizer
    from nanovllm.config import EngineConfig
    from nanovllm.loaders import resolve_model
    from nanovllm_cli.cache_analysis import CacheAnalysis
    from nanovllm_cli.readers import detect_format
    from nanovllm_cli.rows import RowError, RowParser
    from nanovllm_cli.tokenize import tokenized_rows

    try:
        fmt = detect_format(input_path, input_format)
        config = EngineConfig.from_kwargs(**o.engine_args(
            block_size=block_size, dtype=dtype, device=device, kv_cache_gib=kv_cache_gib,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len, load_format="dummy"))
        resolved = resolve_model(model, config.load_format)
        prompts = PromptTokenizer.for_model(resolved)
        memory = cache_memory(config, resolved.hf_config, num_blocks)
    except (ValueError, OSError) as exc:
        raise o.fail(str(exc)) from None

    hf = resolved.hf_config
    limit = config.max_model_len or hf.max_position_embeddings
    parser = RowParser({}, 0, "row" if fmt == "parquet" else "line")
    analysis = CacheAnalysis(block_size, memory["num_blocks"], window)
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

    report = {"input": str(input_path), "model": resolved.name, **memory, "rows": rows,
              "rows_ok": rows - len(errors), "rows_failed": len(errors), "errors": errors[:10],
              **analysis.report(top)}
    for prefix in report["top_prefixes"]:
        prefix["text"] = prefix_text(prefix.pop("token_ids"), prompts.tokenizer)
    if json_out:
        typer.echo(json.dumps(report))
    else:
        print_report(report)


def cache_memory(config: EngineConfig, hf: object, num_blocks: int | None) -> dict:
    """Bytes per KV block and the number of blocks: given, or what the engine's memory budget would give."""
    import torch

    from nanovllm.models.llama import kv_block_bytes

    device = config.resolve_device()
    itemsize = config.resolve_dtype(device).itemsize
    bytes_per_block = kv_block_bytes(hf, config.block_size, itemsize, hf.num_key_value_heads)
    if num_blocks is not None:
        source = "--num-blocks"
    elif device.type == "cpu":
        num_blocks, source = config.cpu_kv_cache_bytes // bytes_per_block, "the CPU KV budget (--kv-cache-gib)"
    else:
        from nanovllm.models.registry import model_class_for

        with torch.device("meta"):
            weights = sum(p.numel() for p in model_class_for(hf)(hf).parameters()) * itemsize
        total = torch.cuda.get_device_properties(device).total_memory
        num_blocks = max(int(total * config.gpu_memory_utilization - weights) // bytes_per_block, 1)
        source = "GPU memory x gpu_memory_utilization - weights (activations not counted: an upper bound)"
    return {"block_size": config.block_size, "dtype_bytes": itemsize, "bytes_per_block": bytes_per_block,
            "num_blocks": num_blocks, "num_blocks_source": source, "cache_bytes": num_blocks * bytes_per_block}


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
        ("block size / bytes per block", f"{report['block_size']} / {report['bytes_per_block']:,}"),
        ("cache", f"{report['num_blocks']:,} blocks = {gib:.2f} GiB ({report['num_blocks_source']})"),
        ("blocks needed (no sharing)", f"{report['blocks_needed']:,}"),
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
