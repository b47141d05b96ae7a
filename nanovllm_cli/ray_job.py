"""`nanovllm run --ray`: the job on a Ray cluster, with Ray Data: input files -> rows -> one engine per actor
(`LLMProcessor`) -> a directory of output shards.

INPUT is a file, a directory (its .jsonl/.ndjson/.parquet files, recursively) or a glob, at any URI fsspec opens
(s3://, gs://, a local path). The files are cut into parts of --window lines (Parquet: rows), each part a block of
its own, so that every engine gets work however few the files (Ray hands a whole block to one actor): a first pass
finds where each part starts (a JSONL file is read through once for it; a Parquet file's footer is enough), then each
part is read by a Ray task with `nanovllm run`'s reader, so line numbers and bad lines are as in `nanovllm run`.
OUTPUT is a directory of shards in the format its name ends with (`results.parquet/`, `results.jsonl/`), as Spark
writes.
"""
from __future__ import annotations

import glob
import itertools
import json
import math
import posixpath
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import typer

from nanovllm_cli import options as o
from nanovllm_cli.options import EngineOptions, ExitCode
from nanovllm_cli.ray_processor import (
    LABEL_COLUMN,
    NUMBER_COLUMN,
    PROBLEM_COLUMN,
    ROW_COLUMN,
    SOURCE_COLUMN,
    LLMProcessor,
    records_jsonl_datasink,
)
from nanovllm_cli.readers import FORMATS, InvalidJson, detect_format, drop_nulls, iter_rows
from nanovllm_cli.records import RecordLayout
from nanovllm_cli.rows import is_openai_row

OUTPUT_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
MAX_PARTS = 10_000  # beyond this, neighbouring parts of a file are merged (Ray's overhead per block)


@dataclass(frozen=True)
class InputFile:
    url: str  # what fsspec opens on any node
    source: str  # its name in row places and default ids ("" when the input is this one file)
    format: str  # "jsonl" | "parquet"


@dataclass(frozen=True)
class InputPart:
    """Lines (JSONL, blank ones included) or rows (Parquet) [first, first + count) of an input file, numbered from 1."""

    url: str
    source: str
    format: str
    first: int
    count: int
    offset: int = 0  # JSONL: the byte its first line starts at


@dataclass(frozen=True)
class RayJob:
    input: str
    output: str
    input_format: str | None
    engine: EngineOptions
    sampling: dict
    seed: int
    include_token_ids: bool
    reorder: bool
    window: int  # rows per batch handed to an engine
    replicas: int
    address: str | None
    overwrite: bool
    quiet: bool
    pooling: dict  # a pooling job's defaults (PoolingParams fields)


def list_input_files(uri: str, input_format: str | None) -> list[InputFile]:
    """The files INPUT names, sorted; raises ValueError when there are none or one's format is unknown."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    if glob.has_magic(root):
        paths, base = sorted(fs.glob(root)), root[:min(root.find(c) for c in "*?[" if c in root)].rpartition("/")[0]
    elif fs.isdir(root):
        wanted = set(FORMATS) if input_format is None else {input_format}
        paths, base = sorted(p for p in fs.find(root) if _format_of(p, None) in wanted
                             and not posixpath.basename(p).startswith((".", "_"))), root
    elif fs.isfile(root):
        paths, base = [root], None
    else:
        raise ValueError(f"{uri} is no file, directory or glob that matches a file")
    if not paths:
        raise ValueError(f"{uri} holds no .jsonl, .ndjson or .parquet file")
    files = []
    for path in paths:
        fmt = _format_of(path, input_format)
        if fmt is None:
            raise ValueError(f"cannot tell the format of {path} from its suffix: use --input-format jsonl|parquet")
        source = "" if len(paths) == 1 else posixpath.relpath(path, base) if base else path
        files.append(InputFile(fs.unstrip_protocol(path), source, fmt))
    return files


def _format_of(path: str, override: str | None) -> str | None:
    try:
        return detect_format(Path(path), override)
    except ValueError:
        return None


def file_parts(item: dict, size: int) -> Iterator[dict]:
    """An InputFile's parts of `size` lines or rows, as InputPart fields (flat_map)."""
    import fsspec
    import pyarrow.parquet as pq

    with fsspec.open(item["url"], "rb") as f:
        if item["format"] == "parquet":
            rows = pq.ParquetFile(f).metadata.num_rows
            for first in range(1, rows + 1, size):
                yield {**item, "first": first, "count": min(size, rows - first + 1), "offset": 0}
            return
        first, start = 1, 0  # the current part's first line and the byte it starts at
        offset = number = 0  # the byte the next line starts at; the lines read
        for number, line in enumerate(f, 1):
            if number - first == size:
                yield {**item, "first": first, "count": size, "offset": start}
                first, start = number, offset
            offset += len(line)
        if number >= first:
            yield {**item, "first": first, "count": number - first + 1, "offset": start}


