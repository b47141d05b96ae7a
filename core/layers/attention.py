from __future__ import annotations

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Stores this step's K/V into the layer's paged cache and attends over it through the selected backend.

    The runner binds `k_cache`/`v_cache` (views of the engine's one KV tensor) and `backend` after allocation."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.backend = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q/k/v: [tokens, heads, head_dim] -> [tokens, heads * head_dim]."""
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(out.shape[0], -1)
