"""Attention over the paged KV cache with our Triton kernels (nanovllm.kernels): the default on CUDA."""
from __future__ import annotations

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.kernels.decode_attention import choose_num_splits, paged_decode_attention
from nanovllm.kernels.kv_cache import store_kvcache
from nanovllm.kernels.prefill_attention import paged_prefill_attention


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True  # the decode path never syncs with the host and its shapes are static
    supports_fp8_kv = True  # the kernels dequantize an FP8 cache in registers
    required_block_size_multiple = 1  # any power-of-two block size

    def __init__(self, device: torch.device):
        # The split heuristic needs the SM count; the CPU (interpreter) has no SMs to fill.
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def decode_num_splits(self, batch_size: int, max_seq_len: int, num_kv_heads: int) -> int:
        """The `decode_num_splits` for a decode step's metadata; for a CUDA graph, max_seq_len = max_model_len."""
        return choose_num_splits(batch_size, num_kv_heads, max_seq_len, self.num_sms)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
                softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        limits = dict(window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale)
        if meta.max_query_len == 1:
            return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale,
                                          meta.decode_num_splits, **limits)
        # A mixed step: its decodes through the decode kernel (split over the KV range, a tile per sequence)
        # rather than the prefill kernel's query tiles, which would hold one token each and read every block
        # once per tile; the prompt chunks after them through the prefill kernel, both into one output.
        decodes = meta.num_decodes
        out = torch.empty_like(q)
        if decodes:
            paged_decode_attention(q[:decodes], k_cache, v_cache, meta.block_tables[:decodes], meta.seq_lens[:decodes],
                                   scale, meta.decode_num_splits, out=out[:decodes], **limits)
        return paged_prefill_attention(q, k_cache, v_cache, meta.query_start_loc[decodes:], meta.seq_lens[decodes:],
                                       meta.block_tables[decodes:], meta.max_query_len, scale, out=out, **limits)
