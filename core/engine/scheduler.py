from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.logprob_records import record_step_logprobs
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.engine.stop_strings import StopStringDetector
from nanovllm.kv_groups import max_blocks_held
from nanovllm.step_types import ScheduledBatch, StepLogprobs
from nanovllm.structured.compile_cache import GrammarSetupError

if TYPE_CHECKING:
    from nanovllm.lora.manager import LoRAManager
    from nanovllm.structured import GrammarManager
    from nanovllm.structured.row_grammar import RowGrammar


@dataclass
class _DecodePlan:
    """The previous step when it was only decodes, of every running sequence that had a token to compute: the
    next step, unless a sequence joined or was preempted since, is that batch one position further on, less the
    sequences that finished or whose last token is now in flight. Arrays and lists follow `seqs`."""

    seqs: list[Sequence]
    epochs: list[int]
    starts: np.ndarray  # the positions the previous step computed
    max_lens: np.ndarray
    capacities: np.ndarray  # tokens each block table holds
    running_version: int  # the running set it was made for
    num_finished: int  # the scheduler's finish count when it was made
    zeros: list[int]  # [0] * len(seqs)
    indices: list[int]  # list(range(len(seqs)))

    def subset(self, rows: np.ndarray) -> _DecodePlan:
        kept = rows.tolist()
        return _DecodePlan([self.seqs[i] for i in kept], [self.epochs[i] for i in kept], self.starts[rows],
                           self.max_lens[rows], self.capacities[rows], self.running_version, self.num_finished,
                           self.zeros[:len(kept)], self.indices[:len(kept)])


