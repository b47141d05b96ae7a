"""Checks made before the model loads, so that a whole-file mistake costs one message and no model load: the
input is readable and of its declared format, its ids are unique, and OUTPUT can be written, is not the input,
is not being written by another run (an OS lock held for the whole job) and is not replaced by accident."""
from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from nanovllm_cli.pooling_rows import POOLING_INPUT_COLUMNS, PoolingRowParser
from nanovllm_cli.readers import TABLE_FORMATS, iter_rows, load_dataset_folder
from nanovllm_cli.records import carried_type, inferred_type, json_kind
from nanovllm_cli.rows import (
    PLAIN_ROW_KEYS,
    PROMPT_KEYS,
    is_openai_row,
    needs_tokenizer,
    own_fields,
    row_fingerprint,
    row_id,
)
from nanovllm_cli.writers import Answered, journal_path, work_files

SAMPLE_ROWS = 100  # a JSONL file without one object in its first SAMPLE_ROWS rows is not JSON Lines of rows
MAX_CARRIED_FIELDS = 1024  # distinct own fields of the rows a Parquet OUTPUT can take as columns


class PreflightError(Exception):
    """The job cannot start; the message says why and names the file."""


@dataclass
class InputScan:
    rows: int
    openai: bool  # the rows are OpenAI batch request lines
    duplicates: list[tuple[str, int, int]] = field(default_factory=list)  # (id, first number, later number)
    fingerprints: dict[str, str] = field(default_factory=dict)  # id -> content hash of its row
    # The rows' own fields (carried to their records), in order of appearance: a Parquet input's column types, or
    # the JSON kinds of a JSONL input's values (records.inferred_type).
    parquet_types: dict[str, object] = field(default_factory=dict)
    json_kinds: dict[str, set[str]] = field(default_factory=dict)
    too_many_fields: bool = False  # more than MAX_CARRIED_FIELDS distinct ones (no longer counted)
    first_text_row: int | None = None  # the number of the first row given as text (which needs a tokenizer)
    token_budget: int = 0  # the most tokens the rows may generate (scan_input's `token_budget` of each row)

    def passthrough(self, own_fields: frozenset[str]) -> tuple[tuple[str, object], ...]:
        """(name, Arrow type) of the carried fields a Parquet OUTPUT gets as columns (not those named as a record's
        own fields: the record keeps its own)."""
        if self.parquet_types:
            return tuple((name, carried_type(t)) for name, t in self.parquet_types.items() if name not in own_fields)
        return tuple((name, inferred_type(kinds)) for name, kinds in self.json_kinds.items() if name not in own_fields)

    def clashes(self, own_fields: frozenset[str]) -> list[str]:
        """The carried fields named as a record's own."""
        return [name for name in (self.parquet_types or self.json_kinds) if name in own_fields]


def _table_schema(path: Path, fmt: str, split: str | None):
    """The Arrow schema of a Parquet file or a datasets folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).schema_arrow if fmt == "parquet" else load_dataset_folder(path, split).data.schema
    except (OSError, ValueError, pa.ArrowException) as exc:
        what = "a readable Parquet file" if fmt == "parquet" else "a readable datasets folder"
        raise PreflightError(f"{path} is not {what}: {exc}") from None


def _csv_columns(path: Path) -> list[str]:
    import csv

    try:
        with open(path, encoding="utf-8-sig", newline="") as f:
            return next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise PreflightError(f"{path} is not a readable CSV file: {exc}") from None


def _check_columns(path: Path, columns: list[str], pooling: bool) -> None:
    """A table's rows need an input column: without one, every row would fail alike."""
    inputs = {*PROMPT_KEYS, "body", *(POOLING_INPUT_COLUMNS if pooling else ())}
    if not inputs & set(columns):
        also = " (nor 'text', 'text_1' or 'query')" if pooling else ""
        raise PreflightError(f"{path} has no 'prompt', 'messages', 'prompt_token_ids' or 'body' column{also} "
                             f"(its columns: {', '.join(columns) or 'none'})")


