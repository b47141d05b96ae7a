"""LoRA adapters: reading PEFT adapters (`adapter.py`)."""
from nanovllm.lora.adapter import LoRAAdapter, LoRARequest, load_adapter

__all__ = ["LoRAAdapter", "LoRARequest", "load_adapter"]
