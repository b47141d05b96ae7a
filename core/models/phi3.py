"""Phi-3 (and Phi-3.5 / Phi-4-mini, same architecture) on the Llama decoder. Its checkpoints store q|k|v and
gate|up already stacked (`qkv_proj`, `gate_up_proj`: the loader cuts them into parts for tensor parallelism);
rope may be longrope and partial (partial_rotary_factor); a sliding window applies to every layer when set."""
from __future__ import annotations

from nanovllm.layers.rotary import rope_parameters
from nanovllm.models.geometry import layer_windows
from nanovllm.models.llama import DecoderSpec, LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: dict = {}  # the checkpoint's names are already the packed parameters'

    @staticmethod
    def decoder_spec(config) -> DecoderSpec:
        return DecoderSpec(layer_windows=layer_windows(config),
                           layer_rope=(rope_parameters(config),) * config.num_hidden_layers,
                           qkv_bias=False, o_bias=False, hidden_act=config.hidden_act)
