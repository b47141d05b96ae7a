"""Host-to-device plumbing of step inputs, built for a small per-step host cost (docs/ARCHITECTURE.md).

A step's device inputs are declared once, as the tensor fields of `StepInputs` (and the dataclasses nested in
it), each with `buffer(dtype, extent)` metadata; `buffer_fields` turns that declaration into the buffers' layout
and `sliced_views` into one step's views. `StepBuffers` lays every per-step array out at a fixed offset of one
byte buffer that exists twice: in pinned host memory (double-buffered, so the host fills one while the other's
copy may still be queued) and on the device. A step is one memcpy; the device views have fixed addresses, which
is what CUDA graphs capture. `SequenceRows` (rank 0's host side, owned by the runner) gives each running sequence
a row that it keeps while it runs: its block table
and the settings that do not change while it runs (sampling, prompt length), so a step gathers them by row instead
of rebuilding them from Python objects. `DeviceBlockTables` (every rank) mirrors the tables on the device; a step
carries only the entries added since the previous step.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from nanovllm.engine.sequence import Sequence
    from nanovllm.runner.logit_controls import LogitControls

_ALIGN = 64

# How far a step input extends, in a step of `tokens` input tokens (padding included), `rows` sequences (a
# graph's padded batch size) of which `seqs` are real, `updates` block-table entries (as [2, n]: flat indices,
# then block ids) and one token per KV group (as [groups, tokens]).
TOKENS, ROWS, ROWS_PLUS_ONE, SEQS, UPDATES, GROUP_TOKENS = "tokens", "rows", "rows+1", "seqs", "updates", "group tokens"


def buffer(dtype: torch.dtype, extent: str, graph: bool = False):
    """A dataclass field that is a step-buffer view: its dtype, its extent (one of the constants above), and
    whether a CUDA graph of a decode step reads it (a tensor-parallel worker copies those into the graph's)."""
    return dataclasses.field(metadata={"dtype": dtype, "extent": extent, "graph": graph})


@functools.cache
def buffer_specs(cls: type) -> tuple[tuple[str, dataclasses.Field], ...]:
    """(name, field) of every buffer field of `cls` and of the dataclasses nested in it, in declaration order."""
    hints = typing.get_type_hints(cls)
    specs: tuple[tuple[str, dataclasses.Field], ...] = ()
    for f in dataclasses.fields(cls):
        if "extent" in f.metadata:
            specs += ((f.name, f),)
        elif dataclasses.is_dataclass(hints[f.name]):
            specs += buffer_specs(hints[f.name])
    return specs


@dataclass(frozen=True)
class Field:
    name: str
    dtype: torch.dtype
    length: int


def buffer_fields(cls: type, max_lengths: dict[str, int]) -> list[Field]:
    """The step-buffer layout of `cls`'s buffer fields, each as long as its extent can get."""
    return [Field(name, f.metadata["dtype"], max_lengths[f.metadata["extent"]]) for name, f in buffer_specs(cls)]


def sliced_views(cls: type, on_device: dict[str, torch.Tensor], lengths: dict[str, int | tuple[int, int]]
                 ) -> dict[str, torch.Tensor]:
    """The device views of `cls`'s buffer fields whose extent `lengths` gives, as long as one step uses them: a
    length, or a 2-D shape for the 2-D extents."""
    views = {}
    for name, f in buffer_specs(cls):
        length = lengths.get(f.metadata["extent"])
        if isinstance(length, tuple):
            views[name] = on_device[name][:length[0] * length[1]].view(length)
        elif length is not None:
            views[name] = on_device[name][:length]
    return views


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
            # Steps run on the stream current at construction, looked up once: torch's Python-side stream lookup
            # costs tens of microseconds per call on a slow host.
            self.stream = torch.cuda.current_stream(device)
        # Uploads are numbered; `settle(n)` says that upload n and all before it have run on the device. A host
        # buffer is refilled only once its last upload has settled (the step loop's waits normally see to it).
        self.num_uploads = 0
        self._settled = 0
        self._last_upload = [0] * len(self._host_bytes)
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
        """The host views to fill for the next step. A step's results are awaited before the step after next is
        prepared, which settles this buffer's last upload; otherwise this waits for the device to catch up."""
        self._current = (self._current + 1) % len(self._hosts)
        if self._last_upload[self._current] > self._settled:
            self.stream.synchronize()
            self._settled = self.num_uploads
        return self._hosts[self._current]

    def upload(self, last_field_length: int) -> None:
        """Queue the copy of the filled host buffer to the device on the stream; it becomes upload number
        `num_uploads`. The last field is copied only in part (its first `last_field_length` elements): it is the
        one whose use varies most."""
        self.num_uploads += 1
        if self.on_cpu:
            self._settled = self.num_uploads
            return
        self._last_upload[self._current] = self.num_uploads
        size = self._last_offset + last_field_length * self._last_itemsize
        key = (self._current, size)
        views = self._copy_views.get(key)
        if views is None:
            views = self._copy_views[key] = (self._device_bytes[:size], self._host_bytes[self._current][:size])
        views[0].copy_(views[1], non_blocking=True)

    def settle(self, upload_number: int) -> None:
        """Upload `upload_number` and every earlier one have run on the device (work queued after them has)."""
        self._settled = max(self._settled, upload_number)


@dataclass
class _Row:
    index: int
    epoch: int
    num_synced: int  # leading block-table entries already in the row


class SequenceRows:
    """Per-sequence step state of running sequences, one row each, on rank 0's host (the last row is never
    assigned: graph padding entries use it; its table is all zeros). `row_of[seq_id]` is a sequence's row.

    A row is (re)filled when its sequence is admitted (first time, or after a preemption: new epoch, new table,
    new prefix hits) and freed when the scheduler releases the sequence (finished or preempted). Between those,
    a sequence's table only grows, and only the sequences whose table changed for a step are looked at, to find
    the entries the device tables lack."""

    def __init__(self, max_rows: int, max_blocks_per_seq: int, vocab_size: int):
        rows = max_rows + 1
        self.padding_row = max_rows
        self.width = max_blocks_per_seq
        self.host_tables = np.zeros((rows, max_blocks_per_seq), dtype=np.int32)
        self.temperature = np.zeros(rows, dtype=np.float32)
        self.top_k = np.full(rows, vocab_size, dtype=np.int64)  # vocab size = no top-k
        self.top_p = np.ones(rows, dtype=np.float32)
        self.min_p = np.zeros(rows, dtype=np.float32)
        self.seed = np.zeros(rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(rows, dtype=np.int64)
        self.num_shared_kv_tokens = np.zeros(rows, dtype=np.int64)  # KV below this is in shared, complete blocks
        self.logprobs = np.full(rows, -1, dtype=np.int64)  # top-k asked per sampled token; -1 = none
        self.prompt_logprobs = np.full(rows, -1, dtype=np.int64)  # top-k asked per prompt token; -1 = none
        self.num_asking = 0  # assigned rows with either set: a step checks this before looking further
        self.controls: LogitControls | None = None  # rank 0's penalties and logit controls, kept by row
        self._vocab_size = vocab_size
        self._rows: dict[int, _Row] = {}  # seq_id -> its row's state
        self.row_of: dict[int, int] = {}  # seq_id -> row
        self._free = list(range(max_rows - 1, -1, -1))

    def release(self, seq_ids: list[int]) -> None:
        """Free the rows of sequences that stopped running (steps in flight still read them on the device, and
        a row refilled now is written there only by a later step)."""
        for seq_id in seq_ids:
            entry = self._rows.pop(seq_id, None)
            if entry is not None:
                del self.row_of[seq_id]
                self._free.append(entry.index)
                self._set_logprobs(entry.index, None, None)
                if self.controls is not None:
                    self.controls.clear(entry.index)

    def sync(self, changed: list[Sequence]) -> tuple[list[int], list[int]]:
        """Bring the rows of `changed` (admitted, or whose table grew) up to date on the host. Returns the table
        entries the device lacks: their flat indices (row * width + column) and their block ids."""
        flat_indices: list[int] = []
        blocks: list[int] = []
        width = self.width
        for seq in changed:
            entry = self._rows.get(seq.seq_id)
            if entry is None or entry.epoch != seq.epoch:
                entry = self._refill(seq, entry)
            table = seq.block_table
            synced = entry.num_synced
            if len(table) > synced:
                base = entry.index * width
                flat_indices += range(base + synced, base + len(table))
                blocks += table[synced:]
                entry.num_synced = len(table)
        if blocks:
            self.host_tables.reshape(-1)[flat_indices] = blocks
        return flat_indices, blocks

    def _refill(self, seq: Sequence, entry: _Row | None) -> _Row:
        if entry is None:
            if not self._free:
                raise RuntimeError("more running sequences than rows: a finished or preempted sequence was not "
                                   "released")
            entry = _Row(self._free.pop(), seq.epoch, 0)
            self._rows[seq.seq_id] = entry
            self.row_of[seq.seq_id] = entry.index
        entry.epoch, entry.num_synced = seq.epoch, 0
        row, params = entry.index, seq.params
        self.temperature[row] = params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else self._vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.seed[row] = seq.sampling_seed
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self.num_shared_kv_tokens[row] = seq.num_shared_kv_tokens
        self._set_logprobs(row, params.logprobs, params.prompt_logprobs)
        if self.controls is not None:
            self.controls.fill(row, params, seq.token_ids, seq.num_prompt_tokens, seq.bad_words_token_ids)
        return entry

    def _set_logprobs(self, row: int, logprobs: int | None, prompt_logprobs: int | None) -> None:
        self.num_asking -= bool(self.logprobs[row] >= 0 or self.prompt_logprobs[row] >= 0)
        self.logprobs[row] = -1 if logprobs is None else logprobs
        self.prompt_logprobs[row] = -1 if prompt_logprobs is None else prompt_logprobs
        self.num_asking += logprobs is not None or prompt_logprobs is not None


class DeviceBlockTables:
    """Every rank's device copy of the block tables of `SequenceRows`: the same rows, plus a sink row at the end
    that takes the padding entries of a fixed-size update (a CUDA graph applies a fixed number of entries)."""

    def __init__(self, num_rows: int, width: int, device: torch.device):
        self.tables = torch.zeros(num_rows + 1, width, dtype=torch.int32, device=device)
        self.sink_index = num_rows * width  # flat index of the sink row's first entry
        self._flat = self.tables.view(-1)

    def apply(self, updates: torch.Tensor) -> None:
        """Write `updates` ([2, n] int32: flat indices, then block ids) into the tables."""
        self._flat.index_put_((updates[0],), updates[1])

    def gather(self, rows: torch.Tensor, num_columns: int | None = None, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The tables of `rows`, cut to their first `num_columns` entries (all by default)."""
        tables = self.tables if num_columns is None else self.tables[:, :num_columns]
        return torch.index_select(tables, 0, rows, out=out)

    def gather_groups(self, rows: torch.Tensor, num_groups: int, num_blocks: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """Each KV group's tables of `rows` ([groups, rows, blocks], each table contiguous as the kernels read
        it), cut to their first `num_blocks` blocks (all by default); into `out` when given."""
        if num_groups == 1:  # the rows' tables as they are
            return self.gather(rows, num_blocks, None if out is None else out[0]).unsqueeze(0)
        flat = self.gather(rows, None if num_blocks is None else num_blocks * num_groups)
        by_group = flat.view(len(rows), -1, num_groups).permute(2, 0, 1)
        return by_group.contiguous() if out is None else out.copy_(by_group)
