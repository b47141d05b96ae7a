"""Which model class runs which HF architecture: the one place that decides whether a checkpoint is supported."""
from __future__ import annotations

from torch import nn

from nanovllm.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from nanovllm.models.phi3 import Phi3ForCausalLM

# HF architecture name (config.json's `architectures`) -> our model class
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}


def architectures_of(hf_config) -> list[str]:
    """The config's `architectures`; a config built from a model_type alone (presets, some GGUF conversions) has
    none, and then it is the causal-LM class transformers registers for that model_type."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
        names = [name] if name else []
    return names


def model_class_for(hf_config) -> type[nn.Module]:
    names = architectures_of(hf_config)
    for name in names:
        if name in MODEL_CLASSES:
            return MODEL_CLASSES[name]
    given = ", ".join(names) or f"none (model_type {getattr(hf_config, 'model_type', None)!r})"
    raise ValueError(f"architecture {given} is not supported; supported: {', '.join(sorted(MODEL_CLASSES))}")
