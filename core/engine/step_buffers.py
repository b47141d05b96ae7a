"""Host-to-device plumbing of step inputs, built for a small per-step host cost (DESIGN §6).

`StepBuffers` lays every per-step array out at a fixed offset of one byte buffer that exists twice: in pinned
host memory (double-buffered, so the host fills one while the other's copy may still be queued) and on the
device. A step is one memcpy; the device views have fixed addresses, which is what CUDA graphs capture.
`DeviceBlockTables` keeps each running sequence's block table on the device, one row per sequence, so a step
sends only the entries added since the sequence's previous step instead of every table."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.engine.sequence import Sequence, SequenceStatus

_ALIGN = 64


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    length: int


class StepBuffers:
    """Named typed views of one buffer: `host[name]` (numpy, pinned when the device is CUDA), `on_device[name]`."""

    def __init__(self, fields: list[Field], device: torch.device):
        self.offsets: dict[str, int] = {}
        size = 0
        for f in fields:
            self.offsets[f.name] = size
            size += -(-f.length * f.dtype.itemsize // _ALIGN) * _ALIGN
        self.fields = {f.name: f for f in fields}
        self.size = size
        self.device = device
        pin = device.type == "cuda"
        self._host_bytes = [torch.zeros(size, dtype=torch.uint8, pin_memory=pin) for _ in range(2 if pin else 1)]
        self._copied = [None] * len(self._host_bytes)  # event after each host buffer's last copy was queued
        self._device_bytes = torch.zeros(size, dtype=torch.uint8, device=device)
        self.on_device = {name: self._view(self._device_bytes, name) for name in self.fields}
        self._hosts = [{name: self._view(b, name).numpy() for name in self.fields} for b in self._host_bytes]
        self._current = 0

    def _view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        f = self.fields[name]
        start = self.offsets[name]
        return buffer[start:start + f.length * f.dtype.itemsize].view(f.dtype)

    def begin(self) -> dict[str, np.ndarray]:
        """The host views to fill for the next step (waits, rarely, until their previous copy has run)."""
        self._current = (self._current + 1) % len(self._hosts)
        event = self._copied[self._current]
        if event is not None:
            event.synchronize()
        return self._hosts[self._current]

    def upload(self) -> None:
        """Queue the copy of the filled host buffer to the device on the current stream."""
        if self.device.type == "cpu":
            self._device_bytes.copy_(self._host_bytes[self._current])
            return
        self._device_bytes.copy_(self._host_bytes[self._current], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._current] = event


@dataclass
class _Row:
    seq: Sequence
    row: int
    epoch: int
    num_synced: int  # leading block-table entries already on the device


class DeviceBlockTables:
    """Block tables of running sequences mirrored on the device; sequences keep their row while they run.

    A row whose sequence stopped running (finished, or preempted: its table was freed) is reclaimed when rows run
    out; a preempted sequence that comes back gets its table re-sent from scratch (its epoch changed)."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, device: torch.device):
        # One extra all-zero row, never assigned: the table of padding entries in graph-sized batches.
        self.table = torch.zeros(max_rows + 1, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.padding_row = max_rows
        self.device = device
        self._rows: dict[int, _Row] = {}  # seq_id -> row
        self._free = list(range(max_rows - 1, -1, -1))

    def sync(self, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
        """Rows of `seqs`, and the flat (row, column, block) triples to write so that the rows are current."""
        rows, updates = [], []
        for seq in seqs:
            entry = self._rows.get(seq.seq_id)
            if entry is None or entry.epoch != seq.epoch:
                entry = self._assign(seq) if entry is None else entry
                entry.epoch, entry.num_synced = seq.epoch, 0
            table = seq.block_table
            if len(table) > entry.num_synced:
                row = entry.row
                for column in range(entry.num_synced, len(table)):
                    updates += (row, column, table[column])
                entry.num_synced = len(table)
            rows.append(entry.row)
        return rows, updates

    def apply(self, updates: list[int]) -> None:
        if not updates:
            return
        pin = self.device.type == "cuda"
        flat = torch.tensor(updates, dtype=torch.int64, pin_memory=pin).to(self.device, non_blocking=True)
        triples = flat.view(-1, 3)
        self.table[triples[:, 0], triples[:, 1]] = triples[:, 2].to(torch.int32)

    def _assign(self, seq: Sequence) -> _Row:
        if not self._free:
            self._reclaim()
        entry = _Row(seq, self._free.pop(), seq.epoch, 0)
        self._rows[seq.seq_id] = entry
        return entry

    def _reclaim(self) -> None:
        for seq_id, entry in list(self._rows.items()):
            if entry.seq.status is not SequenceStatus.RUNNING:
                del self._rows[seq_id]
                self._free.append(entry.row)
        if not self._free:
            raise RuntimeError("more running sequences than block-table rows")
