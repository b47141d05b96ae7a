"""The persistent batch: the running sequences as the device side keeps them between steps, and the fill of one
step's host buffers from them (docs/ARCHITECTURE.md).

`SequenceRows` (rank 0's host side) gives each running sequence a row that it keeps while it runs: its block table
and the settings that do not change while it runs (sampling, prompt length, logit controls), so a step gathers them
by row instead of rebuilding them from Python objects. `DeviceBlockTables` (every rank) mirrors the tables on the
device; a step carries only the entries added since the previous step. `PersistentBatch` owns both and the step
launched last (whose samples are the next step's pending inputs), and writes a step's token inputs, KV slots,
sampling settings and pending-input gathers into the host views of the step buffers, vectorised over the batch:
per sequence, only the row lookup is Python work.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.runner.logit_controls import LogitControls
from nanovllm.step_types import ScheduledBatch, ScheduledSequence


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
        self.lora_slot = np.full(rows, -1, dtype=np.int32)  # the LoRA adapter's device slot; -1 = the base model
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

    def sync(self, changed: list[ScheduledSequence]) -> tuple[list[int], list[int]]:
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

    def _refill(self, seq: ScheduledSequence, entry: _Row | None) -> _Row:
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
        self.lora_slot[row] = seq.lora_slot
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


@dataclass
class _LastStep:
    """The step launched last, as far as the next one needs it: its samples (on the device) feed the next step's
    pending inputs. `index_of_row[r]` is the batch index the sequence of row r had in it (-1: not in it)."""

    rows: np.ndarray
    index_of_row: np.ndarray
    sampled: torch.Tensor | None = None


class PersistentBatch:
    """Rows for twice the running sequences (released ones may still be read by the step in flight), their
    device tables, their logit controls, and the step launched last. A row's table interleaves the KV groups'
    tables (kv_groups.py)."""

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, num_groups: int, block_size: int,
                 vocab_size: int, eos_token_ids: list[int], device: torch.device):
        table_width = num_groups * max_blocks_per_seq
        self.rows = SequenceRows(2 * max_batch_size, table_width, vocab_size)
        self.controls = self.rows.controls = LogitControls(len(self.rows.host_tables), vocab_size, device,
                                                           eos_token_ids)
        self.tables = DeviceBlockTables(len(self.rows.host_tables), table_width, device)
        self.block_size = block_size
        self.num_groups = num_groups
        self.vocab_size = vocab_size
        self._rows_of: tuple[list, np.ndarray] = ([], np.zeros(0, dtype=np.int64))  # a batch's seqs, their rows
        self._arange = np.arange(max_batch_size + 1)
        self._last = _LastStep(np.zeros(0, dtype=np.int64), np.full(len(self.rows.host_tables), -1, dtype=np.int64))

    @property
    def last_sampled(self) -> torch.Tensor | None:
        """The device ids sampled by the step launched last."""
        return self._last.sampled

    @last_sampled.setter
    def last_sampled(self, sampled: torch.Tensor) -> None:
        self._last.sampled = sampled

    def sync(self, batch: ScheduledBatch) -> tuple[np.ndarray, list[int], list[int]]:
        """Release the rows of sequences that stopped, bring the changed rows up to date; returns the batch's rows
        and the table entries the device lacks (flat indices, block ids)."""
        self.rows.release(batch.released_seq_ids)
        update_indices, update_blocks = self.rows.sync(batch.table_changed)
        seqs = batch.seqs
        if seqs is not self._rows_of[0]:  # the scheduler's steady decode steps reuse one list of sequences
            row_of = self.rows.row_of
            self._rows_of = (seqs, np.fromiter([row_of[seq.seq_id] for seq in seqs], np.int64, len(seqs)))
        return self._rows_of[1], update_indices, update_blocks

    def is_steady_decode(self, batch: ScheduledBatch, rows: np.ndarray) -> bool:
        """Every input is the last step's sample of the same row (a decode step of the same sequences), so the
        inputs can be copied on the device in one go."""
        return (len(batch.pending_inputs) == len(rows) and batch.num_tokens == len(rows)
                and (rows is self._last.rows or np.array_equal(rows, self._last.rows)))

    def stage_table_updates(self, host: dict[str, np.ndarray], update_indices: list[int], update_blocks: list[int],
                            graph_updates: int | None) -> int:
        """The table entries the device lacks (flat indices, block ids), as the step carries them: a graph's
        fixed number (padded with writes to the sink row), or all of them. Returns that number."""
        num_updates = len(update_blocks)
        num_staged = graph_updates or num_updates
        staged = host["table_updates"]
        staged[:num_updates] = update_indices
        staged[num_staged:num_staged + num_updates] = update_blocks
        if num_staged > num_updates:
            staged[num_updates:num_staged] = self.tables.sink_index
            staged[num_staged + num_updates:2 * num_staged] = 0
        return num_staged

    def fill_token_inputs(self, host: dict[str, np.ndarray], batch: ScheduledBatch, rows: np.ndarray,
                           padded_seqs: int, ids_on_device: bool) -> np.ndarray:
        """Ids (unless `ids_on_device`), positions, KV slots, query starts, context lengths, logits indices and
        the rows (graph padding included); returns each sequence's context length after the step."""
        num_seqs, num_tokens = len(rows), batch.num_tokens
        host_rows = host["rows"][:padded_seqs]
        host_rows[:num_seqs] = rows
        host_rows[num_seqs:] = self.rows.padding_row
        starts = np.array(batch.start_positions, dtype=np.int64)
        query_start = host["query_start_loc"][:num_seqs + 1]
        if num_tokens == num_seqs:
            query_start[:] = self._arange[:num_seqs + 1]
            positions, token_rows, ends = starts, rows, starts + 1
        else:
            num_new = np.array(batch.num_new_tokens, dtype=np.int64)
            query_start[0] = 0
            np.cumsum(num_new, out=query_start[1:])
            positions = np.arange(num_tokens) + np.repeat(starts - query_start[:-1], num_new)
            token_rows = np.repeat(rows, num_new)
            ends = starts + num_new
        block_size, groups = self.block_size, self.num_groups
        # [groups, step tokens]: the step's views are as wide as its padded token count
        slots = host["slot_mapping"][:groups * max(num_tokens, padded_seqs)].reshape(groups, -1)
        columns, offsets = positions // block_size, positions % block_size
        if groups > 1:
            columns *= groups
        shared = positions < self.rows.num_shared_kv_tokens[token_rows]  # complete shared blocks: no write
        for group in range(groups):
            group_slots = slots[group, :num_tokens]
            np.add(self.rows.host_tables[token_rows, columns + group if group else columns] * block_size, offsets,
                   out=group_slots)
            group_slots[shared] = -1
        if not ids_on_device:
            host["input_ids"][:num_tokens] = batch.input_ids
        host["positions"][:num_tokens] = positions
        host["seq_lens"][:num_seqs] = ends
        np.subtract(query_start[1:], 1, out=host["logits_indices"][:num_seqs])
        if padded_seqs > num_seqs:  # graph padding: one token each, no KV written, the all-zero table row
            pad = slice(num_seqs, padded_seqs)
            host["input_ids"][pad] = 0
            host["positions"][pad] = 0
            slots[:, pad] = -1
            host["query_start_loc"][num_seqs + 1:padded_seqs + 1] = self._arange[num_tokens + 1:padded_seqs + 1]
            host["seq_lens"][pad] = 1
        return ends

    def fill_sampling(self, host: dict[str, np.ndarray], rows: np.ndarray, ends: np.ndarray) -> tuple[bool, bool]:
        """Each sequence's sampling settings, from its row; returns (all greedy, any top-k/top-p/min-p)."""
        num_seqs = len(rows)
        temperatures = host["temperatures"][:num_seqs]
        np.take(self.rows.temperature, rows, out=temperatures)
        if not temperatures.any():
            return True, False
        for name, values in (("top_k", self.rows.top_k), ("top_p", self.rows.top_p),
                             ("min_p", self.rows.min_p), ("seeds", self.rows.seed)):
            np.take(values, rows, out=host[name][:num_seqs])
        any_filter = bool((host["top_k"][:num_seqs] < self.vocab_size).any()
                          or (host["top_p"][:num_seqs] < 1).any() or host["min_p"][:num_seqs].any())
        # index of the output token each row draws: the token after the chunk's last position
        np.subtract(ends, self.rows.num_prompt_tokens[rows], out=host["sample_positions"][:num_seqs])
        return False, any_filter

    def fill_lora_slots(self, host: dict[str, np.ndarray], batch: ScheduledBatch, rows: np.ndarray,
                        padded_tokens: int) -> bool:
        """Each token's LoRA adapter slot, from its row (-1: the base model, and graph padding); returns whether
        any token has an adapter (if not, nothing is written and the step runs the base model alone)."""
        slots = self.rows.lora_slot[rows]
        if not (slots >= 0).any():
            return False
        num_tokens = batch.num_tokens
        token_slots = host["lora_slots"][:padded_tokens]
        token_slots[:num_tokens] = slots if num_tokens == len(rows) else np.repeat(slots, batch.num_new_tokens)
        token_slots[num_tokens:] = -1
        return True

    def stage_pending(self, host: dict[str, np.ndarray], batch: ScheduledBatch, rows: np.ndarray) -> int:
        """For each pending input, its token index in this step and its index in the last step's samples (by the
        sequence's row); returns their number."""
        count = len(batch.pending_inputs)
        if count:
            at = np.array(batch.pending_inputs, dtype=np.int64)
            sources = self._last.index_of_row[rows[at]]
            if (sources < 0).any():
                raise RuntimeError("a pending input's sequence was not in the step launched before")
            host["pending_tokens"][:count] = host["query_start_loc"][at + 1] - 1
            host["pending_sources"][:count] = sources
        return count

    def fill_controls(self, host: dict[str, np.ndarray], rows: np.ndarray, ends: np.ndarray, samples: list[bool],
                      all_greedy: bool) -> tuple[bool, int]:
        """The penalties and logit controls of the batch's rows; returns (whether any row has some, the number of
        sampled rows with penalties)."""
        if not self.controls.num_rows:
            return False, 0
        num_penalty_rows = self.controls.stage(host, rows, samples)
        if all_greedy:  # min_tokens reads each row's output length, which fill_sampling skipped
            np.subtract(ends, self.rows.num_prompt_tokens[rows], out=host["sample_positions"][:len(rows)])
        return True, num_penalty_rows

    def remember(self, rows: np.ndarray) -> None:
        """`rows` are the step just prepared: the next step's pending inputs are gathered from its samples."""
        last = self._last
        last.index_of_row[last.rows] = -1
        last.index_of_row[rows] = self._arange[:len(rows)]
        last.rows = rows
