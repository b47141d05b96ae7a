"""Sizes every model family shares, read from the HF config: head size, per-layer sliding windows, KV heads per
tensor-parallel rank and the bytes of a KV-cache block."""
from __future__ import annotations

from nanovllm.distributed import tp_size

LAYER_TYPES = ("full_attention", "sliding_attention")


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_windows(config) -> tuple[int | None, ...]:
    """Each layer's sliding window: from `layer_types` where the config has them (Gemma 2/3, Qwen2/3 of
    transformers >= 4.53), else `sliding_window` for every layer when set (Mistral, Phi-3). A window that spans
    max_position_embeddings hides nothing (Phi-3.5's 262144): those layers take the unwindowed path."""
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if window is not None and window >= config.max_position_embeddings:
        window = None
    types = getattr(config, "layer_types", None)
    if types is None:
        enabled = window is not None and getattr(config, "use_sliding_window", True)
        return (window if enabled else None,) * num_layers
    if len(types) != num_layers or not set(types) <= set(LAYER_TYPES):
        raise ValueError(f"layer_types {types!r}: expected {num_layers} entries of {', '.join(LAYER_TYPES)}")
    if "sliding_attention" in types and getattr(config, "sliding_window", None) is None:
        raise ValueError("layer_types has sliding_attention layers but sliding_window is not set")
    return tuple(window if t == "sliding_attention" else None for t in types)


def kv_heads_per_rank(config) -> int:
    """KV heads of this rank (an encoder's config names none: its heads, though it keeps no cache)."""
    return (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) // tp_size()


def kv_block_bytes(config, block_size: int, itemsize: int, num_kv_heads: int, num_layers: int) -> int:
    """Bytes of one KV-cache block of `num_layers` layer slots (K and V) holding `num_kv_heads` heads."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim_of(config) * itemsize
