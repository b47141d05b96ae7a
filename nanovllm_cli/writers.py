"""Durable, resumable output: JSONL appended record by record, or Parquet through a JSONL journal.

Every record is flushed to the OS as soon as it is written (a killed process loses nothing already written)
and fsync'ed within `FSYNC_INTERVAL_S` and at close (a crashed machine loses at most that much). A kill can cut
the last line short; `resume_ids` cuts such a torn line off and returns the ids of the complete records.

Parquet cannot be appended to, so rows go to the journal `OUTPUT.journal.jsonl` while the job runs and `close`
merges OUTPUT's earlier rows (when resuming) and the journal into a temporary file that atomically replaces
OUTPUT; then the journal is removed. The merged file records the journal's size and hash in its metadata, so
a journal left behind by a crash between the replace and the removal is recognised as merged and dropped.

A write that fails mid-job (a full disk, OUTPUT's folder removed) raises OutputWriteError naming OUTPUT and the
cause; `records_kept` says how many of this run's records OUTPUT holds (none when the file was removed or
replaced under the job, which each fsync checks).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import xxhash

from nanovllm_cli.records import RecordLayout, record_line

FSYNC_INTERVAL_S = 2.0
MERGED_JOURNAL_KEY = b"nanovllm.merged_journal"


class OutputError(Exception):
    """OUTPUT cannot be resumed as it is (the user must choose another file or fix this one)."""


class OutputWriteError(OSError):
    """Writing OUTPUT failed mid-job; the message names the file and the cause."""


@dataclass
class Answered:
    """The ids OUTPUT has a record for, of those the ids whose record is an error, and the fingerprint of the
    input row each record answered (None in records written before fingerprints were)."""

    ids: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    fingerprints: dict[str, str | None] = field(default_factory=dict)

    def add(self, record_id: str, error: object, fingerprint: str | None) -> None:
        self.ids.add(record_id)
        self.fingerprints[record_id] = fingerprint
        if error is not None:
            self.failed.add(record_id)

    def __ior__(self, other: Answered) -> Answered:
        self.ids |= other.ids
        self.failed |= other.failed
        self.fingerprints.update(other.fingerprints)
        return self

    def without(self, ids: set[str]) -> Answered:
        return Answered(self.ids - ids, self.failed - ids, {k: v for k, v in self.fingerprints.items() if k not in ids})


def journal_path(path: Path) -> Path:
    return path.with_name(path.name + ".journal.jsonl")


def temp_path(path: Path) -> Path:
    """Where a new version of `path` is written before it atomically replaces `path`."""
    return path.with_name(path.name + ".tmp")


def work_files(path: Path) -> list[Path]:
    """The files a job writes or replaces beside OUTPUT: its temporary copies and a Parquet OUTPUT's journal."""
    if not is_parquet(path):
        return [temp_path(path)]
    journal = journal_path(path)
    return [temp_path(path), journal, temp_path(journal)]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_jsonl_ids(path: Path, id_key: str) -> Answered:
    """Ids of the records of a JSONL output, after cutting a torn last line (one without its newline)."""
    ids = Answered()
    if not path.exists():
        return ids
    with open(path, "rb+") as f:
        complete = 0
        for number, line in enumerate(f, 1):
            if not line.endswith(b"\n"):
                break
            complete += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids.add(str(record[id_key]), record["error"], record.get("input_fingerprint"))
            except (ValueError, KeyError, TypeError):
                raise OutputError(f"{path} line {number} is not a result record with {id_key!r}: it was not "
                                  "written by a job of this kind; choose another OUTPUT or drop --resume") from None
        if complete < os.fstat(f.fileno()).st_size:
            f.truncate(complete)
            os.fsync(f.fileno())
    return ids


