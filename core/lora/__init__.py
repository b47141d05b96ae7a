"""LoRA adapters: reading PEFT adapters (`adapter.py`), applying them to the model's linear layers from device
slots (`layers.py`, kernels/lora.py on CUDA) and deciding which adapter holds which slot (`slots.py`)."""
from nanovllm.lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from nanovllm.lora.layers import LoRALayers
from nanovllm.lora.slots import SlotPool

__all__ = ["LoRAAdapter", "LoRALayers", "LoRARequest", "SlotPool", "load_adapter"]
