from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanovllm.layers.fp8 import FP8_DTYPE, Fp8Scheme
from nanovllm.loaders.fp8_weights import finish_fp8, prepare_fp8
from nanovllm.loaders.integrity import weight_files

# Checkpoint tensors with no parameter in our model: rotary tables and the position / token-type id buffers older
# BERT checkpoints saved are recomputed.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "embeddings.position_ids", "embeddings.token_type_ids")
# One expert's matrix in an MoE checkpoint: `<layer>.experts.<index>.<projection>.weight`.
_EXPERT_TENSOR = re.compile(r"^(?P<experts>.+\.experts)\.(?P<index>\d+)\.(?P<projection>\w+)\.weight$")
# Stacked expert parameter of each part (models/moe.py's `expert_projections` name the parts).
_STACKED_PARAMETER = {"gate": "gate_up_proj", "up": "gate_up_proj", "down": "down_proj"}


def copy_whole(param: nn.Parameter, loaded: torch.Tensor) -> None:
    """Loader of parameters every rank holds in full (norms)."""
    param.data.copy_(loaded)


def parameter_loaders(model: nn.Module) -> dict[str, tuple[nn.Parameter, Callable]]:
    """Each parameter by its full name, with the loader of the layer that holds it: the layer's `weight_loader`
    method (which takes this rank's tensor-parallel slice), else `copy_whole`. Looked up here rather than stored
    on the parameters: a bound method on a parameter of its own layer would be a reference cycle, which keeps a
    dropped engine's weights alive until a garbage collection."""
    loaders = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        loader = getattr(module, "weight_loader", copy_whole)
        for param_name, param in module.named_parameters(recurse=False, remove_duplicate=False):
            loaders[f"{module_name}.{param_name}" if module_name else param_name] = (param, loader)
    return loaders


def load_whole(param: nn.Parameter, loader: Callable, loaded: torch.Tensor) -> None:
    """Load a full (unsharded) tensor into `param` through its layer's `loader`; a packed parameter's tensor
    (q|k|v, gate|up stacked along dim 0, as Phi-3 checkpoints store them) is cut into its parts, each loaded like
    a separate checkpoint tensor, so that every rank takes its own heads or rows of each part."""
    parts = getattr(param, "packed_parts", None)
    if parts is None:
        loader(param, loaded)
        return
    if loaded.shape[0] != sum(parts.values()):
        raise ValueError(f"packed tensor of {loaded.shape[0]} rows, expected {sum(parts.values())} "
                         f"({' + '.join(f'{k}: {v}' for k, v in parts.items())})")
    for part_id, part in zip(parts, loaded.split(list(parts.values()))):
        loader(param, part, part_id)


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


def parameter_name(model: nn.Module, target: str, params: dict) -> str | None:
    """The model parameter a checkpoint target names, across the base-model prefix: a task model (`model.`,
    `bert.`, `roberta.`: the model's `base_model_prefix`) saved as its bare base model, or the reverse; None for a
    tensor the model declares unused (`ignored_checkpoint_prefixes`, e.g. an embedder's LM head)."""
    base = getattr(model, "base_model_prefix", None)
    candidates = [target]
    if base is not None:
        prefix = f"{base}."
        candidates.append(target.removeprefix(prefix) if target.startswith(prefix) else prefix + target)
    for name in candidates:
        if name in params:
            return name
    ignored = getattr(model, "ignored_checkpoint_prefixes", ())
    if ignored and any(name.startswith(ignored) for name in candidates):
        return None
    return target


def load_safetensors_weights(model: nn.Module, directory: Path) -> None:
    """Load the safetensors files of an HF checkpoint directory (`integrity.weight_files`), one tensor at a time.

    Packed parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj, MoE experts -> stacked expert tensors) are
    filled part by part through their layer's `weight_loader`, which also takes this rank's tensor-parallel
    slice; a checkpoint that stores a packed tensor whole (Phi-3's qkv_proj, gate_up_proj) is cut into the same
    parts."""
    files = weight_files(directory)
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    params = parameter_loaders(model)
    tied = getattr(model, "tie_word_embeddings", False)
    loaded: set[str] = set()
    expert_parts: dict[str, set] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                    continue
                target, part = checkpoint_target(model, name)
                target = parameter_name(model, target, params)
                if target is None:
                    continue
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} in {file.name} matches no model parameter")
                param, loader = params[target]
                tensor = f.get_tensor(name)
                if (tensor.dtype == FP8_DTYPE) != (param.dtype == FP8_DTYPE):
                    raise ValueError(f"checkpoint tensor {name!r} in {file.name} is {tensor.dtype} but its parameter "
                                     f"{target} is {param.dtype}: the checkpoint's FP8 layers do not match its "
                                     "quantization_config (layers/fp8.py says which layers run in FP8)")
                if part is None:
                    load_whole(param, loader, tensor)
                else:
                    loader(param, tensor, part)
                loaded.add(target)
                if hasattr(param, "expert_parts"):
                    expert_parts.setdefault(target, set()).add(part)
    incomplete = [f"{name} ({len(parts)} of {params[name][0].expert_parts} expert tensors)"
                  for name, parts in expert_parts.items() if None not in parts
                  and len(parts) < params[name][0].expert_parts]
    missing = sorted(n for n in params if n not in loaded and not (tied and n == "lm_head.weight")) + incomplete
    if missing:
        raise ValueError(f"checkpoint {directory} lacks weights for: {', '.join(missing[:8])}"
                         + (" …" if len(missing) > 8 else ""))


@torch.no_grad()
def load_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights for benchmarks: small uniform values keep activations finite in low precision; norms 1.

    Every rank draws each parameter's full (unsharded) tensor in the same order from the same seed and loads it
    through its layer's `weight_loader`, like a checkpoint tensor: each rank holds its shard of one model, and
    every tensor-parallel size runs the same model."""
    generators: dict[torch.device, torch.Generator] = {}
    loaders = parameter_loaders(model)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.device not in generators:
            generators[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        full = torch.empty(getattr(param, "full_shape", param.shape), dtype=param.dtype, device=param.device)
        full.uniform_(-0.05, 0.05, generator=generators[param.device])
        load_whole(param, loaders[name][1], full)


def load_weights(model: nn.Module, weights_dir: Path | None, fp8: Fp8Scheme | None, seed: int = 0) -> None:
    """Fill a freshly built model: from the checkpoint directory (None: dummy weights from `seed`), its linear
    layers under the FP8 scheme `fp8` when one applies (layers/fp8.py: FP8 parameters before loading, or
    quantized after)."""
    if fp8 is not None:
        prepare_fp8(model, fp8)
    if weights_dir is None:
        load_dummy_weights(model, seed=seed)
    else:
        load_safetensors_weights(model, weights_dir)
    if fp8 is not None:
        finish_fp8(model, fp8)
