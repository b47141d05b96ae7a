"""Rotary position embedding and the frequency schedules of HF's rope types (default, linear, llama3, yarn,
longrope). Every schedule becomes one table of cos | sin per position, so the model's kernels need not know it."""
from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
_LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_parameters(hf_config, layer_type: str | None = None) -> dict:
    """Rope settings from an HF config of transformers 4 (`rope_theta`, `rope_scaling`) or 5 (`rope_parameters`,
    which models with per-layer-type rope, Gemma 3, key by layer type: `layer_type` picks one)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    if any(key in _LAYER_TYPES for key in params):
        params, scaling = dict(params[layer_type or "full_attention"]), {}
    elif any(key in _LAYER_TYPES for key in scaling):
        scaling = {}
    params.update(scaling)
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    # Yarn and longrope scale relative to the context the model was trained on; transformers 4 keeps it top level.
    params.setdefault("original_max_position_embeddings", getattr(hf_config, "original_max_position_embeddings", None))
    params["max_position_embeddings"] = hf_config.max_position_embeddings
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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv_freq: torch.Tensor, rotary_dim: int, params: dict) -> tuple[torch.Tensor, float]:
    """YaRN: dimensions that turn fewer than `beta_slow` times over the original context are interpolated (divided
    by `factor`), those that turn more than `beta_fast` times are kept, a linear ramp in between; cos/sin are scaled
    by the attention factor (0.1 ln(factor) + 1 unless the config gives it or mscale / mscale_all_dim)."""
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim
                     else _yarn_mscale(factor))
    base = params["rope_theta"]

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(params.get("beta_fast") or 32), dim_of(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float) - low) / max(high - low, 0.001)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp), float(attention)


def _longrope_attention_factor(params: dict) -> float:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor") or params["max_position_embeddings"] / original
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    return 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in the rotate-half layout HF's checkpoints use, on the first `rotary_dim` =
    head_dim x partial_rotary_factor dimensions of each head (the rest pass through).

    `cos_sin[p]` holds cos | sin of position p, already multiplied by the rope type's attention factor (yarn,
    longrope). Longrope switches from the short to the long factors at original_max_position_embeddings: per
    position here (a position at or past it rotates with the long factors), so a token's rotation never depends on
    the batch or on how long its sequence has grown; HF picks one set for a whole forward pass from its longest
    position, which agrees with this whenever a sequence stays within the original context."""

    def __init__(self, head_dim: int, max_position: int, params: dict):
        super().__init__()
        rope_type = params["rope_type"]
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported ({', '.join(SUPPORTED_ROPE_TYPES)} are)")
        self.rotary_dim = int(head_dim * params.get("partial_rotary_factor", 1.0))
        exponents = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
        inv_freq = 1.0 / (params["rope_theta"] ** exponents)
        positions = torch.arange(max_position, dtype=torch.float)
        attention = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "yarn":
            inv_freq, attention = _yarn(inv_freq, self.rotary_dim, params)
        if rope_type == "longrope":
            short = 1.0 / (torch.tensor(params["short_factor"], dtype=torch.float) * params["rope_theta"] ** exponents)
            long = 1.0 / (torch.tensor(params["long_factor"], dtype=torch.float) * params["rope_theta"] ** exponents)
            is_long = (positions >= params["original_max_position_embeddings"]).unsqueeze(1)
            freqs = positions.unsqueeze(1) * torch.where(is_long, long, short)
            attention = _longrope_attention_factor(params)
        else:
            freqs = torch.outer(positions, inv_freq)
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.register_buffer("cos_sin", cos_sin * attention if attention != 1.0 else cos_sin, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated, passed = x[..., :self.rotary_dim], x[..., self.rotary_dim:]
        x1, x2 = rotated.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return torch.cat([out, passed], dim=-1) if passed.shape[-1] else out
