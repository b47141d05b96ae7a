"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`, in a local folder or a
Hugging Face Hub repository (loaders/hub.py resolves it through huggingface_hub's cache).

Reading one checks everything that needs no model: a plain LoRA (no DoRA, no trained biases, no replaced
modules), adapted modules among the projections nanovllm applies adapters to, ranks up to `max_lora_rank`, and
every config field either implemented, inert at inference, or unset; anything else is refused by name, saying
what to do instead. Each module's scale is PEFT's: lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA, with
`rank_pattern` / `alpha_pattern` overrides matched as PEFT matches them. Modules keep their HF names
(`model.layers.0.self_attn.q_proj`); layers.py maps them onto the model's linear layers and checks their shapes
against it (what detects an adapter trained for another base model)."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The Llama family's projections, and the packed ones of checkpoints that store them packed (Phi-3).
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj")
_MERGE = "merge the adapter into the model instead (PEFT's merge_and_unload) and serve the merged model"
# Config fields with no effect once the adapter is trained and saved (training, initialisation, bookkeeping;
# which layers were adapted shows in the tensors).
_INERT_FIELDS = {"task_type", "peft_version", "auto_mapping", "revision", "inference_mode", "lora_dropout",
                 "layers_to_transform", "layers_pattern", "exclude_modules", "megatron_core", "qalora_group_size",
                 "loftq_config", "eva_config", "runtime_config", "ensure_weight_tying"}
_READ_FIELDS = {"peft_type", "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules",
                "base_model_name_or_path", "bias", "init_lora_weights"}
_REFUSED_FIELDS = {
    "use_dora": f"DoRA (use_dora) rescales each adapted weight by a learned magnitude, which nanovllm does not "
                f"implement: {_MERGE}",
    "modules_to_save": f"modules_to_save replaces whole modules of the base model, which an adapter slot cannot "
                       f"hold: {_MERGE}",
    "lora_bias": f"lora_bias trains a bias of lora_B, which nanovllm does not implement: {_MERGE}",
    "trainable_token_indices": f"trainable_token_indices trains rows of the embeddings, which take no adapters in "
                               f"nanovllm: {_MERGE}",
    "target_parameters": f"target_parameters adapts parameters (MoE experts) rather than linear layers, which "
                         f"nanovllm does not implement: {_MERGE}",
}
# init_lora_weights values that leave a plain LoRA at inference; PiSSA, OLoRA, CorDA and LoftQ also change the
# base weights, MiCA changes the forward.
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal")
_TENSOR_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<matrix>lora_A|lora_B)\.weight")


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's names): `lora_int_id` identifies it in the engine (> 0; the same id
    must always name the same adapter), `lora_path` is a local folder or a Hub id."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id must be a positive int, got "
                             f"{self.lora_int_id!r}")


@dataclass(frozen=True)
class LoRAModule:
    """One adapted linear layer: y += scale * (x @ lora_a^T) @ lora_b^T."""

    lora_a: torch.Tensor  # [rank, in_features]
    lora_b: torch.Tensor  # [out_features, rank]
    scale: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class LoRAAdapter:
    name: str
    directory: Path
    base_model: str | None  # the config's base_model_name_or_path, for error messages
    modules: dict[str, LoRAModule]  # by the HF module name, e.g. model.layers.0.self_attn.q_proj

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def adapter_dir(source: str | Path, revision: str | None = None) -> Path:
    """The local folder of an adapter given as a folder or a Hub id (`revision`: its branch, tag or commit)."""
    from nanovllm.loaders import hub

    path = Path(source).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ValueError(f"revision={revision!r} applies to Hugging Face Hub adapter ids, not to {str(source)!r}")
        return path
    if hub.is_repo_id(str(source)):
        return hub.snapshot_dir(str(source), revision, "auto", patterns=[CONFIG_FILE, WEIGHTS_FILE], what="adapter")
    raise ValueError(f"LoRA adapter {str(source)!r} is neither a folder nor a Hugging Face Hub id (org/name)")


