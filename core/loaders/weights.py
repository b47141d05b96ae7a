from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

# Checkpoint tensors with no parameter in our model: rotary tables are recomputed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's matrix in an MoE checkpoint: `<layer>.experts.<index>.<projection>.weight`.
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight$")
# Stacked expert parameter of each part (models/moe.py's `expert_projections` name the parts).
_STACKED_PARAMETER = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}


def copy_whole(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Loader of parameters every rank holds in full (norms)."""
    param.data.copy_(loaded)


def checkpoint_target(model: nn.Module, name: str) -> tuple[str, object]:
    """The parameter a checkpoint tensor fills, and which part of it (None: all of it).

    In order: the model's `checkpoint_renames` (fragment -> fragment); one expert's matrix of an MoE layer ->
    the stacked `experts.gate_up_proj` / `experts.down_proj`, part (expert index, "gate" | "up" | "down"); packed
    projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) through `packed_modules_mapping`."""
    for old, new in getattr(model, "checkpoint_renames", {}).items():
        name = name.replace(old, new)
    projections = getattr(model, "expert_projections", {})
    expert = _EXPERT_TENSOR.match(name) if projections else None
    if expert and expert["projection"] in projections:
        kind = projections[expert["projection"]]
        return f"{expert['experts']}.{_STACKED_PARAMETER[kind]}", (int(expert["index"]), kind)
    for fragment, (packed_fragment, part_id) in getattr(model, "packed_modules_mapping", {}).items():
        if f".{fragment}." in name:
            return name.replace(f".{fragment}.", f".{packed_fragment}."), part_id
    return name, None


def load_safetensors_weights(model: nn.Module, directory: Path) -> None:
    """Load every `*.safetensors` shard of an HF checkpoint directory, one tensor at a time.

    Packed parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj, MoE experts -> stacked expert tensors) are
    filled part by part through the parameter's `weight_loader`, which also takes this rank's tensor-parallel
    slice."""
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    expert_parts: dict[str, set] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, part = checkpoint_target(model, name)
                param = params.get(target)
                if param is None:
                    raise ValueError(f"checkpoint tensor {name!r} in {file.name} matches no model parameter")
                tensor = f.get_tensor(name)
                loader = getattr(param, "weight_loader", copy_whole)
                if part is None:
                    loader(param, tensor)
                else:
                    loader(param, tensor, part)
                loaded.add(target)
                if hasattr(param, "expert_parts"):
                    expert_parts.setdefault(target, set()).add(part)
    incomplete = [f"{name} ({len(parts)} of {params[name].expert_parts} expert tensors)"
                  for name, parts in expert_parts.items() if None not in parts
                  and len(parts) < params[name].expert_parts]
    missing = sorted(n for n in params if n not in loaded and not (tied and n == "lm_head.weight")) + incomplete
    if missing:
        raise ValueError(f"checkpoint {directory} lacks weights for: {', '.join(missing[:8])}"
                         + (" …" if len(missing) > 8 else ""))


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: small uniform values keep activations finite in low precision; norms 1.

    Every rank draws each parameter's full (unsharded) tensor in the same order from the same seed and loads it
    through the parameter's `weight_loader`, like a checkpoint tensor: each rank holds its shard of one model, and
    every tensor-parallel size runs the same model."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        full = torch.empty(getattr(param, "full_shape", param.shape), dtype=param.dtype, device=param.device)
        full.uniform_(-0.05, 0.05, generator=generators[param.device])
        loader = getattr(param, "weight_loader", copy_whole)
        parts = getattr(param, "packed_parts", None)
        if parts is None:
            loader(param, full)
            continue
        for part_id, part in zip(parts, full.split(list(parts.values()))):
            loader(param, part, part_id)
