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


def select_backend(name: str | None, device: torch.device):
    """The explicit choice, else the best available: torch on the CPU; on CUDA flash-attn when it imports,
    else our Triton kernels. Kernel backends are imported only here, so the CPU path needs neither."""
    if name is None:
        if device.type == "cpu":
            name = "torch"
        else:
            name = "flash-attn" if _flash_attn_available() else "triton"
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from nanovllm.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(device)
    if name == "flash-attn":
        from nanovllm.attention.flash_attn_backend import FlashAttnBackend

        return FlashAttnBackend()
    raise ValueError(f"attention backend {name!r} is not available on this build")


__all__ = ["AttentionMetadata", "select_backend"]