class Scheduler:
    """Decides which tokens each step computes, under a token budget and the KV blocks available, and applies
    every stop rule to what a step sampled (docs/ARCHITECTURE.md).

    It plans from each sequence's effective state (committed + in flight), so the async loop can schedule step
    N+1 before step N's tokens are known; `postprocess` commits steps in the order they were scheduled."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int], stop_strings: StopStringDetector | None = None,
                 lora: LoRAManager | None = None, grammars: GrammarManager | None = None):
        self.block_manager = block_manager
        self.lora = lora  # LoRA adapters' device slots (None: the engine runs the base model only)
        self.grammars = grammars  # structured outputs (None: the model has no tokenizer)
        self.stop_strings = stop_strings  # needs the tokenizer; a model without one has no stop strings
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.finished: list[Sequence] = []  # finished since the last take_finished()
        self._released: list[int] = []  # ids finished or preempted since the last batch (see ScheduledBatch)
        # A steady decode step (see _DecodePlan) is scheduled without a Python loop over the running sequences.
        self._running_version = 0  # changes whenever a sequence joins `running` or is preempted
        self._num_finished = 0
        self._plan: _DecodePlan | None = None  # set by the previous schedule() only

    def add(self, seq: Sequence) -> None:
        seq.max_len = self.max_len_of(seq)
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def max_len_of(self, seq: Sequence) -> int:
        return min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)

    def capacity_error(self, seq: Sequence) -> str | None:
        """Why `seq` can never run, even alone in the cache; None when it can."""
        if seq.num_prompt_tokens >= self.max_model_len:
            return (f"prompt has {seq.num_prompt_tokens} tokens, but max_model_len is {self.max_model_len} "
                    "(it must leave room for at least one output token)")
        manager = self.block_manager
        needed = max_blocks_held(manager.windows, self.max_len_of(seq), manager.block_size,
                                 self.max_num_batched_tokens)
        if needed > manager.num_blocks:
            return (f"request needs up to {needed} KV blocks ({self.max_len_of(seq)} tokens) but the cache has only "
                    f"{self.block_manager.num_blocks}; lower max_tokens or raise the KV budget (num_kv_blocks, "
                    "gpu_memory_utilization)")
        return None

    def schedule(self) -> ScheduledBatch:
        plan, self._plan = self._plan, None
        batch = self._schedule_steady_decode(plan) if plan else None
        if batch is None:
            batch = self._schedule()
        if batch:
            batch.released_seq_ids, self._released = self._released, []
            if self.lora is not None:
                batch.lora_loads = self.lora.take_loads()
        return batch

    def wait_for_compile(self, timeout: float | None = None) -> None:
        """Block until the first waiting sequence's pending structured-output compile finishes (the step loop
        calls this when nothing else can run, instead of spinning); returns at once when none is pending."""
        for seq in self.waiting:
            if seq.grammar is None and seq.grammar_future is not None and not seq.grammar_future.ready():
                seq.grammar_future.wait(timeout)
                return

    def _schedule_steady_decode(self, plan: _DecodePlan) -> ScheduledBatch | None:
        """The previous step's decodes one position further on (see _DecodePlan), when nothing else can join the
        step; None when that does not hold, or a sequence would need a preemption to grow."""
        # Every sequence of the plan is in the same state: 0 pending samples (the previous step is postprocessed,
        # the sync loop) or 1 (the previous step is in flight, the async loop); either way each one's input is
        # its sample of the previous step.
        in_flight = plan.seqs[0].num_pending_tokens
        if (plan.running_version != self._running_version or in_flight > 1
                or len(plan.seqs) > self.max_num_batched_tokens
                or (self.waiting and len(self.running) < self.max_num_seqs)):
            return None
        starts = plan.starts + 1
        computing = starts + 1 < plan.max_lens  # the others' last token is in flight: they compute nothing more
        if plan.num_finished != self._num_finished:
            running = SequenceStatus.RUNNING
            computing &= np.fromiter([seq.status is running for seq in plan.seqs], bool, len(plan.seqs))
        same_rows = bool(computing.all())
        if not same_rows:
            previous_rows = np.flatnonzero(computing)
            if not len(previous_rows):
                return None
            plan, starts = plan.subset(previous_rows), starts[previous_rows]
        plan.num_finished = self._num_finished
        seqs = plan.seqs
        growing = np.flatnonzero(starts >= plan.capacities)
        if len(growing) * self.block_manager.num_groups > self.block_manager.num_free_blocks:
            return None
        batch = ScheduledBatch()
        for i in growing.tolist():  # each needs one more block, for the token at its new start
            seq = seqs[i]
            self.block_manager.try_grow(seq, int(starts[i]) + 1)
            batch.table_changed.append(seq)
        plan.capacities[growing] += self.block_manager.block_size
        for seq in seqs:
            seq.start_step(1, True)
        # Every input is the previous step's sample: in flight (async), or the same rows one position further on,
        # whose samples are still on the device (sync); otherwise the host knows them.
        if in_flight or same_rows:
            batch.add_decodes(seqs, starts, plan.zeros, plan.indices, plan.epochs)
        else:
            batch.add_decodes(seqs, starts, [seq.token_ids[-1] for seq in seqs], [], plan.epochs)
        plan.starts = starts
        self._plan = plan
        return batch

    def _schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        running_version = self._running_version
        preemptions_before = self.num_preemptions
        block_size, num_groups = self.block_manager.block_size, self.block_manager.num_groups
        # The hot loop of every step, kept lean: a decode (one token that samples, past the prompt) is noted in
        # four lists, and the decodes lead the batch; prompt chunks of running sequences are added after them.
        # `_make_room` pops preempted sequences off the end of `running`, and iterating a list that shrinks at
        # its end never reaches the popped ones.
        decodes: list[Sequence] = []
        starts: list[int] = []
        input_ids: list[int] = []
        pending: list[int] = []
        chunks: list[tuple[Sequence, int, int, bool]] = []
        num_decodes = num_done = 0
        for seq in self.running:
            if budget <= 0:
                break
            token_ids = seq.token_ids
            num_known = len(token_ids)
            effective = num_known + seq.num_pending_tokens
            if effective >= seq.max_len:
                num_done += 1
                continue  # its last token is already in flight: nothing more to compute
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            num_new = effective - start
            if num_new > budget:
                num_new = budget
            if (start + num_new) * num_groups > len(seq.block_table) * block_size:  # beyond its capacity
                if not self._make_room(seq, start + num_new):
                    break
                batch.table_changed.append(seq)
            budget -= num_new
            if num_new != 1 or start + 1 != effective or start < seq.num_prompt_tokens:
                chunks.append((seq, num_new, start, start + num_new == effective))
                continue
            if start < num_known:
                input_ids.append(token_ids[start])
            else:  # sampled by the step in flight: read on the device
                input_ids.append(0)
                pending.append(num_decodes)
            seq.start_step(1, True)
            num_decodes += 1
            decodes.append(seq)
            starts.append(start)
        batch.add_decodes(decodes, starts, input_ids, pending)
        for chunk in chunks:
            self._add_chunk(batch, *chunk)
        preempted = self.num_preemptions != preemptions_before

        # Admitting new work right after a preemption would only thrash the cache. A sequence whose constraint
        # is still compiling, whose LoRA adapter cannot get a slot yet, or whose sibling has not computed their
        # shared prompt keeps its place in the queue and the ones behind it are admitted. Such a sibling keeps its
        # seat too: the rows behind it must not take it, or it would miss its fork and compute the prompt again.
        deferred: list[Sequence] = []
        seats_held = 0
        while (not preempted and self.waiting and budget > 0
               and len(self.running) + seats_held < self.max_num_seqs):
            seq = self.waiting[0]
            if self.lora is not None and not self.lora.can_admit(seq):
                deferred.append(self.waiting.popleft())
                continue
            if seq.grammar is None and seq.grammar_future is not None:
                if not seq.grammar_future.ready():
                    deferred.append(self.waiting.popleft())
                    continue
                if not self._start_grammar(seq):
                    self.waiting.popleft()
                    continue
            parent = seq.parent
            if parent is not None and parent.status is SequenceStatus.RUNNING:
                if parent.num_computed_tokens < parent.num_prompt_tokens:  # then forks onto its blocks
                    deferred.append(self.waiting.popleft())
                    seats_held += 1
                    continue
                if not self.block_manager.fork(parent, seq, budget):
                    break
            elif not self.block_manager.admit(seq, budget):
                break
            self.waiting.popleft()
            if self.lora is not None:
                self.lora.admit(seq)
            self._running_version += 1
            batch.table_changed.append(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            self._add_chunk(batch, seq, num_new, seq.num_computed_tokens, num_new == seq.num_uncomputed_tokens)
            budget -= num_new
        self.waiting.extendleft(reversed(deferred))
        if (num_decodes and num_decodes == len(batch) and num_decodes + num_done == len(self.running)
                and self._running_version == running_version):
            self._plan = _DecodePlan(  # only decodes, of all that compute: the next step may be this one, advanced
                decodes, batch.epochs, np.array(starts, dtype=np.int64),
                np.array([seq.max_len for seq in decodes], dtype=np.int64),
                np.array([len(seq.block_table) for seq in decodes], dtype=np.int64) // num_groups * block_size,
                running_version, self._num_finished, [0] * num_decodes, list(range(num_decodes)))
        return batch

    def _start_grammar(self, seq: Sequence) -> bool:
        """Give `seq` its row matcher from its finished compile; an invalid constraint (or any failure here)
        finishes that request alone with its error. Returns whether it may run."""
        try:
            self.grammars.start_row(seq)
        except Exception as exc:  # noqa: BLE001 - whatever breaks one request's constraint fails that request only
            message = str(exc) or type(exc).__name__
            self._fail_waiting(seq, message if message.startswith("structured_outputs") else
                               f"structured_outputs: {message}", invalid_request=not isinstance(exc, GrammarSetupError))
            return False
        return True

    def _fail_waiting(self, seq: Sequence, message: str, invalid_request: bool) -> None:
        """Finish a sequence that never ran with finish reason "error" (it holds no blocks and no runner row);
        `invalid_request`: the request's fault (a constraint that does not compile), not the engine's."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        seq.error = message
        seq.invalid_request = invalid_request
        self.finished.append(seq)

    @staticmethod
    def _add_chunk(batch: ScheduledBatch, seq: Sequence, num_new_tokens: int, start: int, samples: bool) -> None:
        batch.add_chunk(seq, num_new_tokens, start, samples)
        seq.start_step(num_new_tokens, samples)

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` tokens, preempting the most recently admitted running sequences
        while the free blocks do not suffice.

        Sequences admitted before `seq` are never victims; returns False when `seq` itself had to go."""
        while not self.block_manager.try_grow(seq, num_tokens):
            victim = self.running.pop()
            self._preempt(victim)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it back at the head of the queue; it is recomputed from its known tokens.

        In-flight steps may still write into the freed blocks; they run before any later step on the device, and
        their results for `seq` are dropped (new epoch), so nothing they write is committed or hashed."""
        self.block_manager.free(seq)
        if self.lora is not None:
            self.lora.release(seq)
        seq.preempt()
        if seq.grammar is not None:  # it keeps its place in the grammar: exactly its committed output tokens
            self.grammars.preempt(seq)
        self._running_version += 1
        self.num_preemptions += 1
        self._released.append(seq.seq_id)
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int],
                    logprobs: StepLogprobs | None = None) -> None:
        """Commit one step (steps are committed in the order they were scheduled) and finish the sequences that
        a stop rule ends; `take_finished` hands them out. `logprobs`: the step's, when some row asked."""
        if logprobs is not None:
            record_step_logprobs(batch, logprobs)
        finished, commit = SequenceStatus.FINISHED, self.block_manager.commit_computed_blocks
        for seq, num_new, samples, epoch, token_id in zip(batch.seqs, batch.num_new_tokens, batch.samples,
                                                           batch.epochs, sampled_token_ids):
            if seq.epoch != epoch or seq.status is finished:
                continue  # preempted or finished after this step was scheduled: its work here is void
            seq.commit_step(num_new, token_id if samples else None)
            commit(seq)
            if not samples:
                continue
            grammar = seq.grammar
            if grammar is None:
                reason = self._stop_reason(seq, token_id)
            elif grammar.rejected_token is not None:  # an earlier token's accept failed
                self._finish_rejected(seq, grammar)
                continue
            else:  # the mask allows a stop id only where the grammar is complete: it ends the row (ignore_eos too)
                reason = "stop" if token_id in grammar.stop_token_ids else self._stop_reason(seq, token_id)
            if reason:
                self._finish(seq, reason)

    def _stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        """Every stop rule, in vLLM's order: EOS and stop tokens, stop strings (neither before `min_tokens`
        outputs), then the length limit. Sets `stop_reason` to the stop token id or stop string."""
        params = seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return "stop"
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return "stop"
            if params.stop and self.stop_strings is not None:
                found = self.stop_strings.check(seq)
                if found is not None:
                    text, seq.stop_reason = found
                    seq.stop_text = text + seq.stop_reason if params.include_stop_str_in_output else text
                    return "stop"
        if seq.num_tokens >= seq.max_len:
            return "length"
        return None

    def _finish_rejected(self, seq: Sequence, grammar: RowGrammar) -> None:
        """A constrained row whose sampled token its grammar refused: the request's fault (400) where no token could
        follow, else an engine bug."""
        self._finish(seq, "error", grammar.rejection())
        seq.invalid_request = grammar.dead_end

    def _finish(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.block_manager.free(seq)
        if self.lora is not None:
            self.lora.release(seq)
        self.running.remove(seq)
        if seq.grammar is not None:
            self.grammars.release(seq)
        self._num_finished += 1
        self.finished.append(seq)
        self._released.append(seq.seq_id)
        if self.stop_strings is not None and seq.params.stop:
            self.stop_strings.forget(seq)

    def abort_all(self) -> list[Sequence]:
        """Drop every unfinished sequence, running or waiting (after a failed step, whose effects on them are
        unknown): their blocks are freed (only committed blocks are in the prefix cache, so it stays valid), their
        rows are released with the next batch, and the scheduler is empty. Returns them."""
        aborted = [*self.running, *self.waiting, *self.finished]
        if self.grammars is not None:
            self.grammars.drain()
            for seq in [*self.running, *self.waiting]:
                if seq.grammar is not None:
                    self.grammars.release(seq)
        for seq in self.running:
            self.block_manager.free(seq)
            self._released.append(seq.seq_id)
        if self.lora is not None:
            self.lora.abort(self.running)
        for seq in aborted:
            seq.status = SequenceStatus.FINISHED
            if self.stop_strings is not None and seq.params.stop:
                self.stop_strings.forget(seq)
        self.running.clear()
        self.waiting.clear()
        self.finished.clear()
        self._plan = None
        self._running_version += 1
        return aborted

    def take_finished(self) -> list[Sequence]:
        finished, self.finished = self.finished, []
        return finished
