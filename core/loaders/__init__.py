from nanovllm.loaders.resolve import ResolvedModel, resolve_model
from nanovllm.loaders.weights import load_dummy_weights, load_safetensors_weights, load_weights

__all__ = ["ResolvedModel", "resolve_model", "load_dummy_weights", "load_safetensors_weights", "load_weights"]