def plan_parts(files: list[InputFile], size: int) -> list[InputPart]:
    """The parts of every file (found on the cluster, one task per file), in file order, at most MAX_PARTS."""
    import ray.data

    cut = (ray.data.from_items([vars(f) for f in files], override_num_blocks=len(files))
           .flat_map(file_parts, fn_kwargs={"size": size}, num_cpus=0).take_all())
    order = {f.url: i for i, f in enumerate(files)}
    return merge_parts(sorted((InputPart(**p) for p in cut), key=lambda p: (order[p.url], p.first)), MAX_PARTS)


def merge_parts(parts: list[InputPart], most: int) -> list[InputPart]:
    """`parts` (in file order) with neighbours of a file merged, as few at a time as leaves at most `most`."""
    merge = math.ceil(len(parts) / most)
    if merge <= 1:
        return parts
    merged = []
    for _, of_file in itertools.groupby(parts, key=lambda p: p.url):
        of_file = list(of_file)
        for i in range(0, len(of_file), merge):
            first, *rest = of_file[i:i + merge]
            merged.append(InputPart(first.url, first.source, first.format, first.first,
                                    first.count + sum(p.count for p in rest), first.offset))
    return merged


def part_values(f, part: dict) -> Iterator[tuple[int, object]]:
    """The numbered values of a part of the open file `f` (as `readers.iter_rows` gives a whole file's)."""
    if part["format"] == "jsonl":
        f.seek(part["offset"])
        for number, value in iter_rows(itertools.islice(f, part["count"]), "jsonl"):
            yield part["first"] - 1 + number, value
        return
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(f)
    before, groups = 0, []  # rows of the row groups skipped; the row groups to read
    for group in range(parquet.num_row_groups):
        rows = parquet.metadata.row_group(group).num_rows
        if groups or before + rows >= part["first"]:
            groups.append(group)
        else:
            before += rows
    last = part["first"] + part["count"] - 1
    number = before
    for batch in parquet.iter_batches(batch_size=1024, row_groups=groups):
        for row in batch.to_pylist():
            number += 1
            if number > last:
                return
            if number >= part["first"]:
                yield number, drop_nulls(row)


def part_rows(part: dict) -> Iterator[dict]:
    """A part's rows for the processor: JSON text with their file and number (flat_map)."""
    import fsspec

    label = "row" if part["format"] == "parquet" else "line"
    with fsspec.open(part["url"], "rb") as f:
        for number, value in part_values(f, part):
            invalid = isinstance(value, InvalidJson)
            yield {ROW_COLUMN: None if invalid else json.dumps(value, default=str),
                   PROBLEM_COLUMN: value.message if invalid else None, SOURCE_COLUMN: part["source"],
                   NUMBER_COLUMN: number, LABEL_COLUMN: label}


def read_rows(files: list[InputFile], size: int):
    """The rows of the files as a Ray dataset of `part_rows`, a block per part of `size` lines or rows.
    Reading takes no CPU of its own: the engines (one CPU each, or their GPUs) may hold every CPU of a small
    cluster, and a read waiting for one would wait forever."""
    import ray.data

    parts = plan_parts(files, size)
    return (ray.data.from_items([vars(p) for p in parts], override_num_blocks=max(len(parts), 1))
            .flat_map(part_rows, num_cpus=0))


def first_row_is_openai(files: list[InputFile]) -> bool:
    """The record layout, from the first object row (as `nanovllm run` decides it for its file)."""
    import fsspec

    for file in files:
        with fsspec.open(file.url, "rb") as f:
            for _, value in iter_rows(f, file.format):
                if isinstance(value, dict):
                    return is_openai_row(value)
    return False


