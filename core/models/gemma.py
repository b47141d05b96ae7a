"""Gemma 2 and Gemma 3 text models on the Llama decoder: (1 + w) RMSNorm, norms around both sublayers, embeddings
scaled by sqrt(hidden_size), GELU (tanh), attention scale query_pre_attn_scalar ** -0.5, sliding-window layers
interleaved with global ones (`layer_types`), attention and final logit soft-capping where configured. Gemma 3
adds q/k norm and its own rope base for the sliding layers."""
from __future__ import annotations

import math

from nanovllm.layers.rotary import rope_parameters
from nanovllm.models.geometry import layer_windows
from nanovllm.models.llama import DecoderSpec, LlamaForCausalLM


def _gemma_spec(config, qk_norm: bool, layer_rope: tuple[dict, ...]) -> DecoderSpec:
    return DecoderSpec(
        layer_windows=layer_windows(config), layer_rope=layer_rope, qkv_bias=getattr(config, "attention_bias", False),
        o_bias=getattr(config, "attention_bias", False), qk_norm=qk_norm, unit_offset_norms=True,
        sandwich_norms=True, hidden_act=getattr(config, "hidden_activation", None) or config.hidden_act,
        embed_scale=math.sqrt(config.hidden_size), attn_scale=config.query_pre_attn_scalar ** -0.5,
        attn_logit_softcap=getattr(config, "attn_logit_softcapping", None),
        final_logit_softcap=getattr(config, "final_logit_softcapping", None))


def _gemma3_layer_rope(config, layer_type: str) -> dict:
    """transformers 5 keys Gemma 3's rope parameters by layer type; transformers 4 gives the sliding layers
    `rope_local_base_freq` (plain rope) and the global ones rope_theta with rope_scaling."""
    params = rope_parameters(config, layer_type)
    local_base = getattr(config, "rope_local_base_freq", None)
    if layer_type == "sliding_attention" and local_base is not None:
        keep = ("partial_rotary_factor", "max_position_embeddings")
        params = {"rope_type": "default", "rope_theta": local_base, **{k: params[k] for k in keep}}
    return params


class Gemma2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_spec(config) -> DecoderSpec:
        return _gemma_spec(config, qk_norm=False, layer_rope=(rope_parameters(config),) * config.num_hidden_layers)


class Gemma3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def decoder_spec(config) -> DecoderSpec:
        types = [("sliding_attention" if w is not None else "full_attention") for w in layer_windows(config)]
        return _gemma_spec(config, qk_norm=True, layer_rope=tuple(_gemma3_layer_rope(config, t) for t in types))