def load_adapter(source: str | Path, max_lora_rank: int, name: str | None = None,
                 revision: str | None = None) -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter (module docstring); its tensors stay on the CPU in their saved dtype."""
    directory = adapter_dir(source, revision)
    name = name or str(source)
    config_file, weights_file = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {name!r}: {directory} has no {CONFIG_FILE} (a PEFT adapter folder has it)")
    if not weights_file.is_file():
        hint = (" (it has adapter_model.bin: save the adapter with safe_serialization=True, or convert the file)"
                if (directory / "adapter_model.bin").is_file() else "")
        raise ValueError(f"LoRA adapter {name!r}: {directory} has no {WEIGHTS_FILE}{hint}")
    config = json.loads(config_file.read_text())
    _check_config(config, name)
    tensors = load_file(str(weights_file))
    modules = _modules(config, tensors, name, max_lora_rank)
    return LoRAAdapter(name, directory, config.get("base_model_name_or_path"), modules)


def _check_config(config: dict, name: str) -> None:
    def refuse(why: str):
        raise ValueError(f"LoRA adapter {name!r}: {why}")

    if config.get("peft_type") != "LORA":
        refuse(f"peft_type is {config.get('peft_type')!r}; nanovllm serves LoRA adapters only")
    for field, value in config.items():
        if field in _REFUSED_FIELDS and value:
            refuse(_REFUSED_FIELDS[field])
        if field not in _READ_FIELDS | _INERT_FIELDS | set(_REFUSED_FIELDS) and value not in (None, False, [], {}):
            refuse(f"{CONFIG_FILE} sets {field}={value!r}, which nanovllm does not implement (it serves plain LoRA "
                   f"adapters); {_MERGE}")
    if config.get("bias", "none") != "none":
        refuse(f"bias={config['bias']!r} trains the base model's biases, which an adapter slot cannot hold "
               f"(bias='none' can): {_MERGE}")
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        refuse(f"init_lora_weights={init!r} changes the base model's weights or the LoRA forward; convert the "
               f"adapter to a plain LoRA (PEFT's save_pretrained with path_initial_model_for_weight_conversion) or "
               f"{_MERGE}")
    targets = config.get("target_modules")
    if isinstance(targets, list):  # (a string is a regular expression, or "all-linear": the tensors tell)
        for target in targets:
            _check_module(target, name)


def _check_module(module: str, adapter: str) -> None:
    """Refuse a module that nanovllm applies no adapter to, saying why."""
    leaf = module.rsplit(".", 1)[-1]
    if leaf in TARGET_MODULES and ".experts." not in f".{module}":
        return
    if leaf in ("lm_head", "embed_tokens"):
        why = "the LM head and the embeddings take no adapters in nanovllm (only the q/k/v/o and gate/up/down projections do)"
    elif ".experts." in f".{module}." or leaf in ("experts", "w1", "w2", "w3", "gate", "shared_expert_gate"):
        why = "MoE experts and routers take no adapters in nanovllm (only dense q/k/v/o and gate/up/down projections do)"
    else:
        why = f"nanovllm applies adapters to these projections only: {', '.join(TARGET_MODULES)}"
    raise ValueError(f"LoRA adapter {adapter!r} adapts {module!r}: {why}; {_MERGE}")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rule for rank_pattern / alpha_pattern: the first key that matches the end of the module name at a
    dot boundary, as a regular expression."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _modules(config: dict, tensors: dict[str, torch.Tensor], name: str, max_lora_rank: int) -> dict[str, LoRAModule]:
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _TENSOR_KEY.fullmatch(key)
        if match is None:
            if "lora_embedding_" in key:
                _check_module("embed_tokens", name)
            if "lora_magnitude_vector" in key:
                raise ValueError(f"LoRA adapter {name!r}: {_REFUSED_FIELDS['use_dora']}")
            if ".lora_B.bias" in key:
                raise ValueError(f"LoRA adapter {name!r}: {_REFUSED_FIELDS['lora_bias']}")
            raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds {key!r}, which is no LoRA matrix of PEFT's "
                             "layout (base_model.model.<module>.lora_A.weight / lora_B.weight)")
        _check_module(match["module"], name)
        pairs.setdefault(match["module"], {})[match["matrix"]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA matrices")
    modules = {}
    for module, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module} has {', '.join(pair)} but not both lora_A and lora_B")
        a, b = pair["lora_A"], pair["lora_B"]
        rank = _pattern_value(config.get("rank_pattern") or {}, module, config.get("r", 8))
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"LoRA adapter {name!r}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, "
                             f"not of the rank {rank} that {CONFIG_FILE} gives it")
        if rank > max_lora_rank:
            raise ValueError(f"LoRA adapter {name!r} has rank {rank} ({module}), above max_lora_rank={max_lora_rank}: "
                             f"start the engine with max_lora_rank >= {rank}")
        alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = LoRAModule(a, b, float(scale))
    return modules
