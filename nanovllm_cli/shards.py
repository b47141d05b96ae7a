"""`run --ray`'s OUTPUT: a folder of shards, each committed whole with a manifest, so that a job killed at any moment
resumes with every row answered exactly once.

    OUTPUT/part-<key>.jsonl | .parquet   the records of one input part (`run`'s records; Parquet: nested as JSON text)
    OUTPUT/_manifests/part-<key>.json    its manifest: the part (file URL, the file's size and version, first line or
                                         row, count, byte offset), the ids answered, the failed ones (id, number),
                                         the token counts, the engine that wrote it, what was retried
    OUTPUT/_tmp/                         files being written

A commit writes the file under `_tmp`, syncs it (local files: fsync) and renames it into place (on an object store a
rename is a copy: the object appears whole or not at all): first the shard, then its manifest. The manifest is the
commit: on resume a shard without one is cut, and `_tmp` is emptied. `--retry-failed` rewrites a shard with a new
key; its manifest names the manifest it replaces, removed after it (a kill in between leaves both: the replaced one
is dropped on resume). Two committed manifests over the same rows (an engine that committed as it was given up
for dead) keep the older. Readers of the folder (Spark, Ray Data, pandas) skip names that start with `_`.
"""
from __future__ import annotations

import contextlib
import json
import os
import posixpath
import socket
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import BinaryIO

import xxhash

from nanovllm_cli.records import RecordLayout, record_line

MANIFESTS = "_manifests"
TMP = "_tmp"
MANIFEST_VERSION = 1


class OutputNotWritable(OSError):
    """OUTPUT cannot be written from a node; the message names the node and the cause."""


def part_key(url: str, first: int) -> str:
    """A new shard's key: its input file and first line (for people listing OUTPUT), and a random tail (each
    attempt at a part writes its own files)."""
    return f"{xxhash.xxh64_hexdigest(url.encode())[:8]}-{first:010d}-{uuid.uuid4().hex[:8]}"


def file_version(info: dict) -> str:
    """What tells a changed input file: its size and its ETag (object stores) or modification time."""
    stamp = next((info[k] for k in ("ETag", "etag", "mtime", "LastModified", "last_modified", "updated")
                  if info.get(k) is not None), None)
    return f"{info.get('size')}:{stamp}"


@dataclass
class ShardFolder:
    """OUTPUT, at any URI fsspec opens."""

    uri: str
    fs: object = field(init=False, repr=False)
    root: str = field(init=False)

    def __post_init__(self) -> None:
        import fsspec

        self.fs, root = fsspec.core.url_to_fs(self.uri)
        self.root = root.rstrip("/")

    @property
    def local(self) -> bool:
        from fsspec.implementations.local import LocalFileSystem

        return isinstance(self.fs, LocalFileSystem)

    def path(self, *names: str) -> str:
        return posixpath.join(self.root, *names)

    def shard_name(self, key: str, fmt: str) -> str:
        return f"part-{key}.{fmt}"

    # ---- writing ----------------------------------------------------------------------------------------------

    def commit(self, name: str, write: Callable[[BinaryIO], None]) -> None:
        """Write `name` (relative to OUTPUT) whole: under _tmp, synced, then renamed into place."""
        tmp = self.path(TMP, f"{posixpath.basename(name)}.{uuid.uuid4().hex[:8]}")
        self.fs.makedirs(self.path(TMP), exist_ok=True)
        self.fs.makedirs(posixpath.dirname(self.path(name)), exist_ok=True)
        with self.fs.open(tmp, "wb") as f:
            write(f)
            if self.local:
                f.flush()
                os.fsync(f.fileno())
        self.fs.mv(tmp, self.path(name))
        if self.local:
            _fsync_dir(posixpath.dirname(self.path(name)))

    def write_shard(self, key: str, fmt: str, layout: RecordLayout, records: list[dict]) -> str:
        """Commit a shard of `records`; returns its name."""
        name = self.shard_name(key, fmt)
        self.commit(name, lambda f: write_records(f, fmt, layout, records))
        return name

    def write_manifest(self, manifest: dict) -> None:
        """Commit a manifest (the shard it names is committed already): the part is answered."""
        text = json.dumps(manifest, ensure_ascii=False).encode("utf-8")
        self.commit(posixpath.join(MANIFESTS, f"part-{manifest['key']}.json"), lambda f: f.write(text))


    # ---- reading ----------------------------------------------------------------------------------------------

    def read_state(self) -> OutputState:
        """The committed manifests and the files nothing commits (leftovers of a killed job)."""
        state = OutputState()
        if not self.fs.isdir(self.root):
            return state
        for path in self.fs.find(self.root):
            relative = posixpath.relpath(path, self.root)
            if relative.startswith(MANIFESTS + "/") and relative.endswith(".json"):
                with self.fs.open(path, "rb") as f:
                    try:
                        manifest = json.loads(f.read())
                    except ValueError:  # a manifest is committed whole: this is no manifest of ours
                        state.foreign.append(relative)
                        continue
                state.manifests[manifest["key"]] = manifest
            elif relative.startswith(TMP + "/"):
                state.leftovers.append(relative)
            elif posixpath.basename(relative).startswith("part-") and "/" not in relative:
                state.shards.add(relative)
            else:
                state.foreign.append(relative)
        return state

    def read_records(self, name: str, fmt: str, layout: RecordLayout) -> list[dict]:
        """A shard's records, as `run` writes them."""
        with self.fs.open(self.path(name), "rb") as f:
            if fmt == "jsonl":
                return [json.loads(line) for line in f if line.strip()]
            import pyarrow.parquet as pq

            from nanovllm_cli.ray_processor import record_from_arrow

            return [record_from_arrow(layout, row) for row in pq.read_table(f).to_pylist()]

    def remove(self, names: Iterable[str]) -> None:
        for name in names:
            if self.fs.exists(self.path(name)):
                self.fs.rm(self.path(name))

    def remove_manifest(self, manifest: dict) -> None:
        """Uncommit a part: its manifest first, then its shard."""
        self.remove([posixpath.join(MANIFESTS, f"part-{manifest['key']}.json"), manifest["shard"]])

    def tidy(self) -> None:
        """Remove _tmp once nothing is in it (a local OUTPUT; object stores have no empty folders)."""
        with contextlib.suppress(OSError):
            if self.local and not self.fs.ls(self.path(TMP)):
                self.fs.rmdir(self.path(TMP))

    def clear(self) -> None:
        """Remove OUTPUT and everything in it (--overwrite)."""
        if self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)


