"""What crosses between the host side (`nanovllm.engine`: scheduler, step loop) and the device side
(`nanovllm.runner`): what a step computes (`ScheduledBatch`, and the `ScheduledSequence` fields the runner reads of
each sequence in it), what a launched step gives back (`StepHandle` with its `StepLogprobs`), and the calls the step
loop makes (`StepRunner`). Both sides import this module and neither imports the other; only the engine's
composition root (`engine/llm_engine.py`) builds a runner. The scheduler fills a batch and never reads it back for
device purposes; the runner reads it (and the sequences in it) and never writes to either (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.pooling_params import RowPooling
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.structured.bitmask import StepMask


class ScheduledSequence(Protocol):
    """What the runner reads of a scheduled sequence (the engine's `Sequence` has these, and more)."""

    seq_id: int
    epoch: int  # changes when the sequence is preempted: its rows are refilled
    params: SamplingParams
    sampling_seed: int
    bad_words_token_ids: list[list[int]] | None
    lora_slot: int  # the device slot of its LoRA adapter, -1 for the base model
    pooling: RowPooling | None  # a pooling row's rule (a pooling engine's rows all have one)
    token_type_ids: list[int] | None  # a pair input's token types (BERT), else None

    @property
    def token_ids(self) -> SequenceABC[int]: ...

    @property
    def block_table(self) -> list[int]: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_shared_kv_tokens(self) -> int: ...


@dataclass
class ScheduledBatch:
    """What one step computes: for each sequence, `num_new_tokens` tokens from `start_positions`, whose ids are
    `input_ids` (all sequences' chunks, concatenated).

    `samples[i]` says whether the chunk reaches the end of the sequence, so that its sampled token is an output
    token (a prefill chunk short of the end samples nothing useful). `pending_inputs` lists the sequences (by
    index) whose chunk's last input token is the sample of the step in flight, not known on the host yet:
    `input_ids` holds 0 there and the runner takes the token from that step's output on the device. `epochs`
    identify the sequences' state at scheduling time: a sequence preempted since then has another epoch and this
    step's results for it are void. `table_changed`: the sequences whose block table is new or grew for this
    step. `released_seq_ids`: sequences that finished or were preempted since the previous batch (the runner
    drops its per-sequence state of them). `lora_loads`: (slot, LoRARequest) adapters the runner writes into
    their device slots before this step, in order (lora/manager.py)."""

    seqs: list[ScheduledSequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_positions: list[int] | np.ndarray = field(default_factory=list)  # an array when all are decodes
    samples: list[bool] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    pending_inputs: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0  # tokens of prompt chunks (the rest are decode tokens)
    input_ids: list[int] = field(default_factory=list)
    table_changed: list[ScheduledSequence] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)
    lora_loads: list[tuple[int, Any]] = field(default_factory=list)

    def add_chunk(self, seq: ScheduledSequence, num_new_tokens: int, start: int, samples: bool) -> None:
        """`num_new_tokens` of `seq` from position `start`; past its known tokens, the last input is pending."""
        end = start + num_new_tokens
        token_ids = seq.token_ids
        self.input_ids += token_ids[start:end]
        if end > len(token_ids):
            self.input_ids.append(0)
            self.pending_inputs.append(len(self.seqs))
        if num_new_tokens > 1 or start < seq.num_prompt_tokens:
            self.num_prefill_tokens += num_new_tokens
        self.seqs.append(seq)
        self.num_new_tokens.append(num_new_tokens)
        self.start_positions.append(start)
        self.samples.append(samples)
        self.epochs.append(seq.epoch)

    def add_decodes(self, seqs: list[ScheduledSequence], start_positions: list[int] | np.ndarray, input_ids: list[int],
                    pending_inputs: list[int], epochs: list[int] | None = None) -> None:
        """Start an empty batch with decodes (one token each, sampled)."""
        assert not self.seqs
        n = len(seqs)
        self.seqs, self.start_positions, self.input_ids = seqs, start_positions, input_ids
        self.pending_inputs = pending_inputs
        self.num_new_tokens, self.samples = [1] * n, [True] * n
        self.epochs = [seq.epoch for seq in seqs] if epochs is None else epochs

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass
class LogprobPlan:
    """The host side of a step's logprobs. `sampled_indices`: batch indices of the sampled rows that asked, in
    the order of their results. `prompt_spans`: (batch index, first prompt position scored, count) per chunk that
    asked, in the order of the prompt results. `prompt_targets`: int64 [2, n]: each scored position's token index
    in the step and the prompt token it scores."""

    sampled_indices: np.ndarray
    num_top: int
    prompt_spans: list[tuple[int, int, int]]
    prompt_targets: np.ndarray | None
    num_top_prompt: int


@dataclass
class StepLogprobs:
    """A launched step's logprob results: the plan, and the results (in pinned host memory on CUDA, valid once
    the step's `ready` event has passed), each in its plan's order."""

    plan: LogprobPlan
    sampled: TokenLogprobs | None
    prompt: TokenLogprobs | None


@dataclass
class PooledOutputs:
    """A pooling step's outputs, for the rows whose last chunk it computed: batch index `batch_indices[i]`'s
    output is `values[offsets[i]:offsets[i + 1]]` (float32; in pinned host memory on CUDA, valid once the step's
    `ready` event has passed)."""

    batch_indices: list[int]
    offsets: list[int]
    values: torch.Tensor

    def by_batch_index(self) -> dict[int, torch.Tensor]:
        return {index: self.values[self.offsets[i]:self.offsets[i + 1]] for i, index in enumerate(self.batch_indices)}


@dataclass
class StepHandle:
    """A launched step: sampled ids on the device, their pinned host copy, timing events, the copy's event, and
    the number of the step-buffer upload the step read; `logprobs` when some row asked (copied to the host
    behind the same event). The host side only hands it back to `StepRunner.wait` and reads `logprobs` after.
    A pooling engine's step samples nothing: `pooled` holds its outputs (None when no row ended in it)."""

    sampled: torch.Tensor
    host: torch.Tensor | None
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None
    ready: torch.cuda.Event | None
    upload: int
    logprobs: StepLogprobs | None = None
    graph: bool = False  # the forward replayed a CUDA graph (else it ran eagerly)
    pooled: PooledOutputs | None = None


class StepRunner(Protocol):
    """The calls the step loop makes on the device side (the model runner, or rank 0 of a tensor-parallel group).
    `prepare` turns a batch into device inputs; `execute` launches the whole step; a step with constrained rows is
    launched in two halves, `launch_forward` then `launch_sample` with the step's token mask
    (nanovllm.structured.StepMask, bits and logits rows that the host filled in between); `wait` blocks until a
    step's sampled ids are on the host and returns them with its device time (None on the CPU); a pooling
    engine's `wait` returns the step's `PooledOutputs` (or None) instead of sampled ids. Inputs and launched
    forwards are the runner's own types: the host side only passes them back."""

    def prepare(self, batch: ScheduledBatch) -> Any: ...

    def execute(self, inputs: Any) -> StepHandle: ...

    def launch_forward(self, inputs: Any) -> Any: ...

    def launch_sample(self, forward: Any, mask: StepMask | None) -> StepHandle: ...

    def wait(self, handle: StepHandle) -> tuple[list[int] | PooledOutputs | None, float | None]: ...
