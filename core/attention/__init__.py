from __future__ import annotations

import torch

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.attention.torch_backend import TorchAttentionBackend


def select_backend(name: str | None, device: torch.device):
    """The explicit choice, else the best available: torch on the CPU."""
    if name is None:
        name = "torch" if device.type == "cpu" else "triton"
    if name == "torch":
        return TorchAttentionBackend()
    raise ValueError(f"attention backend {name!r} is not available on this build")


__all__ = ["AttentionMetadata", "select_backend"]
