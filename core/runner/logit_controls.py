"""Rank 0's device state for penalties and logit controls of the running rows, and their per-step application.

The ops are `nanovllm.layers.logit_controls` (vLLM's semantics and order). State lives on the device and
changes only when a row with controls joins or leaves, never from the host per step:

- Rows with repetition / presence / frequency penalties hold a `TokenHistory` slot: prompt mask, output counts
  and the list of distinct seen tokens (what a penalty touches: a step's penalties cost what the histories hold,
  not the vocabulary), reset from the host's known tokens when the row is (re)filled, then advanced on the
  device from each step's samples (`record`), so the async loop's step N + 1 sees step N's token without a host
  round trip.
- Sparse controls (logit_bias, min_tokens' stop ids, bad words) are entry lists keyed by the persistent row
  (`_EntryPool`: a row joining or leaving costs its own entries), mapped to a step's batch indices on the device;
  entries of rows not in the step do nothing. allowed_token_ids is a bitmask row per persistent row, applied as
  a structured output's mask is.

A step in which no row has controls runs none of this (the runner checks `num_rows`)."""
from __future__ import annotations

import numpy as np
import torch

from nanovllm.layers.logit_controls import (
    HISTORY_WINDOW,
    TokenHistory,
    allowed_bitmask,
    apply_allowed_tokens,
    apply_bad_words,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    batch_index_of,
    pack_bad_words,
)
from nanovllm.sampling_params import SamplingParams


