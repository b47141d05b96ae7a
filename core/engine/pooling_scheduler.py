"""The scheduler of a pooling engine (docs/ARCHITECTURE.md): every row is a prompt that is only prefilled.

Rows are admitted in arrival order under the token budget and `max_num_seqs`, and chunked over steps like any
prompt: rows already running continue first (oldest first), then new rows take what the budget leaves. A row
samples nothing: it ends ("stop", as vLLM finishes pooling requests) when its last chunk is committed, with the
pooled output the runner computed in that step, and gives back everything it held.

- A decoder's row takes the KV blocks of its whole prompt when it is admitted (its later chunks read them all),
  so it never grows and is never preempted; the blocks go back when it ends (no KV is kept after a row, beyond
  the prefix cache's hashes). A row pooled over every position (mean, CLS) takes no prefix-cache hits (a cached
  position has no hidden state) and its blocks are not hashed; a last-token row may hit, and is hashed.
- An encoder (BERT, XLM-R) keeps no KV at all: a row is computed whole in one step, so a row longer than the
  token budget can never run (`capacity_error` says so).

The step's results are the runner's `PooledOutputs` (by batch index), in place of sampled ids."""
from __future__ import annotations

from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.pooling import PoolingMethod
from nanovllm.step_types import PooledOutputs, ScheduledBatch, StepLogprobs


class PoolingScheduler(Scheduler):
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, method: PoolingMethod, keeps_kv: bool):
        super().__init__(block_manager, max_num_seqs, max_num_batched_tokens, max_model_len, eos_token_ids=set())
        self.keeps_kv = keeps_kv  # a decoder's rows hold KV blocks while their chunks run; an encoder's none
        self.prefix_hits = method is PoolingMethod.LAST  # see the module docstring

    def max_len_of(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens

    def capacity_error(self, seq: Sequence) -> str | None:
        """Why `seq` can never run, even alone; None when it can."""
        if seq.num_prompt_tokens > self.max_model_len:
            return f"input has {seq.num_prompt_tokens} tokens, but max_model_len is {self.max_model_len}"
        if not self.keeps_kv:
            if seq.num_prompt_tokens > self.max_num_batched_tokens:
                return (f"input has {seq.num_prompt_tokens} tokens, more than max_num_batched_tokens="
                        f"{self.max_num_batched_tokens}: an encoder computes an input whole in one step; raise "
                        "max_num_batched_tokens")
            return None
        manager = self.block_manager
        needed = manager.blocks_for(seq.num_prompt_tokens) * manager.num_groups
        if needed > manager.num_blocks:
            return (f"input needs {needed} KV blocks while it is computed but the cache has only "
                    f"{manager.num_blocks}; raise the KV budget (num_kv_blocks, gpu_memory_utilization)")
        return None

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        for seq in self.running:  # rows whose input is chunked over steps
            if budget <= 0:
                break
            start = seq.num_computed_tokens + seq.num_inflight_tokens
            num_new = min(seq.num_prompt_tokens - start, budget)
            if num_new > 0:  # else its last chunk is in flight
                self._add_chunk(batch, seq, num_new, start, False)
                budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self.keeps_kv:
                if seq.num_prompt_tokens > budget:
                    break  # computed whole, in a later step
            elif not self.block_manager.admit(seq, seq.num_prompt_tokens, self.prefix_hits):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.table_changed.append(seq)  # a runner row of its own
            num_new = min(seq.num_uncomputed_tokens, budget)
            self._add_chunk(batch, seq, num_new, seq.num_computed_tokens, False)
            budget -= num_new
        if batch:
            batch.released_seq_ids, self._released = self._released, []
        return batch

    def postprocess(self, batch: ScheduledBatch, pooled: PooledOutputs | None,
                    logprobs: StepLogprobs | None = None) -> None:
        """Commit one step; the rows whose input is complete end with their output."""
        outputs = pooled.by_batch_index() if pooled is not None else {}
        hash_blocks = self.prefix_hits and self.keeps_kv
        for index, (seq, num_new, epoch) in enumerate(zip(batch.seqs, batch.num_new_tokens, batch.epochs)):
            if seq.epoch != epoch or seq.status is SequenceStatus.FINISHED:
                continue
            seq.commit_step(num_new, None)
            if hash_blocks:
                self.block_manager.commit_computed_blocks(seq)
            if seq.num_computed_tokens == seq.num_prompt_tokens:
                seq.pooled = outputs[index]
                self._finish(seq, "stop")