def output_format(output: str) -> str:
    fmt = OUTPUT_FORMATS.get(posixpath.splitext(output.rstrip("/"))[1].lower())
    if fmt is None:
        raise ValueError(f"OUTPUT must be a directory named *.parquet or *.jsonl (its shards' format), not {output!r}")
    return fmt


def check_output(output: str, overwrite: bool, input_uri: str) -> None:
    """OUTPUT is a directory, empty or absent (or to be replaced), and not inside a directory INPUT (a later run
    would read its shards as input)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(output)
    if fs.isfile(path):
        raise ValueError(f"OUTPUT {output} is a file; with --ray OUTPUT is a directory of shards")
    in_fs, in_path = fsspec.core.url_to_fs(input_uri)
    if type(in_fs) is type(fs) and in_fs.isdir(in_path) and (path.rstrip("/") + "/").startswith(
            in_path.rstrip("/") + "/"):
        raise ValueError(f"OUTPUT {output} lies inside INPUT {input_uri}: its shards would be read as input by a "
                         "later run; write it elsewhere")
    if fs.isdir(path) and fs.ls(path) and not overwrite:
        raise ValueError(f"OUTPUT {output} already holds files: add --overwrite to replace them (--resume is not "
                         "supported with --ray)")


def ray_job(input_path: str, output: str | None, input_format: str | None, engine: EngineOptions, sampling: dict,
            seed: int, unsupported: dict[str, bool], **settings) -> dict:
    """`nanovllm run --ray`'s options checked (`unsupported`: option name -> whether it was given), then the job
    run; returns its summary (exit code included). `settings`: the other fields of `RayJob`."""
    from nanovllm import SamplingParams

    given = [name for name, value in unsupported.items() if value]
    if given:
        raise o.fail(f"not supported with --ray: {', '.join(given)}")
    if output is None:
        raise o.fail("--ray needs -o OUTPUT: a directory named *.parquet or *.jsonl (the format of its shards)")
    try:
        SamplingParams(**sampling)
    except ValueError as exc:
        raise o.fail(f"invalid sampling option: {exc}") from None
    try:
        import ray.data  # noqa: F401
    except ImportError:
        raise o.fail("--ray needs Ray Data: pip install 'nanovllm[ray]'") from None
    return run_on_ray(RayJob(input_path, output, input_format, engine, sampling, seed, **settings))


def run_on_ray(job: RayJob) -> dict:
    """Run the job; returns its summary, with the exit code of `nanovllm run`'s rules."""
    from nanovllm import pooling_spec

    try:
        out_format = output_format(job.output)
        files = list_input_files(job.input, job.input_format)
        check_output(job.output, job.overwrite, job.input)
        engine_args = job.engine.args()
        chat_template = job.engine.chat_template_text()
        openai = first_row_is_openai(files)
    except (ValueError, OSError) as exc:
        raise o.fail(str(exc)) from None
    try:
        spec = pooling_spec(job.engine.model, **engine_args)
    except (ValueError, OSError, ImportError, KeyError):
        spec = None  # a model this node cannot resolve generates here: the engines' nodes load it and say why
    import ray
    import ray.data

    started = time.perf_counter()
    if not ray.is_initialized():
        ray.init(address=job.address, include_dashboard=False, log_to_driver=not job.quiet)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = not job.quiet
    gpus = ray.cluster_resources().get("GPU", 0) > 0 and job.engine.device != "cpu"
    model = job.engine.model
    if model is not None and Path(model).expanduser().exists():
        model = str(Path(model).expanduser().resolve())  # the same path on every node
    layout = RecordLayout(openai=openai, include_token_ids=job.include_token_ids, task=spec.task if spec else None)
    records = (read_rows(files, job.window)
               .map_batches(LLMProcessor, batch_size=job.window, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=job.replicas),
                            num_gpus=(job.engine.tensor_parallel_size or 1) if gpus else 0,
                            fn_constructor_kwargs={"model": model, "engine_args": engine_args, "sampling": job.sampling,
                                                   "seed": job.seed, "openai": layout.openai,
                                                   "include_token_ids": layout.include_token_ids,
                                                   "reorder": job.reorder, "chat_template": chat_template,
                                                   "pooling": job.pooling}))
    mode = ray.data.SaveMode.OVERWRITE if job.overwrite else ray.data.SaveMode.APPEND
    try:
        if out_format == "parquet":
            records.write_parquet(job.output, mode=mode, ray_remote_args={"num_cpus": 0})  # no CPU: see read_rows
        else:
            records.write_datasink(records_jsonl_datasink(job.output, layout, mode=mode),
                                   ray_remote_args={"num_cpus": 0})
    except Exception as exc:  # noqa: BLE001 (an actor that could not start, an engine failure: Ray wraps them)
        typer.echo(f"error: the Ray job failed: {_cause(exc)}", err=True)
        typer.echo(f"the shards written so far are in {job.output}; rerun with --overwrite", err=True)
        raise typer.Exit(ExitCode.INTERNAL) from None
    counts = count_records(job.output, out_format, layout)
    elapsed = time.perf_counter() - started
    tokens = {name: counts.get(name) for name in ("prompt_tokens", "cached_tokens", "completion_tokens")}
    return {"input": job.input, "output": job.output, "output_format": "openai" if openai else "plain",
            "model": job.engine.model or "default", "input_files": len(files), "replicas": job.replicas,
            "rows_total": counts["rows_total"], "rows_ok": counts["rows_ok"], "rows_failed": counts["rows_failed"],
            "rows_skipped": 0, **tokens,
            "prefix_hit_rate": tokens["cached_tokens"] / tokens["prompt_tokens"] if tokens["prompt_tokens"] else None,
            "elapsed_s": elapsed, "rows_per_s": counts["rows_total"] / elapsed,
            # OpenAI records hold their token counts inside the response bodies: not summed here
            "output_tok_s": None if layout.openai or layout.task else tokens["completion_tokens"] / elapsed,
            "prefill_tok_s": None if layout.openai else tokens["prompt_tokens"] / elapsed,
            "exit_code": int(ExitCode.ROWS_FAILED if counts["rows_failed"] else ExitCode.OK)}


