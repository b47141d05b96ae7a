"""Reference attention over the paged KV cache in plain PyTorch: the CPU path and the oracle for the kernels.

An FP8 cache (attention/kv_quant.py) is quantized on store and read dequantized, attention then runs in fp32."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from nanovllm.attention.kv_quant import dequantize, quantize
from nanovllm.attention.metadata import AttentionMetadata


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:])[slots] = quantize(k[keep], k_scale, k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = quantize(v[keep], v_scale, v_cache.dtype)


def _read(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """The cache rows at `slots` ([..., kv_heads, head_dim]), dequantized (fp32) when the cache is FP8."""
    return dequantize(cache.view(-1, *cache.shape[2:])[slots], scale)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
           softcap: float | None) -> torch.Tensor:
    """Attention of q [..., heads, q_len, dim] over k/v [..., kv_heads, k_len, dim] where `mask` (broadcast to the
    scores) is True. softcap: scores become cap * tanh(scores / cap) before the mask (Gemma 2), which SDPA lacks."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.tanh(q @ k.transpose(-1, -2) * (scale / softcap)) * softcap
    return scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                           scale: float, window: int | None = None, softcap: float | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence: all contexts gathered at once into a padded batch, one attention call.
    window: the token sees only the last `window` positions of its context; softcap: see `attend`;
    k_scale / v_scale: an FP8 cache's scales (then the attention runs in fp32)."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    positions = torch.arange(meta.max_seq_len, device=q.device)
    tables = meta.block_tables[:, positions // block_size].long().clamp_min(0)  # -1 past a table's end
    slots = tables * block_size + positions % block_size
    visible = positions.unsqueeze(0) < meta.seq_lens.unsqueeze(1)  # [batch, max_seq_len]
    if window is not None:
        visible &= positions.unsqueeze(0) >= meta.seq_lens.unsqueeze(1) - window
    # Slots past a sequence's end hold whatever an unused cache slot holds (NaN included), and a masked score
    # still multiplies its V row by zero: zero them so they cannot poison the sum.
    hidden = ~visible.view(*visible.shape, 1, 1)
    k = _read(k_cache, slots, k_scale).masked_fill_(hidden, 0)  # [batch, max_seq_len, kv_heads, dim]
    v = _read(v_cache, slots, v_scale).masked_fill_(hidden, 0)
    out = attend(q.to(k.dtype).unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), visible.view(len(slots), 1, 1, -1),
                 scale, softcap)
    return out.squeeze(2).to(q.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None = None, softcap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """q: [num_tokens, num_heads, head_dim]; reads every sequence's whole context from the cache, causal.
    window: a token sees only the last `window` positions up to its own; softcap: see `attend`;
    k_scale / v_scale: an FP8 cache's scales (then the attention runs in fp32)."""
    block_size = k_cache.shape[1]
    out = torch.empty_like(q)
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        num_q = q_end - q_start
        query_positions = torch.arange(seq_len - num_q, seq_len, device=q.device)
        # With a window, keys before the first query's window are not read (their blocks may be freed).
        first_key = 0 if window is None else max(seq_len - num_q - window + 1, 0)
        positions = torch.arange(first_key, seq_len, device=q.device)
        slots = meta.block_tables[i, positions // block_size].long() * block_size + positions % block_size
        k, v = _read(k_cache, slots, k_scale), _read(v_cache, slots, v_scale)
        mask = positions.unsqueeze(0) <= query_positions.unsqueeze(1)
        if window is not None:
            mask &= positions.unsqueeze(0) > query_positions.unsqueeze(1) - window
        out[q_start:q_end] = attend(q[q_start:q_end].to(k.dtype).transpose(0, 1), k.transpose(0, 1),
                                    v.transpose(0, 1), mask, scale, softcap).transpose(0, 1)
    return out


class TorchAttentionBackend:
    name = "torch"
    supports_cuda_graphs = False  # host-synchronising indexing
    supports_fp8_kv = True
    required_block_size_multiple = 1

    def decode_num_splits(self, batch_size: int, max_seq_len: int, num_kv_heads: int) -> int:
        return 1  # one pass per sequence

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        attention = paged_decode_attention if meta.max_query_len == 1 else paged_attention
        return attention(q, k_cache, v_cache, meta, scale, window, softcap, k_scale, v_scale)
