"""The host side of structured outputs for one engine: compiles, each row's matcher, its accepts, its token masks.

The scheduler asks it whether a waiting row's grammar is ready (`start_row`) and tells it when a row stops running
(`release`, `preempt`); the step loop asks it for a step's constrained rows (`plan`), hands it each step's sampled
tokens (`start_accepts`) and takes the step's mask (`step_mask`), which is all the runner sees; the engine asks it
for a finished row's text (`output`). docs/STRUCTURED_OUTPUTS.md has the picture.

Masks live in host tables, one line per running constrained row (its slot), two tables alternating by step. After
step t's tokens reach the host, one worker thread accepts them into the rows' matchers and fills the lines of the
rows that go on into the table of the next step (xgrammar's batched fill on `fill_threads` threads; xgrammar
releases the GIL), while the caller postprocesses step t and, in the sync loop, schedules and launches the next
forward. `step_mask` waits for that work, fills only the lines that are not current yet (a row new to sampling,
whose first mask is its grammar's start mask, copied), and returns the step's `StepMask`.

A row's matcher holds exactly its committed output tokens: a step's tokens are accepted only for the rows whose
epoch and status say the step still counts (as `Scheduler.postprocess` commits them), so preemption needs no
rollback: the row resumes from its committed tokens and its grammar is already there."""
from __future__ import annotations

import heapq
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from nanovllm.kernels.token_bitmask import bitmask_width
from nanovllm.structured.bitmask import CopyFence, StepMask
from nanovllm.structured.compile_cache import CompileFuture, GrammarCompileCache, host_cpus

if TYPE_CHECKING:
    from nanovllm.structured.params import StructuredOutputsParams
    from nanovllm.structured.row_grammar import RowGrammar


class ConstrainedSequence(Protocol):
    """What the manager reads of a sequence (the engine's `Sequence` has these, and more)."""

    epoch: int  # changes when the sequence is preempted: a step scheduled before no longer counts for it
    params: Any  # its SamplingParams: `stop_token_ids`
    max_len: int
    grammar_future: CompileFuture | None
    grammar: RowGrammar | None  # the manager sets it (start_row)

    @property
    def num_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...


@dataclass
class StepGrammars:
    """The constrained rows that sample in one step: (batch index = logits row, sequence, its epoch)."""

    rows: list[tuple[int, ConstrainedSequence, int]]


@dataclass
class GrammarTimes:
    """Host seconds per phase, summed since the manager started (scripts/bench_structured.py reads them)."""

    rows_started: int = 0
    start_row_s: float = 0.0  # matcher creation at admission (step loop thread)
    steps: int = 0  # step masks built
    accept_s: float = 0.0  # batched accepts (worker thread)
    fill_s: float = 0.0  # batched fills of the rows that go on (worker thread)
    step_fill_s: float = 0.0  # step_mask's own fills and copies (step loop thread)
    wait_s: float = 0.0  # the step loop waiting for the worker
    rows_filled: int = 0  # lines filled by xgrammar (either thread)
    rows_copied: int = 0  # lines copied from a grammar's start mask


@dataclass
class RowOutput:
    text: str  # the bytes the row's grammar accepted (no stop token)
    complete: bool  # a complete match of the constraint
    error: str | None  # a token the grammar rejected: the request fails
    invalid_request: bool = False  # the rejection is the constraint's fault (nothing could follow), not the engine's


