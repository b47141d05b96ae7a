from __future__ import annotations

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata


class Attention(nn.Module):
    """Stores this step's K/V into the layer's paged cache and attends over it through the selected backend.

    The runner binds `k_cache`/`v_cache` (views of the engine's one KV tensor), `kv_group` (whose block tables
    and slots the layer uses, kv_groups.py) and `backend` after allocation.
    `sliding_window`: each token sees only the last that many positions up to its own (HF's rule); `logit_softcap`:
    scores become cap * tanh(scores / cap). Both are this layer's own, so layers of one model may differ.
    `k_scale` / `v_scale`: the per-tensor scales of an FP8 cache (attention/kv_quant.py), 1.0 unless set."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None):
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window} must be a positive number of positions")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.kv_group = 0
        self.backend = None
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q/k/v: [tokens, heads, head_dim] -> [tokens, heads * head_dim]."""
        out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta.for_group(self.kv_group), self.scale,
                                   window=self.sliding_window, softcap=self.logit_softcap, k_scale=self.k_scale,
                                   v_scale=self.v_scale)
        return out.reshape(out.shape[0], -1)