class JsonlWriter:
    """Appends one JSON line per record: flushed at once, fsync'ed within `fsync_interval` and at close. Each fsync
    also checks that `path` still names the file written (not removed or replaced under the job)."""

    def __init__(self, path: Path, append: bool, fsync_interval: float = FSYNC_INTERVAL_S):
        self.path = path
        self.file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.fsync_interval = fsync_interval
        self.unsynced_since: float | None = None
        self.written = 0  # records of this run handed to the OS
        self.lost = False  # the file written is no longer `path`: its records are not in OUTPUT
        self.failed = False

    @property
    def records_kept(self) -> int:
        """This run's records that `path` holds (as far as a failed write lets one know: those before it)."""
        return 0 if self.lost else self.written

    def write(self, record: dict) -> None:
        line = record_line(record)
        try:
            self.file.write(line)
            self.file.flush()
        except OSError as exc:
            raise self._failure(exc) from None
        self.written += 1
        if self.unsynced_since is None:
            self.unsynced_since = time.monotonic()

    def sync_if_due(self) -> None:
        if self.unsynced_since is not None and time.monotonic() - self.unsynced_since >= self.fsync_interval:
            self._sync()

    def _sync(self) -> None:
        try:
            os.fsync(self.file.fileno())
            same = os.path.samestat(os.stat(self.path), os.fstat(self.file.fileno()))
        except FileNotFoundError:
            same = False
        except OSError as exc:
            raise self._failure(exc) from None
        if not same:
            self.lost = self.failed = True
            raise OutputWriteError(f"cannot write {self.path}: it was removed or replaced while the job wrote it "
                                   f"(this run's {self.written} records went with it)")
        self.unsynced_since = None

    def _failure(self, exc: OSError) -> OutputWriteError:
        self.failed = True
        return OutputWriteError(f"cannot write {self.path}: {exc.strerror or exc}")

    def close(self) -> None:
        if self.file.closed:
            return
        if self.failed:  # what could be written is; closing flushes the rest of a failed write, which fails again
            try:
                self.file.close()
            except OSError:
                pass
            return
        try:
            self._sync()
        finally:
            try:
                self.file.close()
            except OSError as exc:
                raise self._failure(exc) from None
        try:
            _fsync_dir(self.path)
        except OSError as exc:
            raise self._failure(exc) from None


def _journal_marker(path: Path) -> str:
    digest = xxhash.xxh64()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return f"{path.stat().st_size}:{digest.hexdigest()}"


def _merged_marker(path: Path) -> str | None:
    import pyarrow.parquet as pq

    metadata = pq.read_schema(path).metadata or {}
    marker = metadata.get(MERGED_JOURNAL_KEY)
    return marker.decode() if marker else None


