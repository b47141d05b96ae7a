"""The one data type that crosses from the host side (scheduler) to the device side (runner): what a step computes.

The scheduler fills it and never reads it back for device purposes; the runner reads it (and the sequences in it)
and never writes to either. See docs/ARCHITECTURE.md."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from nanovllm.engine.sequence import Sequence
    from nanovllm.structured import RowGrammar


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
    drops its per-sequence state of them). `grammars[i]` is the structured-output matcher of the sequence at
    index `grammar_rows[i]`, for each constrained sequence that samples in this step (empty lists: none); the
    runner masks those logits rows from them. It only reads them, once the scheduler has advanced them by every
    earlier step's token (docs/STRUCTURED_OUTPUTS.md)."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_positions: list[int] | np.ndarray = field(default_factory=list)  # an array when all are decodes
    samples: list[bool] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    pending_inputs: list[int] = field(default_factory=list)
    num_prefill_tokens: int = 0  # tokens of prompt chunks (the rest are decode tokens)
    input_ids: list[int] = field(default_factory=list)
    table_changed: list[Sequence] = field(default_factory=list)
    released_seq_ids: list[int] = field(default_factory=list)
    grammar_rows: list[int] = field(default_factory=list)
    grammars: list[RowGrammar] = field(default_factory=list)

    def add_chunk(self, seq: Sequence, num_new_tokens: int, start: int, samples: bool) -> None:
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

    def add_decodes(self, seqs: list[Sequence], start_positions: list[int] | np.ndarray, input_ids: list[int],
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

    @property
    def is_pure_decode(self) -> bool:
        """Every sequence computes exactly one token: the CUDA-graph fast path."""
        return self.num_tokens == len(self.seqs)
