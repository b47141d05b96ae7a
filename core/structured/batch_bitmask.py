"""A step's grammar bitmask: filled on the host for the constrained rows only, copied to the device, applied there.

Only rows with a grammar carry a bitmask row; `row_indices[i]` is the logits row (the row's place in the step's
sampled batch) that bitmask row i masks. Unconstrained rows cost nothing, and a step without constrained rows
skips all of it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

from nanovllm.kernels.token_bitmask import apply_token_bitmask, bitmask_width
from nanovllm.structured.row_grammar import RowGrammar, clear_bits_past


@dataclass
class _Slot:
    """One step's buffers. On CUDA: pinned host memory, its device copy, and the events that order their reuse."""

    host_bitmask: torch.Tensor
    host_rows: torch.Tensor
    device_bitmask: torch.Tensor
    device_rows: torch.Tensor
    copied: torch.cuda.Event | None = None  # on the copy stream, after the host -> device copy
    consumed: torch.cuda.Event | None = None  # on the applying stream, after the kernel that read the device copy


@dataclass
class StepBitmask:
    """What the runner applies to a step's logits, on the stream it was prepared for."""

    bitmask: torch.Tensor  # int32 [constrained rows, ceil(vocab / 32)], on the logits' device
    row_indices: torch.Tensor  # int64 [constrained rows]: the logits row of each bitmask row
    _slot: _Slot

    def apply(self, logits: torch.Tensor) -> None:
        """Disallowed logits of the constrained rows -> -inf, in place (nanovllm.kernels.token_bitmask), on the
        current stream, which waits for the bitmask's copy here and not before."""
        if logits.is_cuda:
            torch.cuda.current_stream(logits.device).wait_event(self._slot.copied)
        apply_token_bitmask(logits, self.bitmask, self.row_indices)
        if logits.is_cuda:
            self._slot.consumed = torch.cuda.Event()
            self._slot.consumed.record()


class BatchBitmask:
    """Reusable buffers for up to `max_rows` constrained rows a step, in two slots that alternate.

    On CUDA the host -> device copy runs on a side stream, so it overlaps whatever the applying stream is still
    running (the forward of the step it is for); the applying stream waits for the copy only at `apply`.
    A slot is refilled two steps later: its host part once its copy has run, its device part once the kernel
    that read it has run. A StepBitmask must be applied before the second `prepare` after it."""

    def __init__(self, max_rows: int, mask_vocab_size: int, device: torch.device | str,
                 fill_threads: int | str = "auto"):
        self.device = torch.device(device)
        self.max_rows = max_rows
        self.mask_vocab_size = mask_vocab_size  # the grammars' (RowGrammar.mask_vocab_size): ids past it never allowed
        width = bitmask_width(mask_vocab_size)
        on_cuda = self.device.type == "cuda"

        def slot() -> _Slot:
            host_bitmask = torch.empty(max_rows, width, dtype=torch.int32, pin_memory=on_cuda)
            host_rows = torch.empty(max_rows, dtype=torch.int64, pin_memory=on_cuda)
            if not on_cuda:
                return _Slot(host_bitmask, host_rows, host_bitmask, host_rows)
            return _Slot(host_bitmask, host_rows, torch.empty(max_rows, width, dtype=torch.int32, device=self.device),
                         torch.empty(max_rows, dtype=torch.int64, device=self.device))

        self._slots = [slot(), slot()]
        self._next_slot = 0
        self._copy_stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._batch_matcher = xgr.BatchGrammarMatcher(fill_threads)

    def fill_host(self, grammars: Sequence[RowGrammar], logits_rows: Sequence[int],
                  bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
        """The host part alone: `bitmask[i]` <- the next-token mask of `grammars[i]`, `row_indices[i]` <-
        `logits_rows[i]`, on xgrammar's worker threads; terminated rows allow every token of the grammars'
        vocabulary (their sample is discarded)."""
        live = [i for i, g in enumerate(grammars) if not g.is_terminated()]
        if len(live) < len(grammars):
            bitmask[:len(grammars)].fill_(-1)
        if live:
            self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher for i in live], bitmask, live)
        clear_bits_past(bitmask[:len(grammars)], self.mask_vocab_size)
        row_indices[:len(logits_rows)] = torch.as_tensor(logits_rows, dtype=torch.int64)

    def prepare(self, grammars: Sequence[RowGrammar], logits_rows: Sequence[int]) -> StepBitmask | None:
        """Fill the constrained rows' masks (`grammars[i]` masks logits row `logits_rows[i]`) and start their copy
        to the device; returns at once. None when no row is constrained."""
        count = len(grammars)
        if count != len(logits_rows):
            raise ValueError(f"{count} grammars but {len(logits_rows)} logits rows")
        if count > self.max_rows:
            raise ValueError(f"{count} constrained rows exceed the bitmask's {self.max_rows}")
        if count == 0:
            return None
        slot = self._slots[self._next_slot]
        self._next_slot ^= 1
        if slot.copied is not None:
            slot.copied.synchronize()  # normally long done: it was queued two steps ago
        self.fill_host(grammars, logits_rows, slot.host_bitmask, slot.host_rows)
        if self._copy_stream is not None:
            if slot.consumed is not None:
                self._copy_stream.wait_event(slot.consumed)
            with torch.cuda.stream(self._copy_stream):
                slot.device_bitmask[:count].copy_(slot.host_bitmask[:count], non_blocking=True)
                slot.device_rows[:count].copy_(slot.host_rows[:count], non_blocking=True)
                slot.copied = torch.cuda.Event()
                slot.copied.record(self._copy_stream)
        return StepBitmask(slot.device_bitmask[:count], slot.device_rows[:count], slot)
