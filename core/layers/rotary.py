from __future__ import annotations

import math

import torch
from torch import nn


def rope_parameters(hf_config) -> dict:
    """Rope settings from an HF config of transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    params.update(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's frequency-dependent stretch: long wavelengths are divided by `factor`, short ones kept."""
    factor = params["factor"]
    low_wavelen = params["original_max_position_embeddings"] / params["low_freq_factor"]
    high_wavelen = params["original_max_position_embeddings"] / params["high_freq_factor"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (params["original_max_position_embeddings"] / wavelen - params["low_freq_factor"]) / (
        params["high_freq_factor"] - params["low_freq_factor"])
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(wavelen > low_wavelen, inv_freq / factor, torch.where(wavelen < high_wavelen, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout HF's Llama/Qwen checkpoints use."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        rope_type = params["rope_type"]
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (default, linear, llama3 are)")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
        self.register_buffer("cos_sin", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
