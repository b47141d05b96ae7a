"""The input of `nanovllm run --ray`: INPUT's files, cut into parts, and a part's rows.

INPUT is a file, a directory (its .jsonl/.ndjson/.parquet files, recursively) or a glob, at any URI fsspec opens
(s3://, gs://, a local path). Each file is cut into parts of --window lines (Parquet: rows), each a task for one
engine: a first pass on the cluster (one task per file) finds where each part starts (a JSONL file is read through
once for it; a Parquet file's footer is enough), leaving out the lines committed shards answer already. A part's
rows are read with `nanovllm run`'s reader, so line numbers and bad lines are as in `nanovllm run`. A file's
version (its size and ETag or modification time) tells a resumed job whether its shards are stale.
"""
from __future__ import annotations

import glob
import itertools
import math
import posixpath
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from nanovllm_cli.readers import FORMATS, detect_format, drop_nulls, iter_rows
from nanovllm_cli.rows import is_openai_row
from nanovllm_cli.shards import file_version

MAX_PARTS = 10_000  # beyond this, neighbouring parts of a file are merged (a shard and a manifest per part)


@dataclass(frozen=True)
class InputFile:
    url: str  # what fsspec opens on any node
    source: str  # its name in row places and default ids ("" when the input is this one file)
    format: str  # "jsonl" | "parquet"
    version: str = ""  # its size and ETag or modification time: a shard of an older version is stale


@dataclass(frozen=True)
class InputPart:
    """Lines (JSONL, blank ones included) or rows (Parquet) [first, first + count) of an input file, numbered from 1."""

    url: str
    source: str
    format: str
    first: int
    count: int
    offset: int = 0  # JSONL: the byte its first line starts at


def list_input_files(uri: str, input_format: str | None) -> list[InputFile]:
    """The files INPUT names, sorted; raises ValueError when there are none or one's format is unknown."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(uri)
    if glob.has_magic(root):
        found, base = fs.glob(root, detail=True), root[:min(root.find(c) for c in "*?[" if c in root)].rpartition("/")[0]
    elif fs.isdir(root):
        wanted = set(FORMATS) if input_format is None else {input_format}
        found, base = {p: info for p, info in fs.find(root, detail=True).items() if _format_of(p, None) in wanted
                       and not posixpath.basename(p).startswith((".", "_"))}, root
    elif fs.isfile(root):
        found, base = {root: fs.info(root)}, None
    else:
        raise ValueError(f"{uri} is no file, directory or glob that matches a file")
    paths = sorted(p for p, info in found.items() if info.get("type", "file") == "file")
    if not paths:
        raise ValueError(f"{uri} holds no .jsonl, .ndjson or .parquet file")
    files = []
    for path in paths:
        fmt = _format_of(path, input_format)
        if fmt is None:
            raise ValueError(f"cannot tell the format of {path} from its suffix: use --input-format jsonl|parquet")
        source = "" if len(paths) == 1 else posixpath.relpath(path, base) if base else path
        files.append(InputFile(fs.unstrip_protocol(path), source, fmt, file_version(found[path])))
    return files


def _format_of(path: str, override: str | None) -> str | None:
    try:
        return detect_format(Path(path), override)
    except ValueError:
        return None


def file_parts(item: dict, size: int, covered: list[tuple[int, int]] = ()) -> list[dict]:
    """An InputFile's parts of at most `size` lines or rows, as InputPart fields, leaving out the `covered`
    (first, count) ranges: those that committed shards answer."""
    import fsspec
    import pyarrow.parquet as pq

    fields = {"url": item["url"], "source": item["source"], "format": item["format"]}
    done = sorted(covered)
    parts = []
    with fsspec.open(item["url"], "rb") as f:
        if item["format"] == "parquet":
            rows, start = pq.ParquetFile(f).metadata.num_rows, 1
            for first, count in [*done, (rows + 1, 0)]:  # the gaps between covered ranges
                for begin in range(start, min(first, rows + 1), size):
                    parts.append({**fields, "first": begin, "count": min(size, first - begin), "offset": 0})
                start = max(start, first + count)
            return parts
        ranges = iter(done)
        skip = next(ranges, None)  # the next covered range
        current = None  # [first, count, offset] of the part being cut
        offset = 0
        for number, line in enumerate(f, 1):
            while skip is not None and number >= skip[0] + skip[1]:
                skip = next(ranges, None)
            if skip is not None and number >= skip[0]:
                current = None
            else:
                if current is None or current[1] == size:
                    current = [number, 0, offset]
                    parts.append(current)
                current[1] += 1
            offset += len(line)
    return [{**fields, "first": first, "count": count, "offset": start} for first, count, start in parts]


def plan_parts(files: list[InputFile], size: int, covered: dict[str, list[tuple[int, int]]]) -> list[InputPart]:
    """The parts of every file not `covered` (found on the cluster, one task per file), in file order, at most
    about MAX_PARTS."""
    import ray

    task = ray.remote(num_cpus=0)(file_parts)  # no CPU: the engines may hold every CPU of a small cluster
    found = ray.get([task.remote(vars(f), size, covered.get(f.url, [])) for f in files])
    return merge_parts([InputPart(**p) for parts in found for p in parts], MAX_PARTS)


def merge_parts(parts: list[InputPart], most: int) -> list[InputPart]:
    """`parts` (in file order) with contiguous neighbours of a file merged, as few at a time as leaves at most
    `most` (a resumed job's parts, cut around the committed ones, merge only where they touch)."""
    merge = math.ceil(len(parts) / most)
    if merge <= 1:
        return parts
    merged: list[InputPart] = []
    for _, of_file in itertools.groupby(parts, key=lambda p: p.url):
        run = 0
        for part in of_file:
            last = merged[-1] if merged and run else None
            if last is not None and run < merge and last.url == part.url and last.first + last.count == part.first:
                merged[-1] = InputPart(last.url, last.source, last.format, last.first, last.count + part.count,
                                       last.offset)
                run += 1
            else:
                merged.append(part)
                run = 1
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


def first_row_is_openai(files: list[InputFile]) -> bool:
    """The record layout, from the first object row (as `nanovllm run` decides it for its file)."""
    import fsspec

    for file in files:
        with fsspec.open(file.url, "rb") as f:
            for _, value in iter_rows(f, file.format):
                if isinstance(value, dict):
                    return is_openai_row(value)
    return False
