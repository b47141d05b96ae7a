"""Rank 0's device state for penalties and logit controls of the running rows, and their per-step application.

The ops are `nanovllm.layers.logit_controls` (vLLM's semantics and order). State lives on the device and
changes only when a row with controls joins or leaves, never from the host per step:

- Rows with repetition / presence / frequency penalties hold a `TokenHistory` slot: prompt mask, output counts
  and the list of distinct seen tokens (what a penalty touches: a step's penalties cost what the histories hold,
  not the vocabulary), reset from the host's known tokens when the row is (re)filled, then advanced on the
  device from each step's samples (`record`), so the async loop's step N + 1 sees step N's token without a host
  round trip.
- Sparse controls (logit_bias, allowed_token_ids, min_tokens' stop ids) are entry lists keyed by the persistent
  row, rebuilt as new tensors when a row with them joins or leaves (a step in flight keeps the old ones) and
  mapped to a step's batch indices on the device. Entries of rows not in the step do nothing.

A step in which no row has controls runs none of this (the runner checks `num_rows`)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.layers.logit_controls import (
    HISTORY_WINDOW,
    TokenHistory,
    apply_allowed_tokens,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    batch_index_of,
    pack_bad_words,
    upload,
)
from nanovllm.sampling_params import SamplingParams


@dataclass
class _Sparse:
    """Device entry lists keyed by persistent row (each a tuple of tensors), or None when no row has them."""

    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, tokens, biases
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows (distinct), their tokens' offsets, tokens
    min_tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, stop ids, min_tokens
    bad_words: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # rows, slots, prefixes, last


@dataclass
class _RowEntries:
    """One row's sparse controls as host arrays, built once when the row is filled: the entry lists of every
    row are then joined by concatenation, so rows joining and leaving at every step of a stream cost what the
    arrays hold, not a Python loop over every running row's entries."""

    bias_tokens: np.ndarray  # int64
    bias_values: np.ndarray  # float32
    allowed: np.ndarray  # int64
    min_stops: np.ndarray  # int64
    min_counts: np.ndarray  # int64: the row's min_tokens, once per stop id
    bad_prefixes: np.ndarray  # int64 [words, HISTORY_WINDOW]
    bad_last: np.ndarray  # int64 [words]

    @classmethod
    def of(cls, params: SamplingParams, bad_words: list[list[int]], eos_token_ids: list[int]) -> _RowEntries:
        bias = params.logit_bias or {}
        stops: list[int] = []
        if params.min_tokens:
            stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))
        prefixes, last = pack_bad_words(bad_words, HISTORY_WINDOW)
        return cls(np.fromiter((int(t) for t in bias), np.int64, len(bias)),
                   np.fromiter((float(v) for v in bias.values()), np.float32, len(bias)),
                   np.asarray(params.allowed_token_ids or [], dtype=np.int64), np.asarray(stops, dtype=np.int64),
                   np.full(len(stops), params.min_tokens, dtype=np.int64), prefixes.numpy(), last.numpy())


def has_controls(params: SamplingParams) -> bool:
    return has_penalties(params) or bool(params.logit_bias or params.allowed_token_ids or params.min_tokens
                                         or params.bad_words)


