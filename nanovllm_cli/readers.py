"""Input files, read one row at a time: JSONL (one JSON value per line) or Parquet (one row per table row).

Rows come out as (row number counting from 1, parsed value); a JSONL line that is not JSON comes out as
`InvalidJson`, so that it becomes an error record like any other bad row. Blank lines are skipped but still
counted, so row numbers are line numbers. A line nested deeper than MAX_DEPTH is invalid too: every later step
(checks, hashing, records) may then walk a row recursively.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

FORMATS = ("jsonl", "parquet")
MAX_DEPTH = 128  # arrays and objects inside each other in one row (a JSON schema 32 levels deep needs about 70)
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}


@dataclass
class InvalidJson:
    message: str


def detect_format(path: Path, override: str | None) -> str:
    """'jsonl' or 'parquet': `override` when given, else from the suffix."""
    if override is not None:
        if override not in FORMATS:
            raise ValueError(f"--input-format must be one of {', '.join(FORMATS)}, not {override!r}")
        return override
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot tell the format of {path.name} from its suffix: use --input-format jsonl|parquet")
    return fmt


def nesting_depth(value: object) -> int:
    """How many arrays and objects deep `value` goes (iteratively: a hostile depth cannot overflow the stack)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def parse_line(line: bytes | str) -> object:
    """One JSONL line's value, or InvalidJson saying why it is none."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError; nesting past the stack
        return InvalidJson(f"invalid JSON: {exc}" if isinstance(exc, ValueError) else
                           f"invalid JSON: nested deeper than {MAX_DEPTH} levels")
    if nesting_depth(value) > MAX_DEPTH:
        return InvalidJson(f"invalid JSON: nested deeper than {MAX_DEPTH} levels")
    return value


def drop_nulls(value: object) -> object:
    """Parquet gives every row every column: a null is an absent field."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [drop_nulls(v) for v in value]
    return value


def iter_rows(source: Path | BinaryIO, fmt: str) -> Iterator[tuple[int, object]]:
    """The rows of a file, given by its path or as an open binary file (e.g. an fsspec one)."""
    if fmt == "jsonl":
        with open(source, "rb") if isinstance(source, (str, os.PathLike)) else nullcontext(source) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield number, parse_line(line)
        return
    import pyarrow.parquet as pq

    number = 0
    for batch in pq.ParquetFile(source).iter_batches(batch_size=1024):
        for row in batch.to_pylist():
            number += 1
            yield number, drop_nulls(row)