def input_label(fmt: str) -> str:
    """What a row of this format is called in messages: JSONL counts lines, the others rows."""
    return "line" if fmt == "jsonl" else "row"


def scan_input(path: Path, fmt: str, pooling: bool = False, limit: int | None = None, split: str | None = None,
               token_budget: Callable[[object], int] | None = None) -> InputScan:
    """One pass over INPUT (its first `limit` rows): its rows, their layout and repeated ids (and the sum of each
    row's `token_budget`). Raises PreflightError when the file as a whole is not what its format says (no single
    row could be read as a row). `pooling`: the rows of a pooling job, whose input columns count too
    (pooling_rows.py)."""
    schema = _table_schema(path, fmt, split) if fmt in TABLE_FORMATS else None
    if schema is not None or fmt == "csv":
        _check_columns(path, schema.names if schema is not None else _csv_columns(path), pooling)
    label = input_label(fmt)
    row_keys = PoolingRowParser.plain_row_keys if pooling else PLAIN_ROW_KEYS  # the rest are the rows' own
    first_of: dict[str, int] = {}
    scan = InputScan(rows=0, openai=is_openai_row(dict.fromkeys(schema.names)) if schema else False)
    if schema is not None:
        scan.parquet_types = {name: schema.field(name).type for name in own_fields(dict.fromkeys(schema.names), row_keys)}
    seen_object, first_problem = schema is not None, None
    try:
        for number, value in iter_rows(path, fmt, limit, split):
            scan.rows += 1
            if scan.first_text_row is None and needs_tokenizer(value):
                scan.first_text_row = number
            if token_budget is not None:
                scan.token_budget += token_budget(value)
            if not seen_object:
                if isinstance(value, dict):
                    seen_object, scan.openai = True, is_openai_row(value)
                elif scan.rows <= SAMPLE_ROWS:
                    first_problem = first_problem or (number, value)
                else:
                    break
            if schema is None and not scan.too_many_fields:
                for name, item in own_fields(value, row_keys).items():
                    kinds = scan.json_kinds.setdefault(name, set())
                    if item is not None:
                        kinds.add(json_kind(item))
                scan.too_many_fields = len(scan.json_kinds) > MAX_CARRIED_FIELDS
            rid = row_id(number, value)
            if rid in first_of:
                scan.duplicates.append((rid, first_of[rid], number))
            else:
                first_of[rid] = number
                scan.fingerprints[rid] = row_fingerprint(value)
    except OSError as exc:
        raise PreflightError(f"cannot read {path}: {exc.strerror or exc}") from None
    if scan.rows and not seen_object:
        number, value = first_problem
        what = getattr(value, "message", None) or f"a JSON {type(value).__name__}, not an object"
        raise PreflightError(f"{path} is not JSON Lines (one JSON object per line): no row in its first "
                             f"{min(scan.rows, SAMPLE_ROWS)} {label}s is an object ({label} {number}: {what})")
    return scan


def duplicates_message(scan: InputScan, label: str, most: int = 5) -> str:
    shown = "; ".join(f"{rid!r} at {label}s {a} and {b}" for rid, a, b in scan.duplicates[:most])
    more = f" (and {len(scan.duplicates) - most} more)" if len(scan.duplicates) > most else ""
    return (f"INPUT repeats ids: {shown}{more}. Every row needs its own id (a row without one is known by its "
            f"{label} number)")