def has_penalties(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


class LogitControls:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device, eos_token_ids: list[int],
                 initial_slots: int = 8):
        self.num_rows_total = num_rows
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = eos_token_ids  # min_tokens bans them (unless ignore_eos)
        self.slot_of_row = np.full(num_rows, -1, dtype=np.int64)
        self.repetition = np.ones(num_rows, dtype=np.float32)
        self.presence = np.zeros(num_rows, dtype=np.float32)
        self.frequency = np.zeros(num_rows, dtype=np.float32)
        self.has_row = np.zeros(num_rows, dtype=bool)
        self.num_rows = 0  # rows with any control
        self._entries: dict[int, _RowEntries] = {}  # rows with sparse controls
        self._sparse: _Sparse | None = None  # None: rebuild before the next step
        self._free_slots: list[int] = list(range(initial_slots - 1, -1, -1))
        self.history = TokenHistory.allocate(initial_slots, vocab_size, HISTORY_WINDOW, device)

    # ---- rows joining and leaving (host) --------------------------------------------------------------------

    def fill(self, row: int, params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
             bad_words: list[list[int]]) -> None:
        """A sequence takes `row` (first admission or readmission): its controls, its known tokens and its bad
        words as token ids. A row with penalties or bad words holds a history slot (neutral penalties for the
        latter: the slot serves the prefix match)."""
        self.clear(row)
        if not has_controls(params):
            return
        self.has_row[row] = True
        self.num_rows += 1
        if has_penalties(params) or bad_words:
            slot = self._take_slot()
            self.slot_of_row[row] = slot
            self.repetition[row] = params.repetition_penalty
            self.presence[row] = params.presence_penalty
            self.frequency[row] = params.frequency_penalty
            self.history.reset(slot, token_ids[:num_prompt_tokens], token_ids[num_prompt_tokens:])
        if params.logit_bias or params.allowed_token_ids or params.min_tokens or bad_words:
            self._entries[row] = _RowEntries.of(params, bad_words, self.eos_token_ids)
            self._sparse = None

    def clear(self, row: int) -> None:
        """`row` no longer holds a sequence (or is about to be refilled)."""
        if not self.has_row[row]:
            return
        self.has_row[row] = False
        self.num_rows -= 1
        slot = int(self.slot_of_row[row])
        if slot >= 0:
            self._free_slots.append(slot)
            self.slot_of_row[row] = -1
            self.repetition[row], self.presence[row], self.frequency[row] = 1, 0, 0
        if self._entries.pop(row, None) is not None:
            self._sparse = None

    def _take_slot(self) -> int:
        if not self._free_slots:  # double the pool; the copy runs on the stream after every step queued before
            old = self.history
            size = old.output_counts.shape[0]
            self.history = TokenHistory.allocate(2 * size, self.vocab_size, HISTORY_WINDOW, self.device)
            for name in ("output_counts", "prompt_mask", "seen_tokens", "num_seen", "recent", "output_lens"):
                getattr(self.history, name)[:size].copy_(getattr(old, name))
            self._free_slots = list(range(2 * size - 1, size - 1, -1))
        return self._free_slots.pop()

    def _sparse_tensors(self) -> _Sparse:
        if self._sparse is None and not self._entries:
            self._sparse = _Sparse(None, None, None, None)
        if self._sparse is None:
            rows = np.fromiter(self._entries, np.int64, len(self._entries))
            entries = list(self._entries.values())

            def joined(name: str) -> np.ndarray:
                return np.concatenate([getattr(e, name) for e in entries])

            def column(name: str) -> tuple[np.ndarray, np.ndarray]:
                """(persistent row of each entry, the entries) of one column over every row."""
                return np.repeat(rows, [len(getattr(e, name)) for e in entries]), joined(name)

            def device(*arrays: np.ndarray, dtypes=(torch.int64,) * 4) -> tuple[torch.Tensor, ...] | None:
                if not len(arrays[0]):
                    return None
                return tuple(upload(a, d, self.device) for a, d in zip(arrays, dtypes))

            allowed_counts = np.array([len(e.allowed) for e in entries])
            allowing = allowed_counts > 0
            allowed_offsets = np.cumsum(np.concatenate([[0], allowed_counts[allowing]]))
            bias_rows, bias_tokens = column("bias_tokens")
            bias_values = joined("bias_values")
            stop_rows, stops = column("min_stops")
            min_tokens = joined("min_counts")
            bad_rows, bad_last = column("bad_last")
            bad_prefixes = joined("bad_prefixes")
            self._sparse = _Sparse(
                device(bias_rows, bias_tokens, bias_values, dtypes=(torch.int64, torch.int64, torch.float32)),
                device(rows[allowing], allowed_offsets, joined("allowed")),
                device(stop_rows, stops, min_tokens),
                device(bad_rows, self.slot_of_row[bad_rows], bad_prefixes, bad_last))
        return self._sparse

    # ---- one step --------------------------------------------------------------------------------------------

    def stage(self, host: dict[str, np.ndarray], rows: np.ndarray, samples: list[bool]) -> int:
        """Fill the step's penalty inputs: batch indices of the rows that hold a history slot and sample in this
        step (a chunk short of the prompt's end samples nothing: its logits and its draw do not count), their
        slots and penalties; returns their number."""
        slots = self.slot_of_row[rows]
        holding = slots >= 0
        if not all(samples):
            holding &= np.asarray(samples, dtype=bool)
        at = np.flatnonzero(holding)
        count = len(at)
        if count:
            host["penalty_rows"][:count] = at
            host["penalty_slots"][:count] = slots[at]
            host["repetition_penalties"][:count] = self.repetition[rows[at]]
            host["presence_penalties"][:count] = self.presence[rows[at]]
            host["frequency_penalties"][:count] = self.frequency[rows[at]]
        return count

    def apply(self, logits: torch.Tensor, batch_rows: torch.Tensor, output_lens: torch.Tensor,
              penalty: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
        """float32 logits [n, vocab] with every control applied (a copy; `logits` is left as it is, for the
        logprobs of the raw distribution). `batch_rows`: the step's persistent rows [n]; `output_lens` [n]: the
        index of the output token each row draws; `penalty`: (batch indices, slots, repetition, presence,
        frequency) of the staged rows, or None."""
        work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        sparse = self._sparse_tensors()
        if sparse.bias or sparse.allowed or sparse.min_tokens or sparse.bad_words:
            index = batch_index_of(batch_rows, self.num_rows_total)
            if sparse.allowed:
                apply_allowed_tokens(work, index, *sparse.allowed)
            if sparse.bad_words:
                apply_bad_words(work, index, *sparse.bad_words, self.history)
            if sparse.min_tokens:
                apply_min_tokens(work, index, *sparse.min_tokens, output_lens)
            if sparse.bias:
                apply_logit_bias(work, index, *sparse.bias)
        if penalty is not None:
            rows, slots, repetition, presence, frequency = penalty
            apply_penalties(work, rows, slots, self.history, repetition, presence, frequency)
        return work

    def record(self, sampled: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Advance the staged rows' histories by this step's samples (`sampled` [batch]; `rows`: the staged rows'
        batch indices), on the device."""
        self.history.record(slots, sampled, rows)
