"""LoRA adapters: reading PEFT adapters (`adapter.py`) and deciding which adapter holds which device slot
(`slots.py`)."""
from nanovllm.lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from nanovllm.lora.slots import SlotPool

__all__ = ["LoRAAdapter", "LoRARequest", "SlotPool", "load_adapter"]