class GrammarManager:
    """Structured outputs of one engine with at most `max_rows` running sequences, compiled by `compiles`. Made
    when the engine starts: the compile cache builds the tokenizer's tables on a background thread from then on,
    so an engine that never constrains only pays that thread. `pin_memory` (default: when CUDA is there) pins the
    mask tables for their copy to the device."""

    def __init__(self, compiles: GrammarCompileCache, eos_token_ids, max_rows: int, pin_memory: bool | None = None,
                 fill_threads: int | None = None):
        self.compiles = compiles
        self.eos_token_ids = tuple(sorted(eos_token_ids))
        self.max_rows = max_rows
        # the step loop's thread keeps one CPU; the fill takes the others this process may use
        self.fill_threads = fill_threads or max(1, host_cpus() - 1)
        self.times = GrammarTimes()
        self._pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory  # for the copy to a GPU
        self._tables: list[torch.Tensor] = []  # made with the first constrained step
        self._lines: list[torch.Tensor] = []
        self._lines_np: list = []
        self._fences = [CopyFence(), CopyFence()]
        self._free_slots = list(range(max_rows))  # a heap: the lowest free slot first keeps masks short
        self._num_rows = 0  # rows started and not released
        self._step = 0  # step masks built; table `_step & 1` is the next one's
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-step")
        self._pending: Future | None = None
        self._batch_matcher = None
        self._mask_vocab_size = 0

    # ---- requests and rows (engine, scheduler) ------------------------------------------------------------------

    def request(self, params: StructuredOutputsParams) -> CompileFuture:
        """The compile of a request's constraint; never blocks."""
        return self.compiles.request(params)

    def start_row(self, seq: ConstrainedSequence) -> None:
        """Give a waiting sequence whose compile is ready (`seq.grammar_future.ready()`) its row matcher. Raises the
        compile's error (or any other): that request fails alone."""
        started = time.perf_counter()
        from nanovllm.structured.row_grammar import RowGrammar

        compiled = seq.grammar_future.result()
        seq.grammar = RowGrammar(compiled, [*self.eos_token_ids, *seq.params.stop_token_ids])
        self._num_rows += 1
        self.times.rows_started += 1
        self.times.start_row_s += time.perf_counter() - started

    def preempt(self, seq: ConstrainedSequence) -> None:
        """`seq` left the running set to be recomputed: its slot is free, its matcher stays (see the module)."""
        if seq.grammar is not None:
            self._free_slot(seq.grammar)

    def release(self, seq: ConstrainedSequence) -> None:
        """`seq` finished or was aborted."""
        if seq.grammar is not None:
            self._free_slot(seq.grammar)
            self._num_rows -= 1

    def _free_slot(self, row: RowGrammar) -> None:
        if row.slot is not None:
            heapq.heappush(self._free_slots, row.slot)
            row.slot = row.mask_at = None

    def output(self, seq: ConstrainedSequence) -> RowOutput:
        """A finished constrained row's text (the bytes its grammar accepted, its stop token left out) and whether
        it is a complete match."""
        self._join()
        row = seq.grammar
        tokens = seq.output_token_ids
        if row is None:  # failed before it ran
            return RowOutput("", False, None)
        if tokens and row.is_terminated() and tokens[-1] in row.stop_token_ids:
            tokens = tokens[:-1]
        error = row.rejection() if row.rejected_token is not None else None
        text = row.compiled.vocabulary.text(tokens)
        return RowOutput(text, row.is_completed() and error is None, error, row.dead_end)

    def drain(self) -> None:
        """Wait for the worker (before the engine drops its sequences after a failed step, whose error it reports:
        an error of the worker's is that step's)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.exception()

    # ---- steps (step loop) --------------------------------------------------------------------------------------

    def plan(self, seqs: list[ConstrainedSequence], samples: list[bool], epochs: list[int]) -> StepGrammars | None:
        """The constrained rows that sample in a step of `seqs` (a ScheduledBatch's lists), each given a slot;
        None when there are none (then the step is launched whole, with no mask)."""
        if not self._num_rows:
            return None
        rows = [(i, seq, epoch) for i, (seq, sample, epoch) in enumerate(zip(seqs, samples, epochs))
                if sample and seq.grammar is not None]
        if not rows:
            return None
        if not self._tables:
            self._make_tables(rows[0][1].grammar.mask_vocab_size)
        for _, seq, _ in rows:
            if seq.grammar.slot is None:
                seq.grammar.slot = heapq.heappop(self._free_slots)
        return StepGrammars(rows)

    def _make_tables(self, mask_vocab_size: int) -> None:
        import xgrammar as xgr

        self._mask_vocab_size = mask_vocab_size
        width = bitmask_width(mask_vocab_size)
        self._tables = [torch.empty(self.max_rows, width, dtype=torch.int32, pin_memory=self._pin_memory)
                        for _ in range(2)]
        self._lines = [torch.empty(self.max_rows, dtype=torch.int64, pin_memory=self._pin_memory) for _ in range(2)]
        self._lines_np = [lines.numpy() for lines in self._lines]  # written by index lists in one call
        self._batch_matcher = xgr.BatchGrammarMatcher(self.fill_threads)

    def start_accepts(self, grammars: StepGrammars, sampled: list[int]) -> None:
        """Step `grammars`' tokens are on the host (`sampled`, by batch index) and not postprocessed yet: start
        accepting them, and filling the next step's lines of the rows that go on, on the worker thread."""
        self._join()
        rows, tokens, fill = [], [], []
        for index, seq, epoch in grammars.rows:
            row = seq.grammar
            if seq.epoch != epoch or row.slot is None:
                continue  # void (preempted since) or ended before this step: as postprocess will judge it
            token = sampled[index]
            # a row's mask for the next step is needed unless this token ends it (a stop token, its length)
            goes_on = token not in row.stop_token_ids and seq.num_tokens + 1 < seq.max_len
            fill.append(row.slot if goes_on else -1)
            rows.append(row)
            tokens.append(token)
        if rows:
            self._fences[self._step & 1].wait()
            self._pending = self._worker.submit(self._advance, rows, tokens, fill, self._step)

    def _advance(self, rows: list[RowGrammar], tokens: list[int], slots: list[int],
                 step: int) -> list[tuple[RowGrammar, int]]:
        """On the worker: accept, then fill the going-on rows' lines of table `step & 1`; the rejected tokens."""
        import xgrammar as xgr

        started = time.perf_counter()
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([row.matcher for row in rows], tokens)
        rejected = []
        fill_rows, fill_slots = [], []
        for row, token, ok, slot in zip(rows, tokens, accepted, slots):
            if not ok:
                rejected.append((row, token))
                continue
            row.num_accepted += 1
            if slot >= 0:
                fill_rows.append(row)
                fill_slots.append(slot)
        accepted_at = time.perf_counter()
        if fill_rows:
            self._batch_matcher.batch_fill_next_token_bitmask([row.matcher for row in fill_rows], self._tables[step & 1],
                                                              fill_slots)
            for row, slot in zip(fill_rows, fill_slots):
                row.mask_at = (step, slot)
        self.times.accept_s += accepted_at - started
        self.times.fill_s += time.perf_counter() - accepted_at
        self.times.rows_filled += len(fill_rows)
        return rejected

    def _join(self) -> None:
        if self._pending is None:
            return
        started = time.perf_counter()
        pending, self._pending = self._pending, None
        for row, token in pending.result():
            row.note_rejected(token)  # postprocess fails the row at its next step
        self.times.wait_s += time.perf_counter() - started

    def step_mask(self, grammars: StepGrammars) -> StepMask:
        """The mask of the step `grammars` was planned for: the worker's lines, and the ones it did not fill."""
        from nanovllm.structured.vocabulary import clear_bits_past

        self._join()
        started = time.perf_counter()
        step = self._step
        self._step += 1
        self.times.steps += 1
        which = step & 1
        self._fences[which].wait()
        table, lines = self._tables[which], self._lines[which]
        slots: list[int] = []
        indices: list[int] = []
        stale: list[RowGrammar] = []
        starting: list[RowGrammar] = []
        for index, seq, epoch in grammars.rows:
            row = seq.grammar
            slot = row.slot
            if slot is None or seq.epoch != epoch:
                continue  # ended since it was planned (the async loop's placeholder): its sample is discarded
            if row.mask_at != (step, slot):
                if row.is_terminated():
                    continue  # ended on a stop token, not released yet: its sample is discarded too
                start = row.compiled.start_masks.get(row.stop_token_ids) if row.num_accepted == 0 else None
                if start is not None:
                    table[slot] = start
                    self.times.rows_copied += 1
                else:
                    stale.append(row)
                    if row.num_accepted == 0:
                        starting.append(row)
                row.mask_at = (step, slot)
            slots.append(slot)
            indices.append(index)
        if stale:
            self._batch_matcher.batch_fill_next_token_bitmask([row.matcher for row in stale], table,
                                                              [row.slot for row in stale])
            self.times.rows_filled += len(stale)
        high = max(slots) + 1 if slots else 0
        lines_view = self._lines_np[which]
        lines_view[:high] = -1
        lines_view[slots] = indices
        if high:
            clear_bits_past(table[:high], self._mask_vocab_size)
        for row in starting:
            row.compiled.start_masks.setdefault(row.stop_token_ids, table[row.slot].clone())
        self.times.step_fill_s += time.perf_counter() - started
        return StepMask(table[:high], lines[:high], self.max_rows, self._fences[which])

    def shutdown(self) -> None:
        """Stop the worker (the compile cache, which the caller gave, is the caller's to stop)."""
        self._worker.shutdown(wait=False, cancel_futures=True)
