"""Which FP8 scheme (layers/fp8.py) a model runs under: from the engine's `quantization` argument and the
checkpoint's `quantization_config`, or a clear error where FP8 cannot run."""
from __future__ import annotations

import re

import torch

from nanovllm.layers.fp8 import Fp8Scheme
from nanovllm.loaders.resolve import ResolvedModel

SUPPORTED_CHECKPOINTS = (
    "quant_method 'fp8' with weight_block_size [bn, bk] and activation_scheme 'dynamic' (e.g. Qwen3-*-FP8)",
    "quant_method 'compressed-tensors' with float 8-bit weights of strategy 'channel' and dynamic float 8-bit "
    "input activations of strategy 'token'",
)
# Linear layers that nanovllm quantizes, as checkpoint names of layer 0 (what an `ignore` regex is matched
# against): a checkpoint may keep others (lm_head, MoE routers) unquantized, not these.
_QUANTIZED_PROJECTIONS = tuple(f"model.layers.0.{module}.{name}" for module, names in (
    ("self_attn", ("q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj")),
    ("mlp", ("gate_proj", "up_proj", "gate_up_proj", "down_proj"))) for name in names)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"FP8 checkpoint: {what}; supported quantization_config formats: "
                      + "; ".join(SUPPORTED_CHECKPOINTS))


def _check_unquantized(names: list[str], key: str) -> None:
    """A checkpoint may leave the LM head and routers unquantized, but not a layer nanovllm runs in FP8."""
    for name in names:
        pattern = name[3:] if name.startswith("re:") else None
        for example in _QUANTIZED_PROJECTIONS:
            projection = example.rsplit(".", 1)[1]
            hit = re.match(pattern, example) if pattern else name.endswith(f".{projection}") or name == projection
            if hit:
                raise _unsupported(f"{key} lists {name!r}, a {projection} layer left unquantized (nanovllm runs "
                                   "every projection of the decoder layers in FP8)")


def _hf_fp8(qc: dict) -> tuple[int, int]:
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise _unsupported(f"activation_scheme {qc.get('activation_scheme')!r} (static input scales)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _unsupported(f"fmt {qc.get('fmt')!r}")
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise _unsupported(f"weight_block_size {block!r} (per-tensor scales)")
    if block[1] < 16 or block[1] & (block[1] - 1):
        raise _unsupported(f"weight_block_size {block!r}: its K side must be a power of two >= 16")
    _check_unquantized(qc.get("modules_to_not_convert") or [], "modules_to_not_convert")
    return block[0], block[1]


def _compressed_tensors(qc: dict) -> None:
    if qc.get("format") not in ("float-quantized", None):
        raise _unsupported(f"compressed-tensors format {qc.get('format')!r}")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise _unsupported("compressed-tensors without config_groups")
    for name, group in groups.items():
        weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
        if "Linear" not in (group.get("targets") or []):
            raise _unsupported(f"config_groups.{name}.targets {group.get('targets')!r} (expected ['Linear'])")
        if (weights.get("num_bits"), weights.get("type"), weights.get("strategy"), weights.get("dynamic", False),
                weights.get("symmetric", True)) != (8, "float", "channel", False, True):
            raise _unsupported(f"config_groups.{name}.weights {weights!r}")
        if (inputs.get("num_bits"), inputs.get("type"), inputs.get("strategy"), inputs.get("dynamic")) != (
                8, "float", "token", True):
            raise _unsupported(f"config_groups.{name}.input_activations {inputs or None!r}")
    _check_unquantized(qc.get("ignore") or [], "ignore")


def checkpoint_quantization(hf_config) -> dict | None:
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    return qc


def fp8_scheme(quantization: str | None, resolved: ResolvedModel, device: torch.device,
               has_experts: bool) -> Fp8Scheme | None:
    """The scheme the model runs under (None: unquantized), or a ValueError that says what to change.

    A checkpoint declaring a supported FP8 `quantization_config` runs under it whatever `quantization` says
    (dummy weights: the same layout, quantized after drawing); `quantization="fp8"` quantizes a bf16/fp16
    checkpoint per output channel after loading."""
    qc = checkpoint_quantization(resolved.hf_config)
    in_checkpoint = resolved.weights_dir is not None
    if qc is not None:
        method = qc.get("quant_method")
        if method == "fp8":
            scheme = Fp8Scheme(_hf_fp8(qc), in_checkpoint, "fp8 (checkpoint, block-scaled)")
        elif method == "compressed-tensors":
            _compressed_tensors(qc)
            scheme = Fp8Scheme(None, in_checkpoint, "fp8 (compressed-tensors checkpoint, per channel)")
        else:
            raise _unsupported(f"quant_method {method!r} is not supported")
        if has_experts and in_checkpoint:
            raise ValueError("FP8 checkpoints of mixture-of-experts models are not supported (nanovllm keeps the "
                             "experts in bf16): load the bf16 checkpoint with quantization='fp8'")
    elif quantization == "fp8":  # a GGUF file too: it loads dequantized, in the model dtype
        scheme = Fp8Scheme(None, False, "fp8 (quantized at load, per channel)")
    else:
        return None
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ValueError(f"{scheme.name} needs FP8 tensor cores (compute capability >= 8.9: Ada, Hopper or later); "
                         f"this GPU is {major}.{minor}: drop quantization, or run an unquantized checkpoint")
    return scheme