def _existing_ancestor(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def prepare_output_dir(output: Path) -> None:
    ancestor = _existing_ancestor(output.parent)
    if not ancestor.is_dir():
        raise PreflightError(f"cannot write {output}: {ancestor} is a file, not a folder")
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PreflightError(f"cannot create the folder {output.parent}: {exc.strerror or exc}") from None
    if not os.access(output.parent, os.W_OK | os.X_OK):
        raise PreflightError(f"cannot write {output}: no write permission in {output.parent}")


def check_output_kind(output: Path) -> None:
    """OUTPUT, and each file the job writes beside it, is a regular file or absent once symbolic links are followed:
    a FIFO would block the job, a device (/dev/null, /dev/full) would take or refuse every record silently."""
    for path in (output, *work_files(output)):
        if path.exists() and not path.is_file() and not path.is_dir():
            kind = ("a FIFO" if path.is_fifo() else "a character device" if path.is_char_device() else
                    "a block device" if path.is_block_device() else "a socket" if path.is_socket() else "not a file")
            target = f" (a link to {path.resolve()})" if path.is_symlink() else ""
            raise PreflightError(f"OUTPUT {output}: {path}{target} is {kind}; OUTPUT must be a regular file, or not "
                                 "exist yet")


def check_not_input(output: Path, input_path: Path, lock_path: Path) -> None:
    """Neither OUTPUT nor a file the job writes beside it (its lock, journal, temporary copies) is INPUT under any
    name (same device and inode): writing it would destroy the rows. Check before the lock is taken."""
    if output.exists() and os.path.samefile(output, input_path):
        raise PreflightError(f"OUTPUT must not be INPUT: {output} is the same file as {input_path}")
    for path in (lock_path, *work_files(output)):
        if path.exists() and os.path.samefile(path, input_path):
            raise PreflightError(f"OUTPUT must not be INPUT: the job writes {path} beside OUTPUT {output}, and that "
                                 f"is the same file as {input_path}; choose another OUTPUT")


def check_output(output: Path, *, resume: bool, overwrite: bool) -> None:
    """OUTPUT is writable and is replaced only when asked to."""
    if output.exists():
        if output.is_dir():
            raise PreflightError(f"OUTPUT {output} is a folder")
        if not os.access(output, os.W_OK):
            raise PreflightError(f"cannot write {output}: no write permission")
    journal = journal_path(output)
    has_results = (output.exists() and output.stat().st_size > 0) or (
        output.suffix.lower() == ".parquet" and journal.exists())
    if has_results and not resume and not overwrite:
        raise PreflightError(f"OUTPUT {output} already holds results: add --resume to answer only the rows it "
                             "lacks, or --overwrite to replace it")


def stale_records(answered: Answered, fingerprints: dict[str, str], partial: bool = False) -> set[str]:
    """Ids of OUTPUT's records whose row changed since (another fingerprint) or is no longer in INPUT. `partial`:
    `fingerprints` has only some of INPUT's rows (--limit), so a record without its row there is not stale."""
    return {rid for rid, old in answered.fingerprints.items()
            if (rid not in fingerprints and not partial)
            or (rid in fingerprints and old is not None and old != fingerprints[rid])}


def stale_message(output: Path, answered: Answered, fingerprints: dict[str, str], partial: bool = False) -> str:
    stale = stale_records(answered, fingerprints, partial)
    removed = sorted(r for r in stale if r not in fingerprints)
    changed = sorted(r for r in stale if r in fingerprints)
    parts = [f"{len(ids)} {what} (e.g. {ids[0]!r})" for ids, what in (
        (changed, "rows changed since they were answered"), (removed, "records answer rows no longer in INPUT")) if ids]
    return (f"OUTPUT {output} does not match INPUT: {' and '.join(parts)}. Add --sync to rerun the changed rows and "
            "drop the records of removed ones, or choose another OUTPUT")


class OutputLockedError(PreflightError):
    pass


class OutputLock:
    """An exclusive OS lock (flock) on `OUTPUT.lock`, held while the job writes OUTPUT; the file holds the pid of
    its holder. The lock goes with the process, however it ends; the file is removed on release. It lies beside
    the file OUTPUT names after symbolic links are followed, so two names of one OUTPUT share one lock."""

    def __init__(self, output: Path):
        real = output.resolve()
        self.output = output
        self.path = real.with_name(real.name + ".lock")
        self.fd: int | None = None

    def acquire(self) -> None:
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise OutputLockedError(f"OUTPUT {self.output} is being written by another run "
                                        f"(pid {holder}); wait for it to end or choose another OUTPUT") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:  # else the holder removed the file between our open and our lock: lock the new one
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        if self.fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self.fd)
            self.fd = None

    def __enter__(self) -> OutputLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
