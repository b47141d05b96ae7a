"""Pooling a sequence's final hidden states into one vector: its last token, its first (CLS) token, or the mean
of its tokens, over a flat token batch where each pooled sequence (or this step's chunk of it) is the range
`starts[i] : starts[i] + lengths[i]`.

A long input's prefill is chunked over steps, so pooling runs as a state fed chunk by chunk (`PoolingState`): the
mean sums every chunk (in fp32) and divides by the token count at the end, CLS keeps the first chunk's first
token, last-token keeps the latest chunk's last token (the last chunk's, once the sequence is complete)."""
from __future__ import annotations

from enum import Enum

import torch


class PoolingMethod(str, Enum):
    LAST = "last"
    MEAN = "mean"
    CLS = "cls"


def chunk_partials(hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, method: PoolingMethod,
                   num_tokens: int | None = None) -> torch.Tensor:
    """Each range's share of its sequence's pooled vector, [ranges, hidden] in fp32: the last or first token's
    hidden state, or (MEAN) the sum of the range's hidden states. `starts`, `lengths`: int64 on hidden's device;
    `num_tokens` (MEAN): sum(lengths) when the caller knows it on the host (else it is read from the device)."""
    method = PoolingMethod(method)
    if method is PoolingMethod.LAST:
        return hidden[starts + lengths - 1].float()
    if method is PoolingMethod.CLS:
        return hidden[starts].float()
    num_tokens = int(lengths.sum()) if num_tokens is None else num_tokens
    segment = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), lengths, output_size=num_tokens)
    range_offsets = torch.cumsum(lengths, 0) - lengths
    token_index = starts[segment] + torch.arange(num_tokens, device=hidden.device) - range_offsets[segment]
    sums = torch.zeros(len(starts), hidden.shape[-1], dtype=torch.float32, device=hidden.device)
    return sums.index_add_(0, segment, hidden[token_index].float())


def pool_sequences(hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, method: PoolingMethod,
                   num_tokens: int | None = None) -> torch.Tensor:
    """The pooled vector of each whole sequence in one batch, [sequences, hidden] in fp32."""
    partial = chunk_partials(hidden, starts, lengths, method, num_tokens)
    return partial / lengths.unsqueeze(1) if PoolingMethod(method) is PoolingMethod.MEAN else partial


class PoolingState:
    """The running pooled vectors of sequences whose prefill may span steps, kept by row (`max_rows` rows, as the
    runner numbers its sequences). A step `update`s the rows it computed a chunk of; `result` reads rows whose last
    chunk has been added. Everything stays on the device, with no host sync."""

    def __init__(self, method: PoolingMethod, max_rows: int, hidden_size: int, device: torch.device | str = "cpu"):
        self.method = PoolingMethod(method)
        self.vectors = torch.zeros(max_rows, hidden_size, dtype=torch.float32, device=device)
        self.counts = torch.zeros(max_rows, dtype=torch.int64, device=device)

    def update(self, rows: torch.Tensor, hidden: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor,
               first_chunk: torch.Tensor, num_tokens: int | None = None) -> None:
        """Add one chunk per row: `rows[i]`'s chunk is `hidden[starts[i] : starts[i] + lengths[i]]`, its
        sequence's first chunk where `first_chunk[i]` (which starts the row afresh). Each row appears once."""
        partial = chunk_partials(hidden, starts, lengths, self.method, num_tokens)
        first = first_chunk.unsqueeze(1)
        if self.method is PoolingMethod.MEAN:
            self.vectors[rows] = torch.where(first, 0.0, self.vectors[rows]) + partial
            self.counts[rows] = torch.where(first_chunk, 0, self.counts[rows]) + lengths
        elif self.method is PoolingMethod.CLS:
            self.vectors[rows] = torch.where(first, partial, self.vectors[rows])
        else:
            self.vectors[rows] = partial

    def result(self, rows: torch.Tensor) -> torch.Tensor:
        """The pooled vectors of complete sequences, [rows, hidden] in fp32."""
        vectors = self.vectors[rows]
        return vectors / self.counts[rows].unsqueeze(1) if self.method is PoolingMethod.MEAN else vectors
