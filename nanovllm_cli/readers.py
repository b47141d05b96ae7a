"""Input files, read one row at a time: JSONL (one JSON value per line), Parquet (one row per table row), CSV
(one row per record, its columns as the row's fields) or a Hugging Face `datasets` folder (`save_to_disk`).

Rows come out as (row number counting from 1, parsed value); a JSONL line that is not JSON comes out as
`InvalidJson`, so that it becomes an error record like any other bad row. Blank lines are skipped but still
counted, so row numbers are line numbers. A line nested deeper than MAX_DEPTH is invalid too: every later step
(checks, hashing, records) may then walk a row recursively. `limit` stops after that many rows.

A CSV cell is text. The text fields (`TEXT_COLUMNS`: ids, prompts, the user's strings) stay text; any other cell
is read as JSON when it parses as JSON (a number, `true`, an array such as a `messages` or `stop` cell), else kept as
text, and an empty cell is an absent field. A Parquet or datasets null is an absent field too.
"""
from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import BinaryIO

FORMATS = ("jsonl", "parquet", "csv", "datasets")
TABLE_FORMATS = ("parquet", "datasets")  # typed columns: the rows' fields keep their Arrow types
MAX_DEPTH = 128  # arrays and objects inside each other in one row (a JSON schema 32 levels deep needs about 70)
_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".csv": "csv"}
# CSV columns that are always text, even when a cell reads as a number ("007" and "42" are ids and prompts).
TEXT_COLUMNS = frozenset({"id", "custom_id", "prompt", "text", "text_1", "text_2", "query", "lora"})


@dataclass
class InvalidJson:
    message: str


def is_dataset_folder(path: Path) -> bool:
    """A folder written by `datasets`' save_to_disk (one split, or a dataset dict of splits)."""
    return path.is_dir() and any((path / name).is_file() for name in ("state.json", "dataset_dict.json"))


def detect_format(path: Path, override: str | None) -> str:
    """One of FORMATS: `override` when given, else from the suffix (a datasets folder by its files)."""
    if override is not None:
        if override not in FORMATS:
            raise ValueError(f"--input-format must be one of {', '.join(FORMATS)}, not {override!r}")
        return override
    if is_dataset_folder(path):
        return "datasets"
    fmt = _SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"cannot tell the format of {path.name} from its suffix: use --input-format "
                         f"{'|'.join(FORMATS)}")
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


def csv_cell(column: str, text: str) -> object:
    """A CSV cell as a row field's value (see the module docstring); None: the field is absent."""
    if text == "":
        return None
    if column in TEXT_COLUMNS:
        return text
    value = parse_line(text)
    return text if isinstance(value, InvalidJson) else value


def iter_rows(source: Path | BinaryIO, fmt: str, limit: int | None = None, split: str | None = None,
              ) -> Iterator[tuple[int, object]]:
    """The rows of a file, given by its path or as an open binary file (e.g. an fsspec one); `split` picks a
    datasets folder's split."""
    rows = _rows(source, fmt, split)
    return rows if limit is None else islice(rows, limit)


def _rows(source: Path | BinaryIO, fmt: str, split: str | None) -> Iterator[tuple[int, object]]:
    if fmt == "jsonl":
        with open(source, "rb") if isinstance(source, (str, os.PathLike)) else nullcontext(source) as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield number, parse_line(line)
        return
    if fmt == "csv":
        with open(source, "rb") if isinstance(source, (str, os.PathLike)) else nullcontext(source) as raw:
            text = io.TextIOWrapper(raw, encoding="utf-8-sig", newline="")
            for number, record in enumerate(csv.DictReader(text), 1):
                yield number, {k: v for k, v in ((k, csv_cell(k, v or "")) for k, v in record.items() if k is not None)
                               if v is not None}
        return
    batches = load_dataset_folder(source, split).data.to_batches(1024) if fmt == "datasets" else None
    if batches is None:
        import pyarrow.parquet as pq

        batches = pq.ParquetFile(source).iter_batches(batch_size=1024)
    number = 0
    for batch in batches:
        for row in batch.to_pylist():
            number += 1
            yield number, drop_nulls(row)


def load_dataset_folder(path: Path | str, split: str | None = None):
    """The `datasets.Dataset` of a save_to_disk folder (of a dataset dict: its one split, or `split`). Raises
    ValueError saying what to install or which split to pick."""
    try:
        import datasets
    except ImportError:
        raise ValueError("reading a Hugging Face datasets folder needs the datasets package: pip install datasets") \
            from None
    loaded = datasets.load_from_disk(str(path))
    return pick_split(loaded, split, str(path))


def pick_split(loaded, split: str | None, name: str):
    """A dataset, or the split of a dataset dict: `split`, else its only one."""
    if not hasattr(loaded, "keys"):  # one split already
        if split is not None:
            raise ValueError(f"{name} is a single split: drop --hf-split")
        return loaded
    splits = list(loaded.keys())
    if split is None and len(splits) == 1:
        split = splits[0]
    if split not in splits:
        raise ValueError(f"{name} has the splits {', '.join(splits)}: pick one with --hf-split" if split is None else
                         f"{name} has no split {split!r} (its splits: {', '.join(splits)})")
    return loaded[split]
