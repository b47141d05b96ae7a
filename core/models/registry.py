"""Which model class runs a checkpoint: HF `architectures[0]` -> class. Configs without `architectures`
(presets, converted GGUF files) are looked up by `model_type` through DEFAULT_ARCHITECTURES."""
from __future__ import annotations

from torch import nn

from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
}

DEFAULT_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def architecture_of(hf_config) -> str:
    architectures = getattr(hf_config, "architectures", None)
    if architectures:
        return architectures[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in DEFAULT_ARCHITECTURES:
        raise ValueError(f"model_type {model_type!r} is not supported (supported: "
                         f"{', '.join(sorted(DEFAULT_ARCHITECTURES))})")
    return DEFAULT_ARCHITECTURES[model_type]


def model_class_for(hf_config) -> type[nn.Module]:
    """The class for `hf_config`; a ValueError that lists the supported architectures when there is none."""
    architecture = architecture_of(hf_config)
    if architecture not in MODEL_CLASSES:
        raise ValueError(f"architecture {architecture!r} is not supported (supported: "
                         f"{', '.join(sorted(MODEL_CLASSES))})")
    return MODEL_CLASSES[architecture]
