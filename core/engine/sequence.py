from __future__ import annotations

import time
from enum import Enum, auto

from nanovllm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request's tokens and its place in the paged KV cache.

    `num_cached_tokens` counts the leading tokens whose KV is computed and committed. Steps that are scheduled
    but not yet postprocessed are "in flight": they compute `num_inflight_tokens` more, and those whose chunk
    reaches the end of the sequence will each add one output token that is not known yet (`num_pending_tokens`).
    The scheduler plans from the effective state (committed + in flight); in the sync loop both counts are 0 at
    scheduling time. Positions below `num_shared_kv_tokens` lie in prefix-cache blocks that are already complete,
    so their KV must not be written again (a whole prompt hit the cache and its last token is recomputed).
    `epoch` changes on preemption, so the results of steps scheduled before it are recognised and dropped.
    """

    __slots__ = ("seq_id", "request_id", "prompt", "token_ids", "num_prompt_tokens", "params", "max_len",
                 "sampling_seed", "status", "block_table", "num_cached_tokens", "num_shared_kv_tokens",
                 "num_hashed_blocks", "num_inflight_tokens", "num_pending_tokens", "epoch", "last_sample_index", "row",
                 "num_prefix_hit_tokens", "num_preemptions", "finish_reason", "error", "stop_text_len",
                 "arrival_time", "first_token_time", "finish_time")

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 sampling_seed: int, prompt: str | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.max_len = 0  # the scheduler sets it on arrival: prompt + max_tokens, capped by max_model_len
        self.sampling_seed = sampling_seed
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.num_shared_kv_tokens = 0
        self.num_hashed_blocks = 0
        self.num_inflight_tokens = 0
        self.num_pending_tokens = 0
        self.epoch = 0
        self.last_sample_index = -1  # row of this sequence in the newest step that samples for it
        self.row = -1  # the runner's row of per-sequence step state (SequenceRows), from its first step on
        self.num_prefix_hit_tokens: int | None = None  # prompt tokens served by the prefix cache, first admission
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_text_len: int | None = None  # output text is cut here when a stop string matched
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

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
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed once every in-flight step completes."""
        return self.num_cached_tokens + self.num_inflight_tokens

    @property
    def num_effective_tokens(self) -> int:
        """Tokens the sequence has once every in-flight step's sample is appended."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
