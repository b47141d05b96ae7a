from __future__ import annotations

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend


def _flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def select_backend(name: str | None, device: torch.device, kv_cache_dtype: str = "auto"):
    """The explicit choice, else the best available for the cache: torch on the CPU; on CUDA flash-attn when it
    imports and the cache is not FP8, else our Triton kernels. Kernel backends are imported only here, so the CPU
    path needs neither. A backend that cannot read an FP8 cache is an error naming both settings."""
    fp8 = kv_cache_dtype != "auto"
    if name is None:
        if device.type == "cpu":
            name = "torch"
        else:
            name = "flash-attn" if _flash_attn_available() and not fp8 else "triton"
    if name == "torch":
        backend = TorchAttentionBackend()
    elif name == "triton":
        from nanovllm.attention.triton_backend import TritonAttentionBackend

        backend = TritonAttentionBackend(device)
    elif name == "flash-attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend

        backend = FlashAttnBackend()
    else:
        raise ValueError(f"attention backend {name!r} is not available on this build")
    if fp8 and not backend.supports_fp8_kv:
        raise ValueError(f"attention_backend={name!r} cannot read an FP8 KV cache (kv_cache_dtype="
                         f"{kv_cache_dtype!r}): use attention_backend='triton', or kv_cache_dtype='auto'")
    return backend


__all__ = ["AttentionMetadata", "select_backend"]
