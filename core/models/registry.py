"""Which model class runs which HF architecture: the one place that decides whether a checkpoint is supported.

A model runs either as a generator (`kind="generate"`: its LM head) or as a pooling model (pooling/task.py decides
which): `kind="embed"` (the decoder or encoder alone, its final hidden states pooled into embeddings) or
`kind="classify"` (a `*ForSequenceClassification` head on the pooled hidden state: classifiers, reward models,
cross-encoders)."""
from __future__ import annotations

from torch import nn

from nanovllm.models.bert import BertForSequenceClassification, BertModel, XLMRobertaForSequenceClassification, XLMRobertaModel
from nanovllm.models.decoder_pooling import decoder_pooling_class
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
# The decoder families by the prefix of their HF architecture names (`<prefix>ForCausalLM`, `<prefix>Model`,
# `<prefix>ForSequenceClassification`); Gemma 3's text-only base and classifier are `Gemma3Text...`.
_DECODER_FAMILIES = {"Llama": LlamaForCausalLM, "Qwen2": LlamaForCausalLM, "Qwen3": LlamaForCausalLM,
                     "Mistral": LlamaForCausalLM, "Gemma2": Gemma2ForCausalLM, "Gemma3Text": Gemma3ForCausalLM,
                     "Phi3": Phi3ForCausalLM, "Qwen2Moe": Qwen2MoeForCausalLM, "Qwen3Moe": Qwen3MoeForCausalLM,
                     "Mixtral": MixtralForCausalLM}
# Architectures whose checkpoints are pooling models: the bare base model embeds, a sequence classifier classifies.
POOLING_MODEL_CLASSES: dict[str, dict[str, type[nn.Module]]] = {
    "embed": {**{f"{p}Model": decoder_pooling_class(c, "embed") for p, c in _DECODER_FAMILIES.items()},
              "BertModel": BertModel, "XLMRobertaModel": XLMRobertaModel},
    "classify": {**{f"{p}ForSequenceClassification": decoder_pooling_class(c, "classify")
                    for p, c in _DECODER_FAMILIES.items()},
                 "BertForSequenceClassification": BertForSequenceClassification,
                 "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification},
}
MODEL_KINDS = ("generate", "embed", "classify")


def architectures_of(hf_config) -> list[str]:
    """The config's `architectures`; a config built from a model_type alone (presets, some GGUF conversions) has
    none, and then it is the causal-LM class transformers registers for that model_type."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
        names = [name] if name else []
    return names


def _classes_for(kind: str) -> dict[str, type[nn.Module]]:
    if kind == "generate":
        return MODEL_CLASSES
    if kind == "embed":  # a causal LM embeds with its decoder alone (Qwen3-Embedding is saved as Qwen3ForCausalLM)
        return {**{name: decoder_pooling_class(cls, "embed") for name, cls in MODEL_CLASSES.items()},
                **POOLING_MODEL_CLASSES["embed"]}
    return POOLING_MODEL_CLASSES[kind]


def check_supported(hf_config) -> None:
    """Raise ValueError (naming what is supported) unless a model class runs the architecture, as a generator or
    as a pooling model (pooling/task.py decides which)."""
    if not set(architectures_of(hf_config)) & {*MODEL_CLASSES, *POOLING_MODEL_CLASSES["embed"],
                                                *POOLING_MODEL_CLASSES["classify"]}:
        model_class_for(hf_config)  # raises, naming the supported architectures


def model_class_for(hf_config, kind: str = "generate") -> type[nn.Module]:
    if kind not in MODEL_KINDS:
        raise ValueError(f"model kind {kind!r}: expected one of {', '.join(MODEL_KINDS)}")
    names = architectures_of(hf_config)
    classes = _classes_for(kind)
    for name in names:
        if name in classes:
            return classes[name]
    given = ", ".join(names) or f"none (model_type {getattr(hf_config, 'model_type', None)!r})"
    for other in ("embed", "classify"):
        if other != kind and set(names) & set(POOLING_MODEL_CLASSES[other]):
            task = "embed" if other == "embed" else "classify, score or reward"
            raise ValueError(f"architecture {given} is a pooling model, not a {kind} model: run it with task {task}")
    role = "" if kind == "generate" else f" as a {kind} model"
    raise ValueError(f"architecture {given} is not supported{role}; supported: {', '.join(sorted(classes))}")
