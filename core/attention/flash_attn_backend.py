"""Attention through FlashAttention-2's paged kernels (the `flash_attn` package, imported only when selected).

The KV store is ours (flash-attn does not write a paged cache from varlen inputs)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.kv_cache import store_kvcache


class FlashAttnBackend:
    name = "flash-attn"
    supports_cuda_graphs = True
    supports_fp8_kv = False  # FlashAttention-2 reads 16-bit caches only
    required_block_size_multiple = 256  # flash-attn's paged KV: "block size must be divisible by 256"

    def __init__(self):
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def decode_num_splits(self, batch_size: int, max_seq_len: int, num_kv_heads: int) -> int:
        return 0  # 0: flash-attn picks its splits itself, from static shapes (CUDA-graph safe)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)  # a 16-bit cache: scales unused
        # flash-attn's window counts keys to the left of the query's own position; 0.0 means no soft-capping.
        limits = dict(window_size=(-1, -1) if window is None else (window - 1, 0), softcap=softcap or 0.0)
        if meta.max_query_len == 1:
            return self._with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                                      block_table=meta.block_tables, softmax_scale=scale, causal=True,
                                      num_splits=meta.decode_num_splits, **limits).squeeze(1)
        cu_seqlens_k = F.pad(meta.seq_lens.cumsum(0, dtype=torch.int32), (1, 0))
        # causal with more keys than queries aligns the queries to the end: the new tokens are the last ones.
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_seqlens_k,
                            max_seqlen_q=meta.max_query_len, max_seqlen_k=meta.max_seq_len, softmax_scale=scale,
                            causal=True, block_table=meta.block_tables, **limits)
