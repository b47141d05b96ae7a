"""Durable, resumable output: JSONL appended record by record, or Parquet through a JSONL journal.

Every record is flushed to the OS as soon as it is written (a killed process loses nothing already written)
and fsync'ed within `FSYNC_INTERVAL_S` and at close (a crashed machine loses at most that much). A kill can cut
the last line short; `resume_ids` cuts such a torn line off and returns the ids of the complete records.

Parquet cannot be appended to, so rows go to the journal `OUTPUT.journal.jsonl` while the job runs and `close`
merges OUTPUT's earlier rows (when resuming) and the journal into a temporary file that atomically replaces
OUTPUT; then the journal is removed. The merged file records the journal's size and hash in its metadata, so
a journal left behind by a crash between the replace and the removal is recognised as merged and dropped.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from nanovllm_cli.records import RecordLayout, record_line

FSYNC_INTERVAL_S = 2.0
MERGED_JOURNAL_KEY = b"nanovllm.merged_journal"


class OutputError(Exception):
    """OUTPUT cannot be resumed as it is (the user must choose another file or fix this one)."""


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
    """Appends one JSON line per record: flushed at once, fsync'ed within `fsync_interval` and at close."""

    def __init__(self, path: Path, append: bool, fsync_interval: float = FSYNC_INTERVAL_S):
        self.path = path
        self.file = open(path, "a" if append else "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.fsync_interval = fsync_interval
        self.unsynced_since: float | None = None

    def write(self, record: dict) -> None:
        self.file.write(record_line(record))
        self.file.flush()
        if self.unsynced_since is None:
            self.unsynced_since = time.monotonic()

    def sync_if_due(self) -> None:
        if self.unsynced_since is not None and time.monotonic() - self.unsynced_since >= self.fsync_interval:
            self._sync()

    def _sync(self) -> None:
        os.fsync(self.file.fileno())
        self.unsynced_since = None

    def close(self) -> None:
        if not self.file.closed:
            self._sync()
            self.file.close()
            _fsync_dir(self.path)


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
    import pyarrow.parquet as pq

    journal = journal_path(path)
    ids = Answered()
    if path.exists():
        schema = pq.read_schema(path)
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

    def close(self) -> None:
        self.journal.close()
        self._merge()

    def _merge(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = self.layout.arrow_schema()
        marked = schema.with_metadata({MERGED_JOURNAL_KEY: _journal_marker(self.journal.path).encode()})
        tmp = temp_path(self.path)
        with pq.ParquetWriter(tmp, marked) as out:
            if self.path.exists():
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


Writer = JsonlWriter | ParquetWriter


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
