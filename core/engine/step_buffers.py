"""Host-to-device plumbing of step inputs, built for a small per-step host cost (DESIGN §6).

`StepBuffers` lays every per-step array out at a fixed offset of one byte buffer that exists twice: in pinned
host memory (double-buffered, so the host fills one while the other's copy may still be queued) and on the
device. A step is one memcpy; the device views have fixed addresses, which is what CUDA graphs capture.
`SequenceRows` gives each running sequence a row that it keeps while it runs: its block table (mirrored on the
host and on the device, so a step sends only the entries added since the sequence's previous step) and the
settings that do not change while it runs (sampling, prompt length), so a step gathers them by row instead of
rebuilding them from Python objects.
"""
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
        self.on_cpu = device.type == "cpu"
        # On the CPU the host buffer is the device buffer: a step runs to its end before the next is prepared.
        self._host_bytes = [torch.zeros(size, dtype=torch.uint8, pin_memory=not self.on_cpu)
                            for _ in range(1 if self.on_cpu else 2)]
        self._device_bytes = (self._host_bytes[0] if self.on_cpu
                              else torch.zeros(size, dtype=torch.uint8, device=device))
        if not self.on_cpu:
            # Steps run on the stream current at construction. Events and stream are looked up once: torch's
            # Python-side stream lookup costs tens of microseconds per call on a slow host.
            self.stream = torch.cuda.current_stream(device)
            self._copied = [torch.cuda.Event() for _ in self._host_bytes]  # each host buffer's last copy
        self._copy_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.on_device = {name: self._view(self._device_bytes, name) for name in self.fields}
        self._hosts = [{name: self._view(b, name).numpy() for name in self.fields} for b in self._host_bytes]
        self._current = 0
        last = fields[-1]
        self._last_offset, self._last_itemsize = self.offsets[last.name], last.dtype.itemsize

    def _view(self, buffer: torch.Tensor, name: str) -> torch.Tensor:
        f = self.fields[name]
        start = self.offsets[name]
        return buffer[start:start + f.length * f.dtype.itemsize].view(f.dtype)

    def begin(self) -> dict[str, np.ndarray]:
        """The host views to fill for the next step (waits, rarely, until their previous copy has run)."""
        self._current = (self._current + 1) % len(self._hosts)
        if not self.on_cpu:
            self._copied[self._current].synchronize()
        return self._hosts[self._current]

    def upload(self, last_field_length: int) -> None:
        """Queue the copy of the filled host buffer to the device on the current stream. The last field is
        copied only in part (its first `last_field_length` elements): it is the one whose use varies most."""
        if self.on_cpu:
            return
        size = self._last_offset + last_field_length * self._last_itemsize
        key = (self._current, size)
        views = self._copy_views.get(key)
        if views is None:
            views = self._copy_views[key] = (self._device_bytes[:size], self._host_bytes[self._current][:size])
        views[0].copy_(views[1], non_blocking=True)
        self._copied[self._current].record(self.stream)


@dataclass
class _Row:
    seq: Sequence  # its row is `seq.row`
    epoch: int
    num_synced: int  # leading block-table entries already in the row


class SequenceRows:
    """Per-sequence step state of running sequences, one row each (the last row is never assigned: graph padding
    entries use it; its table is all zeros). A sequence's row is `seq.row` while it runs.

    A row is (re)filled when its sequence is admitted (first time, or after a preemption: new epoch, new table,
    new prefix hits); a row whose sequence stopped running is reclaimed when rows run out. Between those, a
    sequence's table only grows, and only the sequences whose table changed for a step are looked at, to send
    their appended entries."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, vocab_size: int,
                 staged_on_device: torch.Tensor | None = None):
        """`staged_on_device`: where the entries that `sync` stages land on the device once the step's buffer is
        uploaded (`apply` writes them into the device tables from there); None: the device is this host, and
        its tables are the host tables."""
        rows = max_rows + 1
        self.padding_row = max_rows
        self.width = max_blocks_per_seq
        self.host_tables = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)
        self._staged_on_device = staged_on_device
        self.device_tables = (torch.from_numpy(self.host_tables) if staged_on_device is None
                              else torch.zeros(rows, max_blocks_per_seq, dtype=torch.int32,
                                               device=staged_on_device.device))
        self._flat_device_tables = self.device_tables.view(-1)
        self._staged_views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # by count: slicing is a torch call
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.full(rows, vocab_size, dtype=np.int64)  # vocab size = no top-k
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.num_shared_kv_tokens = np.zeros(rows, dtype=np.int64)  # KV below this is in shared, complete blocks
        self._vocab_size = vocab_size
        self._rows: dict[int, _Row] = {}  # seq_id -> row
        self._free = list(range(max_rows - 1, -1, -1))

    def sync(self, changed: list[Sequence], table_updates: np.ndarray) -> int:
        """Bring the rows of `changed` (admitted, or whose table grew) up to date on the host; the device's
        pending entries are written to `table_updates` (flat table indices, then the block ids, n each): n."""
        flat_indices, blocks = [], []
        width = self.width
        for seq in changed:
            entry = self._rows.get(seq.seq_id)
            if entry is None or entry.epoch != seq.epoch:
                entry = self._refill(seq, entry)
            table = seq.block_table
            synced = entry.num_synced
            if len(table) > synced:
                base = seq.row * width
                flat_indices += range(base + synced, base + len(table))
                blocks += table[synced:]
                entry.num_synced = len(table)
        count = len(blocks)
        if count:
            if 2 * count > len(table_updates):
                raise RuntimeError(f"{count} block-table entries to send exceed the step buffer's room")
            table_updates[:count] = flat_indices
            table_updates[count:2 * count] = blocks
            self.host_tables.reshape(-1)[table_updates[:count]] = table_updates[count:2 * count]
        return count

    def apply(self, count: int) -> None:
        """Write the `count` entries that `sync` staged, now on the device, into the device tables (shared host
        tables have them already)."""
        if not count or self._staged_on_device is None:
            return
        views = self._staged_views.get(count)
        if views is None:
            staged = self._staged_on_device
            views = self._staged_views[count] = (staged[:count], staged[count:2 * count])
        self._flat_device_tables.index_put_(views[:1], views[1])

    def _refill(self, seq: Sequence, entry: _Row | None) -> _Row:
        if entry is None:
            if not self._free:
                self._reclaim()
            seq.row = self._free.pop()
            entry = _Row(seq, seq.epoch, 0)
            self._rows[seq.seq_id] = entry
        entry.epoch, entry.num_synced = seq.epoch, 0
        row, params = seq.row, seq.params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else self._vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed[row] = seq.sampling_seed
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self.num_shared_kv_tokens[row] = seq.num_shared_kv_tokens
        return entry

    def _reclaim(self) -> None:
        for seq_id, entry in list(self._rows.items()):
            if entry.seq.status is not SequenceStatus.RUNNING:
                del self._rows[seq_id]
                self._free.append(entry.seq.row)
        if not self._free:
            raise RuntimeError("more running sequences than rows")
