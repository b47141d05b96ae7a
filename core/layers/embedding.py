from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, gather_to_rank0, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by vocabulary rows across ranks; out-of-shard ids contribute zeros."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        world = tp_size()
        self.world = world  # the group this layer was built for, not whichever engine runs later
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // world)
        self.shard_start = tp_rank() * self.shard_size
        self.weight = nn.Parameter(torch.zeros(self.shard_size, hidden_size), requires_grad=False)
        self.weight.full_shape = (vocab_size, hidden_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = loaded[self.shard_start:self.shard_start + self.shard_size]
        param.data[:shard.shape[0]].copy_(shard)  # the last shard may be shorter: its padding rows stay zero

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.shard_start
        in_shard = (local >= 0) & (local < self.shard_size)
        y = F.embedding(local.clamp(0, self.shard_size - 1), self.weight) * in_shard.unsqueeze(-1)
        return all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection split by vocabulary rows; the full logits are assembled on rank 0 only."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = F.linear(hidden, self.weight)
        if self.world == 1:
            return logits
        logits = gather_to_rank0(logits)
        return logits[..., :self.vocab_size] if logits is not None else None