@dataclass
class OutputState:
    manifests: dict[str, dict] = field(default_factory=dict)  # key -> manifest
    shards: set[str] = field(default_factory=set)  # part-* files at OUTPUT's top
    leftovers: list[str] = field(default_factory=list)  # files under _tmp
    foreign: list[str] = field(default_factory=list)  # anything else

    @property
    def empty(self) -> bool:
        return not (self.manifests or self.shards or self.leftovers or self.foreign)

    def superfluous(self) -> tuple[list[dict], list[str]]:
        """What resume removes: the manifests replaced by a rewrite or covering rows another covers already
        (the older one stays), and the files no manifest commits (shards cut short by a kill, _tmp)."""
        dropped = [m for m in self.manifests.values()
                   if any(other.get("replaces") == m["key"] for other in self.manifests.values())]
        kept = sorted((m for m in self.manifests.values() if m not in dropped), key=lambda m: m["committed"])
        claimed: dict[str, list[tuple[int, int]]] = {}
        for manifest in kept:
            part = manifest["part"]
            span = (part["first"], part["first"] + part["count"])
            if any(a < span[1] and span[0] < b for a, b in claimed.get(part["url"], [])):
                dropped.append(manifest)
            else:
                claimed.setdefault(part["url"], []).append(span)
        committed = {m["shard"] for m in self.manifests.values() if m not in dropped}
        return dropped, sorted(self.shards - committed) + self.leftovers

    def covered(self) -> dict[str, list[tuple[int, int]]]:
        """Per input file URL, the (first, count) ranges the committed manifests answer."""
        ranges: dict[str, list[tuple[int, int]]] = {}
        for manifest in self.manifests.values():
            part = manifest["part"]
            ranges.setdefault(part["url"], []).append((part["first"], part["count"]))
        return ranges


def probe_output(uri: str, where: str) -> None:
    """Write and remove a small file under OUTPUT/_tmp: raises OutputNotWritable naming `where` (a node) when this
    process cannot (the filesystem's package, credentials or permissions missing here)."""
    try:
        folder = ShardFolder(uri)
        name = folder.path(TMP, f"probe-{socket.gethostname()}-{uuid.uuid4().hex[:8]}")
        folder.fs.makedirs(folder.path(TMP), exist_ok=True)
        with folder.fs.open(name, "wb") as f:
            f.write(b"nanovllm")
        folder.fs.rm(name)
    except Exception as exc:  # noqa: BLE001 (any filesystem's error: a protocol, credentials, permission)
        raise OutputNotWritable(f"OUTPUT {uri} cannot be written from {where}: {type(exc).__name__}: {exc}") from None


def write_records(f: BinaryIO, fmt: str, layout: RecordLayout, records: list[dict]) -> None:
    """Records as a JSONL shard (exactly `run`'s lines) or a Parquet one (nested fields as JSON text, one schema
    for every shard of a job)."""
    if fmt == "jsonl":
        f.write("".join(record_line(r) for r in records).encode("utf-8"))
        return
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanovllm_cli.ray_processor import arrow_row, record_schema

    schema = record_schema(layout)
    pq.write_table(pa.Table.from_pylist([arrow_row(layout, r) for r in records], schema=schema), f)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
