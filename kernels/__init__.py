"""Triton kernels of nanovllm (paged attention, KV-cache store, fused small ops)."""
