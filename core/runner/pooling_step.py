"""The device side of a pooling engine's step (docs/ARCHITECTURE.md): each row's chunk goes into its running
pooled vector (`PoolingState`, kept by runner row, so a long input chunked over steps pools as a whole one); the
rows whose last chunk the step computes get their output: the model's head (`compute_logits`: the vector itself
for an embedder, label logits for a classifier), then Matryoshka truncation and normalization (embed) or the
task's activation. Everything runs on the device without a host sync; rank 0 alone plans and computes outputs
(the head is replicated: under tensor parallelism the other ranks run only the forward)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nanovllm.pooling import PoolingSpec, PoolingState, activate, embedding_output
from nanovllm.pooling_params import RowPooling
from nanovllm.step_types import ScheduledBatch


@dataclass
class PoolingPlan:
    """The host side of one step's pooling: its shape, and the rows that end in it (`batch_indices`, grouped by
    rule: `rules` are (rule, first, count) runs of them) with their outputs' offsets in the step's values."""

    num_seqs: int
    num_tokens: int
    batch_indices: list[int]
    rules: list[tuple[RowPooling, int, int]]
    offsets: list[int]


class PoolingStep:
    def __init__(self, spec: PoolingSpec, max_rows: int, hidden_size: int, device: torch.device):
        self.state = PoolingState(spec.pooling, max_rows, hidden_size, device)
        self.embeds = spec.model_kind == "embed"  # an embedder's head is the identity: its vectors stay fp32
        self.output_size = spec.output_size
        self.token_types = spec.token_types
        self.device = device

    def plan(self, batch: ScheduledBatch) -> PoolingPlan:
        """Which rows end in `batch` (their chunk reaches the end of the prompt) and their outputs' sizes."""
        runs: dict[RowPooling, list[int]] = {}
        for index, (seq, start, num_new) in enumerate(zip(batch.seqs, batch.start_positions, batch.num_new_tokens)):
            if start + num_new == seq.num_prompt_tokens:
                runs.setdefault(seq.pooling, []).append(index)
        batch_indices, rules, offsets = [], [], [0]
        for rule, indices in runs.items():
            rules.append((rule, len(batch_indices), len(indices)))
            batch_indices += indices
            size = rule.dimensions or self.output_size
            offsets += range(offsets[-1] + size, offsets[-1] + size * len(indices) + 1, size)
        return PoolingPlan(len(batch.seqs), batch.num_tokens, batch_indices, rules, offsets)

    def token_type_ids(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """The step's token types (pair inputs of a BERT-style model; 0 for rows without), on the device; None
        when the model takes none or no row has any."""
        if not self.token_types or all(seq.token_type_ids is None for seq in batch.seqs):
            return None
        types = np.zeros(batch.num_tokens, dtype=np.int64)
        at = 0
        for seq, start, num_new in zip(batch.seqs, batch.start_positions, batch.num_new_tokens):
            if seq.token_type_ids is not None:
                types[at:at + num_new] = seq.token_type_ids[start:start + num_new]
            at += num_new
        return torch.from_numpy(types).to(self.device, non_blocking=True)

    def launch(self, model: torch.nn.Module, hidden: torch.Tensor, query_start_loc: torch.Tensor,
               positions: torch.Tensor, rows: torch.Tensor, plan: PoolingPlan) -> torch.Tensor | None:
        """Pool the step's chunks into their rows; returns the outputs of the rows that end in it, flat in the
        plan's order (float32, on the device), or None when none does."""
        n = plan.num_seqs
        starts = query_start_loc[:n].long()
        lengths = query_start_loc[1:n + 1].long() - starts
        rows = rows[:n]
        # A row's first chunk starts at position 0 (rows pooled over every token take no prefix-cache hits).
        self.state.update(rows, hidden, starts, lengths, positions.index_select(0, starts) == 0, plan.num_tokens)
        if not plan.batch_indices:
            return None
        ended = torch.tensor(plan.batch_indices, dtype=torch.int64).to(self.device, non_blocking=True)
        pooled = self.state.result(rows.index_select(0, ended))
        head = pooled if self.embeds else model.compute_logits(pooled.to(hidden.dtype)).float()
        parts = []
        for rule, first, count in plan.rules:
            part = head[first:first + count]
            part = embedding_output(part, rule.normalize, rule.dimensions) if rule.task == "embed" \
                else activate(part, rule.activation)
            parts.append(part.reshape(-1))
        return parts[0] if len(parts) == 1 else torch.cat(parts)