class _EntryPool:
    """One sparse control's entries on the device, keyed by persistent row: column 0 holds each entry's row, the
    others its fields ([capacity] or [capacity, width]). A joining row appends its entries (one copy per column);
    a leaving row's entries are pointed at `dead_row`, a persistent row no step holds, so they do nothing (one
    fill). A join or a leave thus costs that row's entries, never the other running rows' (a stream of rows
    joining and leaving at every step would otherwise rebuild every row's lists at every step); the pool is
    rebuilt from the live rows only when a row's entries would pass its capacity, which it then sets to twice the
    live entries."""

    def __init__(self, device: torch.device, dead_row: int, dtypes: tuple[torch.dtype, ...]):
        self.device = device
        self.dead_row = dead_row
        self.dtypes = (torch.int64, *dtypes)
        self.live: dict[int, tuple[int, tuple[np.ndarray, ...]]] = {}  # row -> (first entry, its fields)
        self.columns: list[torch.Tensor] = []
        self.end = 0  # entries in use, the retired ones included

    def add(self, row: int, fields: tuple[np.ndarray, ...]) -> None:
        count = len(fields[0])
        if not count:
            return
        if not self.columns or self.end + count > len(self.columns[0]):
            self.live[row] = (0, fields)
            self._rebuild()
            return
        self.live[row] = (self.end, fields)
        self.columns[0][self.end:self.end + count].fill_(row)
        for column, values in zip(self.columns[1:], fields):
            column[self.end:self.end + count].copy_(torch.from_numpy(values), non_blocking=True)
        self.end += count

    def remove(self, row: int) -> None:
        entry = self.live.pop(row, None)
        if entry is None:
            return
        if not self.live:
            self.end = 0
            return
        first, fields = entry
        self.columns[0][first:first + len(fields[0])].fill_(self.dead_row)

    def _rebuild(self) -> None:
        """Every live row's entries, packed from the start, in new tensors of twice their number (a step in flight
        keeps the old ones)."""
        rows = list(self.live)
        counts = [len(fields[0]) for _, fields in self.live.values()]
        joined = [np.concatenate(parts) for parts in zip(*(fields for _, fields in self.live.values()))]
        capacity = 2 * sum(counts)
        host = [np.repeat(np.asarray(rows, dtype=np.int64), counts), *joined]
        self.columns = []
        for values, dtype in zip(host, self.dtypes):
            column = torch.empty((capacity, *values.shape[1:]), dtype=dtype, device=self.device)
            column[:len(values)].copy_(torch.from_numpy(values), non_blocking=True)
            self.columns.append(column)
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        self.live = {row: (int(start), fields) for row, start, (_, fields) in zip(rows, starts, self.live.values())}
        self.end = sum(counts)

    def tensors(self) -> tuple[torch.Tensor, ...] | None:
        """The entries in use (row, fields...), or None when no live row has any."""
        return tuple(column[:self.end] for column in self.columns) if self.live else None


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
        # the sparse controls' entries; `num_rows` is the persistent row no step holds, where retired entries point
        self.bias = _EntryPool(device, num_rows, (torch.int64, torch.float32))  # token, bias
        self.min_tokens = _EntryPool(device, num_rows, (torch.int64, torch.int64))  # stop id, the row's min_tokens
        self.bad_words = _EntryPool(device, num_rows, (torch.int64, torch.int64, torch.int64))  # slot, prefix, last
        # allowed_token_ids: a bitmask row per persistent row (allocated when a row first has some)
        self.allowed_rows: torch.Tensor | None = None  # bool [rows]
        self.allowed_bitmask: torch.Tensor | None = None  # int32 [rows, bitmask words]
        self._allowing = np.zeros(num_rows, dtype=bool)
        self.num_allowed_rows = 0
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
        if params.logit_bias:
            self.bias.add(row, (np.fromiter(params.logit_bias, np.int64, len(params.logit_bias)),
                                np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias))))
        if params.min_tokens:
            stops = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids)))
            self.min_tokens.add(row, (np.asarray(stops, dtype=np.int64),
                                      np.full(len(stops), params.min_tokens, dtype=np.int64)))
        if bad_words:
            prefixes, last = pack_bad_words(bad_words, HISTORY_WINDOW)
            self.bad_words.add(row, (np.full(len(last), self.slot_of_row[row], dtype=np.int64), prefixes.numpy(),
                                     last.numpy()))
        if params.allowed_token_ids:
            self._allow(row, params.allowed_token_ids)

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
        for pool in (self.bias, self.min_tokens, self.bad_words):
            pool.remove(row)
        if self._allowing[row]:
            self._allowing[row] = False
            self.allowed_rows[row] = False
            self.num_allowed_rows -= 1

    def _allow(self, row: int, token_ids: list[int]) -> None:
        bits = torch.from_numpy(allowed_bitmask(token_ids, self.vocab_size))
        if self.allowed_bitmask is None:
            self.allowed_rows = torch.zeros(self.num_rows_total, dtype=torch.bool, device=self.device)
            self.allowed_bitmask = torch.empty(self.num_rows_total, len(bits), dtype=torch.int32, device=self.device)
        self.allowed_bitmask[row].copy_(bits, non_blocking=True)
        self.allowed_rows[row] = True
        self._allowing[row] = True
        self.num_allowed_rows += 1

    def _take_slot(self) -> int:
        if not self._free_slots:  # double the pool; the copy runs on the stream after every step queued before
            old = self.history
            size = old.output_counts.shape[0]
            self.history = TokenHistory.allocate(2 * size, self.vocab_size, HISTORY_WINDOW, self.device)
            for name in ("output_counts", "prompt_mask", "seen_tokens", "num_seen", "recent", "output_lens"):
                getattr(self.history, name)[:size].copy_(getattr(old, name))
            self._free_slots = list(range(2 * size - 1, size - 1, -1))
        return self._free_slots.pop()

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
        bias, min_tokens, bad_words = self.bias.tensors(), self.min_tokens.tensors(), self.bad_words.tensors()
        if bias or min_tokens or bad_words or self.num_allowed_rows:
            index = batch_index_of(batch_rows, self.num_rows_total + 1)  # and the retired entries' row: -1
            if self.num_allowed_rows:
                apply_allowed_tokens(work, index, self.allowed_rows, self.allowed_bitmask)
            if bad_words:
                apply_bad_words(work, index, *bad_words, self.history)
            if min_tokens:
                apply_min_tokens(work, index, *min_tokens, output_lens)
            if bias:
                apply_logit_bias(work, index, *bias)
        if penalty is not None:
            rows, slots, repetition, presence, frequency = penalty
            apply_penalties(work, rows, slots, self.history, repetition, presence, frequency)
        return work

    def record(self, sampled: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Advance the staged rows' histories by this step's samples (`sampled` [batch]; `rows`: the staged rows'
        batch indices), on the device."""
        self.history.record(slots, sampled, rows)
