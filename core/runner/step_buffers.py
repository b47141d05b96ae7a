"""The byte layout of step inputs, built for a small per-step host cost (docs/ARCHITECTURE.md).

A step's device inputs are declared once, as the tensor fields of `StepInputs` (and the dataclasses nested in
it), each with `buffer(dtype, extent)` metadata; `buffer_fields` turns that declaration into the buffers' layout
and `sliced_views` into one step's views. `StepBuffers` lays every per-step array out at a fixed offset of one
byte buffer that exists twice: in pinned host memory (double-buffered, so the host fills one while the other's
copy may still be queued) and on the device. A step is one memcpy; the device views have fixed addresses, which
is what CUDA graphs capture. What the buffers are filled from is the persistent batch (persistent_batch.py).
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

import numpy as np
import torch

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
