"""Random LoRA adapters in PEFT's format, shaped for a model: what `nanovllm bench --lora` runs against the base
model. Their weights mean nothing; an adapter's cost does not depend on them."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from nanovllm.lora.adapter import CONFIG_FILE, WEIGHTS_FILE
from nanovllm.models.geometry import head_dim_of
from nanovllm.models.registry import model_class_for


def _projections(hf_config) -> dict[str, tuple[int, int]]:
    """HF module name within a layer -> (in, out features): q/k/v/o, and gate/up/down of a dense MLP (MoE
    experts take no adapters), under the names the model's checkpoints use (packed for Phi-3)."""
    hidden, head_dim = hf_config.hidden_size, head_dim_of(hf_config)
    q, kv = hf_config.num_attention_heads * head_dim, hf_config.num_key_value_heads * head_dim
    packed = not model_class_for(hf_config).packed_modules_mapping
    shapes = ({"self_attn.qkv_proj": (hidden, q + 2 * kv)} if packed else
              {"self_attn.q_proj": (hidden, q), "self_attn.k_proj": (hidden, kv), "self_attn.v_proj": (hidden, kv)})
    shapes["self_attn.o_proj"] = (q, hidden)
    if not (getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", None)):
        inter = hf_config.intermediate_size
        shapes.update({"mlp.gate_up_proj": (hidden, 2 * inter)} if packed else
                      {"mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter)})
        shapes["mlp.down_proj"] = (inter, hidden)
    return shapes


def save_random_lora_adapter(hf_config, directory: str | Path, rank: int, seed: int = 0,
                             dtype: torch.dtype = torch.bfloat16) -> str:
    """Write a PEFT LoRA adapter of `rank` on every attention and dense-MLP projection of the model `hf_config`
    describes, with random A and B (scale 1), into `directory`; returns its path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    projections = _projections(hf_config)
    # One random pair per projection, copied into every layer: drawing each layer's own would take minutes for an
    # 8B model at rank 64, and the weights' values do not matter here.
    pairs = {module: ((torch.rand(rank, in_features, generator=generator) * 2 - 1) / in_features ** 0.5,
                      (torch.rand(out_features, rank, generator=generator) * 2 - 1) * 0.01)
             for module, (in_features, out_features) in projections.items()}
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for module, (a, b) in pairs.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{name}.lora_A.weight"], tensors[f"{name}.lora_B.weight"] = a.to(dtype, copy=True), b.to(dtype, copy=True)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "bias": "none",
              "target_modules": sorted({module.rsplit(".", 1)[1] for module in projections})}
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return str(directory)