def _cause(exc: BaseException) -> str:
    """The root error of a Ray failure (a node lacking the model, a bad engine option, an engine failure) in one
    line. Ray Data raises the worker's error (for an actor that could not start, an ActorDiedError) whose text
    ends with the traceback's last line, "module.ErrorType: message"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    return re.sub(r"^(?:\w+\.)+(?=\w+: )", "", last)  # "package.module.ModelNotOnNode: ..." -> "ModelNotOnNode: ..."


def count_records(output: str, fmt: str, layout: RecordLayout) -> dict:
    """Rows answered and failed, and the token counts of plain records, read back from OUTPUT's shards (only
    those columns)."""
    import fsspec
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pajson
    import ray.data

    if layout.openai:  # an OpenAI record's token counts are inside its response body
        counts, fields = (), [("error", pa.struct([("code", pa.string()), ("message", pa.string())]))]
    else:  # a pooling job's records count no completion tokens
        counts = ("prompt_tokens", "cached_tokens") + (() if layout.task else ("completion_tokens",))
        fields = [("error", pa.string()), *((name, pa.int64()) for name in counts)]
    totals = dict.fromkeys(("rows_total", "rows_ok", "rows_failed", *counts), 0)
    fs, path = fsspec.core.url_to_fs(output)
    if not fs.isdir(path) or not fs.ls(path):  # no rows in, no shard out
        return totals
    if fmt == "parquet":
        shards = ray.data.read_parquet(output, num_cpus=0).select_columns([name for name, _ in fields])
    else:
        shards = ray.data.read_json(output, num_cpus=0, parse_options=pajson.ParseOptions(
            explicit_schema=pa.schema(fields), unexpected_field_behavior="ignore"))
    for batch in shards.iter_batches(batch_format="pyarrow"):
        failed = batch.num_rows - batch.column("error").null_count
        totals["rows_total"] += batch.num_rows
        totals["rows_failed"] += failed
        totals["rows_ok"] += batch.num_rows - failed
        for name in counts:
            totals[name] += pc.sum(batch.column(name)).as_py() or 0
    return totals
