"""A step's token bitmask: the data the host hands the device side (`StepMask`), and the device side's copy and
apply (`DeviceMask`). Neither imports xgrammar: the runner sees bits and row numbers, never a grammar.

The host fills one line per constrained row (its slot, kept while the row runs) in a table of `capacity` lines,
two tables alternating by step (`GrammarManager`). A step's mask is the table's first `len(logits_rows)` lines;
`logits_rows[i]` is the logits row line i masks, or -1 for a line with nothing to mask this step (a slot whose row
does not sample, a free slot): the rule of nanovllm.kernels.token_bitmask."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanovllm.kernels.token_bitmask import apply_token_bitmask


class CopyFence:
    """Marks host memory the device is copying from: the device side sets `event` once the copy is queued, and the
    host waits on it before writing that memory again (normally long done: a table is reused two steps later)."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None


@dataclass
class StepMask:
    """What the device side applies to one step's logits (host tensors; pinned when the device is CUDA)."""

    bitmask: torch.Tensor  # int32 [lines, ceil(mask vocab / 32)]: the allowed tokens, bit t % 32 of word t // 32
    logits_rows: torch.Tensor  # int64 [lines]: the logits row of each line, -1 for none
    capacity: int  # the most lines a step mask of this engine has (the device side sizes its buffers by it)
    fence: CopyFence = field(default_factory=CopyFence)


@dataclass
class _DeviceSlot:
    bitmask: torch.Tensor
    logits_rows: torch.Tensor
    copied: torch.cuda.Event | None = None  # on the copy stream, after the host -> device copy
    consumed: torch.cuda.Event | None = None  # on the applying stream, after the kernel that read this slot


class DeviceMask:
    """Applies step masks to logits on one device. On CUDA the host -> device copy runs on a side stream, so it
    overlaps whatever the applying stream is still running (the forward of the step the mask is for); the
    applying stream waits for the copy only right before the mask kernel. Two device slots alternate; a slot is
    overwritten only once the kernel that read it has run."""

    def __init__(self, device: torch.device):
        self.device = device
        self._slots: list[_DeviceSlot] = []
        self._next = 0
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def apply(self, step_mask: StepMask, logits: torch.Tensor) -> None:
        """Disallowed logits of the constrained rows -> -inf, in place, on the current stream."""
        lines = step_mask.logits_rows.shape[0]
        if self._copy_stream is None:
            apply_token_bitmask(logits, step_mask.bitmask, step_mask.logits_rows)
            return
        if not self._slots:
            capacity, width = step_mask.capacity, step_mask.bitmask.shape[1]
            self._slots = [_DeviceSlot(torch.empty(capacity, width, dtype=torch.int32, device=self.device),
                                       torch.empty(capacity, dtype=torch.int64, device=self.device)) for _ in range(2)]
        slot = self._slots[self._next]
        self._next ^= 1
        if slot.consumed is not None:
            self._copy_stream.wait_event(slot.consumed)
        with torch.cuda.stream(self._copy_stream):
            slot.bitmask[:lines].copy_(step_mask.bitmask, non_blocking=True)
            slot.logits_rows[:lines].copy_(step_mask.logits_rows, non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self._copy_stream)
        step_mask.fence.event = slot.copied
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(slot.copied)
        apply_token_bitmask(logits, slot.bitmask[:lines], slot.logits_rows[:lines])
        slot.consumed = torch.cuda.Event()
        slot.consumed.record(stream)
