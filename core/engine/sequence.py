from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING

from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.lora import LoRARequest
    from nanovllm.pooling_params import RowPooling
    from nanovllm.structured import CompileFuture, RowGrammar


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request's tokens, its place in the paged KV cache, and its token counters.

    `num_computed_tokens` counts the leading tokens whose KV is computed and committed. Steps that are scheduled
    but not yet committed are "in flight": they compute `num_inflight_tokens` more, and those whose chunk reaches
    the end of the sequence will each add one output token that is not known yet (`num_pending_tokens`). The
    scheduler plans from the effective state (committed + in flight); in the sync loop both in-flight counts are 0
    at scheduling time. Each counter changes in one method: `start_step` (scheduled), `commit_step` (computed and
    sampled), `preempt` (dropped); the KV fields (`block_table`, `num_computed_tokens` at admission,
    `num_shared_kv_tokens`, `num_hashed_blocks`, `hashed_prefix`) belong to the block manager. Positions below
    `num_shared_kv_tokens` lie in prefix-cache blocks that are already complete, so their KV must not be written
    again (a whole prompt hit the cache and its last token is recomputed). `epoch` changes on preemption, so the
    results of steps scheduled before it are recognised and dropped.

    A pooling row (`pooling` set, engine/pooling_scheduler.py) is a prompt that is only prefilled: it never
    samples, and its pooled output (`pooled`, host memory) is set when its last chunk is committed.
    """

    __slots__ = ("seq_id", "request_id", "prompt", "token_ids", "num_prompt_tokens", "params", "max_len",
                 "sampling_seed", "status", "block_table", "num_computed_tokens", "num_shared_kv_tokens",
                 "num_hashed_blocks", "hashed_prefix", "num_inflight_tokens", "num_pending_tokens", "epoch",
                 "num_prefix_hit_tokens", "num_preemptions", "finish_reason", "error", "invalid_request", "stop_text",
                 "arrival_time", "first_token_time", "finish_time", "grammar_future", "grammar", "output_logprobs",
                 "prompt_logprob_spans", "cumulative_logprob", "stop_reason", "parent", "completion_index",
                 "bad_words_token_ids", "lora_request", "lora_slot", "pooling", "token_type_ids", "pooled",
                 "prompt_logprobs_from")

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 sampling_seed: int, prompt: str | None = None, lora_request: LoRARequest | None = None,
                 pooling: RowPooling | None = None, token_type_ids: list[int] | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_len = 0  # the scheduler sets it on arrival: prompt + max_tokens, capped by max_model_len
        self.sampling_seed = sampling_seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []  # its KV groups' blocks, interleaved (kv_groups.py)
        self.num_computed_tokens = 0
        self.num_shared_kv_tokens = 0
        self.num_hashed_blocks = 0
        self.hashed_prefix = -1  # the chained hash of the last hashed block (block_manager.NO_HASH: none)
        self.num_inflight_tokens = 0
        self.num_pending_tokens = 0
        self.epoch = 0
        self.num_prefix_hit_tokens: int | None = None  # prompt tokens served by the prefix cache, first admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.invalid_request = False  # the error is the request's own (a constraint that does not compile)
        self.stop_text: str | None = None  # the output text up to the stop string that ended it
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it (not EOS)
        self.parent: Sequence | None = None  # a sibling completion (n / best_of) whose prompt blocks it shares
        self.completion_index = 0
        self.bad_words_token_ids: list[list[int]] = []  # params.bad_words tokenized (LLM.add_request)
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)
        self.lora_slot = -1  # the device slot of its adapter while it runs (lora/manager.py); -1: none
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        # Structured outputs: the constraint's compile (set on arrival), then, from admission on, the row's matcher,
        # which only the scheduler advances (postprocess); the runner reads it through the batch to fill masks.
        self.grammar_future: CompileFuture | None = None
        self.grammar: RowGrammar | None = None
        # References into the steps' logprob results (engine/logprob_records.py), only for a request that asked.
        self.output_logprobs: list | None = [] if params.logprobs is not None else None
        self.prompt_logprob_spans: list | None = [] if params.prompt_logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.pooling = pooling  # a pooling row's rule (pooling_params.py); None for a generated sequence
        self.token_type_ids = token_type_ids  # a pair input's token types (BERT cross-encoders), else None
        self.pooled = None  # a pooling row's output vector (a host tensor), once computed
        # With prompt_logprobs: the first prompt position whose logits are needed (the KV of blocks wholly before
        # it may come from the prefix cache or a parent; engine/choice_scores.py); 0: every position.
        self.prompt_logprobs_from = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def start_step(self, num_new_tokens: int, samples: bool) -> None:
        """A step was scheduled that computes `num_new_tokens` more and, when `samples`, draws a token."""
        self.num_inflight_tokens += num_new_tokens
        if samples:
            self.num_pending_tokens += 1

    def commit_step(self, num_new_tokens: int, token_id: int | None) -> None:
        """A step scheduled by `start_step` completed; `token_id` is its sample (None when it drew none)."""
        self.num_inflight_tokens -= num_new_tokens
        self.num_computed_tokens += num_new_tokens
        if token_id is not None:
            self.num_pending_tokens -= 1
            self.token_ids.append(token_id)
            if self.first_token_time is None:
                self.first_token_time = time.perf_counter()

    def preempt(self) -> None:
        """Back to waiting, to be recomputed from its known tokens; the block manager has freed its KV. Steps in
        flight for it are void (new epoch)."""
        self.status = SequenceStatus.WAITING
        self.num_inflight_tokens = 0
        self.num_pending_tokens = 0
        self.epoch += 1
        self.num_preemptions += 1