def read_parquet_ids(path: Path, layout: RecordLayout) -> Answered:
    """Ids in a Parquet OUTPUT and its journal; drops a journal that is already merged into OUTPUT."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    journal = journal_path(path)
    ids = Answered()
    if path.exists() and path.stat().st_size:  # an empty file holds no records
        try:
            schema = pq.read_schema(path)
        except (OSError, pa.ArrowException) as exc:
            raise OutputError(f"{path} is not a Parquet file ({exc}); choose another OUTPUT or drop --resume") from None
        if not schema.remove_metadata().equals(layout.arrow_schema()):
            raise OutputError(f"{path} has other columns than this job writes (another input kind, or "
                              "--include-token-ids differs); choose another OUTPUT or drop --resume")
        if journal.exists() and _merged_marker(path) == _journal_marker(journal):
            journal.unlink()
        for batch in pq.ParquetFile(path).iter_batches(columns=[layout.id_key, "error", "input_fingerprint"]):
            for record_id, error, fingerprint in zip(*(column.to_pylist() for column in batch.columns)):
                ids.add(str(record_id), error, fingerprint)
    ids |= read_jsonl_ids(journal, layout.id_key)
    return ids


class ParquetWriter:
    """Records go to the journal while the job runs; `close` merges them into OUTPUT."""

    BATCH_ROWS = 4096

    def __init__(self, path: Path, layout: RecordLayout, append: bool, fsync_interval: float = FSYNC_INTERVAL_S):
        self.path = path
        self.layout = layout
        if not append:
            path.unlink(missing_ok=True)
        self.journal = JsonlWriter(journal_path(path), append, fsync_interval)

    def write(self, record: dict) -> None:
        self.journal.write(record)

    def sync_if_due(self) -> None:
        self.journal.sync_if_due()

    @property
    def records_kept(self) -> int:
        """This run's records in the journal, which `--resume` merges into OUTPUT when `close` could not."""
        return self.journal.records_kept

    def close(self) -> None:
        self.journal.close()
        if self.journal.failed:
            return  # the journal stays for --resume
        try:
            self._merge()
        except OSError as exc:
            raise OutputWriteError(f"cannot write {self.path}: {exc.strerror or exc} (the journal "
                                   f"{self.journal.path} keeps this run's records for --resume)") from None

    def _merge(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self.layout.arrow_schema()
        marked = schema.with_metadata({MERGED_JOURNAL_KEY: _journal_marker(self.journal.path).encode()})
        tmp = temp_path(self.path)
        with pq.ParquetWriter(tmp, marked) as out:
            if self.path.exists() and self.path.stat().st_size:  # the records of earlier runs (--resume)
                for batch in pq.ParquetFile(self.path).iter_batches(batch_size=self.BATCH_ROWS):
                    out.write_table(pa.Table.from_batches([batch]).cast(marked))
            rows: list[dict] = []
            with open(self.journal.path, "rb") as f:
                for line in f:
                    if line.strip():
                        rows.append(self.layout.parquet_row(json.loads(line)))
                    if len(rows) >= self.BATCH_ROWS:
                        out.write_table(pa.Table.from_pylist(rows, schema=marked))
                        rows.clear()
            if rows:
                out.write_table(pa.Table.from_pylist(rows, schema=marked))
        _replace_durably(tmp, self.path)
        self.journal.path.unlink()


class StreamWriter:
    """JSONL records on a stream (stdout for `-o -`), each flushed as it is written; nothing to resume."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.records_kept = 0

    def write(self, record: dict) -> None:
        try:
            self.stream.write(record_line(record))
            self.stream.flush()
        except OSError as exc:  # a closed pipe (`| head`), a full disk
            raise OutputWriteError(f"cannot write the records to stdout: {exc.strerror or exc}") from None
        self.records_kept += 1

    def sync_if_due(self) -> None:
        """Each record is flushed as it is written; a stream cannot be synced."""

    def close(self) -> None:
        """The stream is the caller's."""


class SplitWriter:
    """The records of failed rows into `errors` (the Batch API's error file, `--error-file`), the others into
    `results`. A record is a failed row's when its "error" is set, as `resume_ids` reads it."""

    def __init__(self, results: Writer, errors: Writer):
        self.results = results
        self.errors = errors

    @property
    def records_kept(self) -> int:
        return self.results.records_kept + self.errors.records_kept

    def write(self, record: dict) -> None:
        (self.results if record.get("error") is None else self.errors).write(record)

    def sync_if_due(self) -> None:
        self.results.sync_if_due()
        self.errors.sync_if_due()

    def close(self) -> None:
        try:
            self.results.close()
        finally:
            self.errors.close()


Writer = JsonlWriter | ParquetWriter | StreamWriter | SplitWriter


def is_parquet(path: Path) -> bool:
    return path.suffix.lower() == ".parquet"


def resume_ids(path: Path, layout: RecordLayout) -> Answered:
    """Ids already written to OUTPUT by earlier runs of the job (repairing what a kill left behind)."""
    return read_parquet_ids(path, layout) if is_parquet(path) else read_jsonl_ids(path, layout.id_key)


def _replace_durably(tmp: Path, path: Path) -> None:
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path)


def _drop_jsonl_records(path: Path, id_key: str, ids: set[str]) -> None:
    tmp = temp_path(path)
    with open(path, "rb") as src, open(tmp, "wb") as dst:
        for line in src:
            if line.strip() and str(json.loads(line)[id_key]) not in ids:
                dst.write(line)
    _replace_durably(tmp, path)


def _drop_parquet_records(path: Path, id_key: str, ids: set[str]) -> None:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    source = pq.ParquetFile(path)
    tmp = temp_path(path)
    with pq.ParquetWriter(tmp, source.schema_arrow) as out:
        for batch in source.iter_batches():
            keep = pc.invert(pc.is_in(pc.cast(batch.column(id_key), pa.string()), pa.array(sorted(ids), pa.string())))
            out.write_table(pa.Table.from_batches([batch.filter(keep)], source.schema_arrow))
    _replace_durably(tmp, path)


def drop_records(path: Path, layout: RecordLayout, ids: set[str]) -> None:
    """Remove the records of `ids` from OUTPUT (and a Parquet OUTPUT's journal), each file replaced atomically.
    Call after `resume_ids`, which repairs what a kill left behind."""
    if not ids:
        return
    if is_parquet(path):
        if path.exists():
            _drop_parquet_records(path, layout.id_key, ids)
        path = journal_path(path)
    if path.exists():
        _drop_jsonl_records(path, layout.id_key, ids)


def open_writer(path: Path, layout: RecordLayout, append: bool) -> Writer:
    """A writer for OUTPUT; without `append` an existing OUTPUT is replaced."""
    return ParquetWriter(path, layout, append) if is_parquet(path) else JsonlWriter(path, append)
