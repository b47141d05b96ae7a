"""FP8 weights in a built model: which layers hold them, their parameters before a checkpoint loads, the
quantization of weights loaded in the model dtype, and which fused kernels quantize activations for their linear.
The numeric rule itself (quantization, the FP8 linear, its CPU reference) is layers/fp8.py."""
from __future__ import annotations

import torch
from torch import nn

from nanovllm.distributed import tp_size
from nanovllm.layers.fp8 import FP8_DTYPE, WEIGHT_SCALE_SEARCH, Fp8Scheme, quantize
from nanovllm.layers.linear import ColumnParallelLinear, RowParallelLinear


def fp8_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The layers that hold FP8 weights under a scheme: column- and row-parallel linears (see the module doc)."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


def _scale_shape(layer: nn.Module, block: tuple[int, int] | None, shape: tuple[int, int]) -> tuple[int, int]:
    n, k = shape
    if block is None:
        return (n, 1)
    bn, bk = block
    if n % bn or k % bk:
        raise ValueError(f"{type(layer).__name__} of {n} x {k} (this rank's shard) does not divide into "
                         f"{bn} x {bk} FP8 scale blocks: use another tensor_parallel_size")
    return (n // bn, k // bk)


def _replace_weight(layer: nn.Module, fp8_weight: torch.Tensor) -> nn.Parameter:
    """Swap the layer's weight for `fp8_weight` (its shape attributes carried over); returns the old weight."""
    weight = layer.weight
    layer.weight = nn.Parameter(fp8_weight, requires_grad=False)
    for attr in ("full_shape", "packed_parts"):
        if hasattr(weight, attr):
            setattr(layer.weight, attr, getattr(weight, attr))
    return weight


def prepare_fp8(model: nn.Module, scheme: Fp8Scheme) -> None:
    """Give the layers their FP8 parameters before loading. From a checkpoint: `weight` becomes float8 and
    `weight_scale` (this rank's shard; `full_shape`, `packed_parts` in scale rows, as linear.py expects) is
    added. Quantized after loading: the weight stays in the model dtype until `finish_fp8`."""
    if not scheme.in_checkpoint:
        return
    for _, layer in fp8_layers(model):
        layer.fp8 = scheme
        weight = _replace_weight(layer, torch.empty(layer.weight.shape, dtype=FP8_DTYPE, device=layer.weight.device))
        scale = nn.Parameter(torch.empty(_scale_shape(layer, scheme.block, tuple(weight.shape)),
                                         dtype=torch.float32, device=weight.device), requires_grad=False)
        scale.full_shape = _scale_shape(layer, scheme.block, weight.full_shape)
        rows_per_scale = weight.full_shape[0] // scale.full_shape[0]
        if hasattr(weight, "packed_parts"):
            for part, rows in weight.packed_parts.items():
                if rows % (rows_per_scale * tp_size()):
                    raise ValueError(f"packed part {part!r} of {rows} rows does not divide into "
                                     f"{rows_per_scale}-row FP8 scale blocks on each of {tp_size()} ranks")
            scale.packed_parts = {part: rows // rows_per_scale for part, rows in weight.packed_parts.items()}
        layer.weight_scale = scale
    # HF `fp8` checkpoints name the scale `weight_scale_inv` (a multiplier despite the name).
    model.checkpoint_renames = {**getattr(model, "checkpoint_renames", {}), ".weight_scale_inv": ".weight_scale"}


@torch.no_grad()
def finish_fp8(model: nn.Module, scheme: Fp8Scheme) -> None:
    """After loading: quantize the weights loaded in the model dtype, one layer at a time (each layer's
    model-dtype copy is freed as soon as it is quantized); then let fused kernels quantize for their linears."""
    if not scheme.in_checkpoint:
        for _, layer in fp8_layers(model):
            weight = layer.weight
            block = scheme.block or (1, weight.shape[1])
            _scale_shape(layer, scheme.block, tuple(weight.shape))  # the same divisibility error as from a checkpoint
            q, scale = quantize(weight, block, WEIGHT_SCALE_SEARCH)
            _replace_weight(layer, q)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            layer.fp8 = scheme
    fuse_activation_quantization(model)


def fuse_activation_quantization(model: nn.Module) -> None:
    """Where a module's output feeds one per-channel FP8 linear and nothing else, and the module is a fused kernel
    (its `kernel`, CUDA) that can quantize (`quantize_output`), it hands that linear an `Fp8Activation` instead of
    a tensor the linear quantizes in a launch of its own. The models name those pairs: a module's
    `fp8_input_pairs()` lists (producer, the linear it feeds)."""
    for module in model.modules():
        for producer, linear in module.fp8_input_pairs() if hasattr(module, "fp8_input_pairs") else ():
            if (linear.fp8 is not None and linear.fp8.block is None and getattr(producer, "kernel", None) is not None
                    and hasattr(producer, "quantize_output")):
                producer.quantize_output = True
