from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """What one step computes: for each sequence, the next `num_new_tokens` of its uncomputed tokens."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)

    def add(self, seq: Sequence, num_new_tokens: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence computes exactly one token: the CUDA-graph fast path."""
        return all(n == 1 for n in self.num_new_tokens)


class Scheduler:
    """Decides which tokens each step computes, under a token budget and the KV blocks available (DESIGN §5)."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids: set[int]):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
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
        needed = self.block_manager.blocks_for(self.max_len_of(seq))
        if needed > self.block_manager.num_blocks:
            return (f"request needs up to {needed} KV blocks ({self.max_len_of(seq)} tokens) but the cache has only "
                    f"{self.block_manager.num_blocks}; lower max_tokens or raise the KV budget (num_kv_blocks, "
                    "gpu_memory_utilization)")
        return None

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        preemptions_before = self.num_preemptions
        scheduled: list[Sequence] = []
        while self.running and budget > 0:
            seq = self.running.pop(0)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._make_room(seq, seq.num_cached_tokens + num_new):
                break
            self.block_manager.grow(seq, seq.num_cached_tokens + num_new)
            batch.add(seq, num_new)
            budget -= num_new
            scheduled.append(seq)
        self.running = scheduled + self.running
        preempted = self.num_preemptions != preemptions_before

        # Admitting new work right after a preemption would only thrash the cache.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.block_manager.match_prefix(seq)
            num_new = min(seq.num_tokens - self.block_manager.cached_tokens_for(seq, hits), budget)
            if self.block_manager.num_blocks_to_admit(seq, hits, num_new) > self.block_manager.num_free_blocks:
                break
            self.waiting.popleft()
            self.block_manager.admit(seq, hits)
            self.block_manager.grow(seq, seq.num_cached_tokens + num_new)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, num_new)
            budget -= num_new
        return batch

    def _make_room(self, seq: Sequence, num_tokens: int) -> bool:
        """Preempt the most recently admitted sequences until `seq` has blocks for `num_tokens` tokens.

        Returns False when `seq` itself had to be preempted."""
        while self.block_manager.num_blocks_to_grow(seq, num_tokens) > self.block_manager.num_free_blocks:
            if not self.running:
                self._preempt(seq)
                return False
            self._preempt(self.running.pop())
        return True

    def _preempt(self, seq: Sequence) -> None:
        """Free `seq`'s blocks and put it back at the head of the queue; it is recomputed later."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def postprocess(self, batch: ScheduledBatch, sampled_token_ids: list[int]) -> list[Sequence]:
        """Commit the computed tokens; append sampled tokens where a sequence's prompt is done.

        Returns the sequences that received a token (finished ones included)."""
        updated = []
        for seq, num_new, token_id in zip(batch.seqs, batch.num_new_tokens, sampled_token_ids):
            seq.num_cached_tokens += num_new
            self.block_manager.commit_computed_blocks(seq)
            if seq.num_cached_tokens < seq.num_tokens:
                continue  # a prefill chunk that does not reach the end of the prompt: its sample is meaningless
            seq.append_token(token_id)
            updated.append(seq)
            reason = self.token_stop_reason(seq, token_id)
            if reason:
                self.finish(seq, reason)
        return updated

    def token_stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        params = seq.params
        if (not params.ignore_eos and token_id in self.eos_token_ids) or token_id in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)
        self.running.remove(seq)
