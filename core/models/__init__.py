from nanovllm.models.llama import LlamaForCausalLM, SUPPORTED_MODEL_TYPES

__all__ = ["LlamaForCausalLM", "SUPPORTED_MODEL_TYPES"]
