from nanovllm.models.llama import SUPPORTED_MODEL_TYPES, LlamaForCausalLM

__all__ = ["LlamaForCausalLM", "SUPPORTED_MODEL_TYPES"]
