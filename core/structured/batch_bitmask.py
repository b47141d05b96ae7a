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
from nanovllm.structured.row_grammar import RowGrammar


@dataclass
class StepBitmask:
    """What the runner applies to a step's logits: `apply_token_bitmask(logits, bitmask, row_indices)`."""

    bitmask: torch.Tensor  # int32 [constrained rows, ceil(vocab / 32)], on the logits' device
    row_indices: torch.Tensor  # int64 [constrained rows]: the logits row of each bitmask row

    def apply(self, logits: torch.Tensor) -> None:
        apply_token_bitmask(logits, self.bitmask, self.row_indices)


@dataclass
class _HostSlot:
    bitmask: torch.Tensor
    row_indices: torch.Tensor
    copied: torch.cuda.Event | None = None  # the device copy that reads this slot


class BatchBitmask:
    """Reusable host (pinned on CUDA) and device buffers for up to `max_rows` constrained rows a step.

    Two host slots alternate, so the host fills step t+1's mask while step t's copy may still be queued; a slot
    is refilled only after the copy that read it has run."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str, fill_threads: int | str = "auto"):
        self.device = torch.device(device)
        self.max_rows = max_rows
        self.vocab_size = vocab_size
        width = bitmask_width(vocab_size)
        pinned = self.device.type == "cuda"
        self._slots = [_HostSlot(torch.empty(max_rows, width, dtype=torch.int32, pin_memory=pinned),
                                 torch.empty(max_rows, dtype=torch.int64, pin_memory=pinned)) for _ in range(2)]
        self._next_slot = 0
        if pinned:
            self._device_bitmask = torch.empty(max_rows, width, dtype=torch.int32, device=self.device)
            self._device_rows = torch.empty(max_rows, dtype=torch.int64, device=self.device)
        self._batch_matcher = xgr.BatchGrammarMatcher(fill_threads)

    def fill_host(self, grammars: Sequence[RowGrammar], logits_rows: Sequence[int],
                  bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
        """The host part alone: `bitmask[i]` <- the next-token mask of `grammars[i]`, `row_indices[i]` <-
        `logits_rows[i]`, on xgrammar's worker threads; terminated rows allow every token (their sample is
        discarded)."""
        live = [i for i, g in enumerate(grammars) if not g.is_terminated()]
        if len(live) < len(grammars):
            bitmask[:len(grammars)].fill_(-1)
        if live:
            self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher for i in live], bitmask, live)
        row_indices[:len(logits_rows)] = torch.as_tensor(logits_rows, dtype=torch.int64)

    def prepare(self, grammars: Sequence[RowGrammar], logits_rows: Sequence[int],
                stream: torch.cuda.Stream | None = None) -> StepBitmask | None:
        """Fill the constrained rows' masks and start their copy to the device on `stream` (default: the current
        one; it must be the stream that then applies them). None when no row is constrained."""
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
            slot.copied.synchronize()  # normally long done: it was queued a step ago
        self.fill_host(grammars, logits_rows, slot.bitmask, slot.row_indices)
        if self.device.type != "cuda":
            return StepBitmask(slot.bitmask[:count], slot.row_indices[:count])
        stream = stream or torch.cuda.current_stream(self.device)
        with torch.cuda.stream(stream):
            bitmask = self._device_bitmask[:count]
            row_indices = self._device_rows[:count]
            bitmask.copy_(slot.bitmask[:count], non_blocking=True)
            row_indices.copy_(slot.row_indices[:count], non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(stream)
        return StepBitmask(bitmask, row_indices)
