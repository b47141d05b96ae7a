from nanovllm.models.llama import LlamaForCausalLM
from nanovllm.models.registry import MODEL_CLASSES, model_class_for

__all__ = ["LlamaForCausalLM", "MODEL_CLASSES", "model_class_for"]
