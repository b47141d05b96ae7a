from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from nanovllm.models.registry import MODEL_CLASSES, model_class_for

__all__ = ["LlamaForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MODEL_CLASSES",
           "model_class_for"]
