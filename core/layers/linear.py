"""Linear layers that shard across tensor-parallel ranks. Each layer's `weight_loader` takes a full checkpoint
tensor (or one packed part of it) and copies this rank's slice into one of its parameters; each parameter carries
the shape of that full tensor (`full_shape`; packed parameters also `packed_parts`: part id -> its rows) for
loaders that make weights up. Under an FP8 scheme (layers/fp8.py) the column- and row-parallel layers also hold
`weight_scale`, loaded by the same loaders: a scale covers `rows_per_entry` weight rows, and is sharded along a
dim only where its extent there is smaller than its full one."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size
from nanovllm.layers.fp8 import TRITON_MAX_ROWS, fp8_linear


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def _rows_per_entry(layer: nn.Module, param: nn.Parameter) -> int:
    """Weight rows per row of `param`: 1 for the weight, its bias and per-channel scales, bn for block scales."""
    return layer.weight.full_shape[0] // param.full_shape[0]


def _set_packed_parts(layer: nn.Module, parts: dict) -> None:
    """Record which checkpoint tensors (part id -> full rows) are stacked along dim 0 of the layer's parameters."""
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.packed_parts = parts


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size, input_size]; `shard_dim` is the dim split across ranks.

    `fused` (CUDA): decode-sized half-precision batches go through the skinny GEMM kernel, which joins the
    decode step's chain of programmatically launched kernels (kernels/pdl.py), instead of cuBLAS — where the
    weight (this rank's shard) is small enough for that to pay (kernels/skinny_gemm.py `MAX_WEIGHT_BYTES`)."""

    def __init__(self, input_size: int, output_size: int, bias: bool, shard_dim: int | None, fused: bool = False):
        super().__init__()
        self.shard_dim = shard_dim
        self.fp8 = None  # the FP8 scheme once `weight` is float8 with its `weight_scale` (layers/fp8.py)
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.fused = fused
        self.skinny = None
        if fused:  # imported only when used: the CPU path needs no Triton
            from nanovllm.kernels.skinny_gemm import MAX_ROWS, MAX_WEIGHT_BYTES, skinny_linear, workspace

            if output_size * input_size * 2 <= MAX_WEIGHT_BYTES:  # the kernel runs half precision only
                self.skinny, self.skinny_max_rows = skinny_linear, MAX_ROWS
            if self.weight.is_cuda:
                workspace(self.weight.device)
        full = [output_size, input_size]
        if shard_dim is not None:
            full[shard_dim] *= tp_size()
        self.weight.full_shape = tuple(full)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.full_shape = (full[0],)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        dim = self.shard_dim
        if dim is not None and param.dim() > dim and param.shape[dim] != param.full_shape[dim]:
            size = param.shape[dim]
            loaded = loaded.narrow(dim, tp_rank() * size, size)
        param.data.copy_(loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x W^T + bias; `weight`: another matrix of `weight`'s type in its place (more rows: a LoRA layer's
        weight with the adapters' A stacked under it)."""
        if self.fp8 is not None:  # without fused ops, every per-channel size that cuBLASLt takes goes to it
            assert weight is None
            return fp8_linear(x, self.weight, self.weight_scale, self.fp8.block, bias,
                              TRITON_MAX_ROWS if self.fused else 0)
        weight = self.weight if weight is None else weight
        # fp32 stays with cuBLAS: the kernel's tl.dot would round it to TF32.
        if self.skinny is not None and x.shape[0] <= self.skinny_max_rows and x.dtype != torch.float32:
            return self.skinny(x, weight, bias)
        return F.linear(x, weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """Every rank holds the whole layer (an MoE router)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__(input_size, output_size, bias, shard_dim=None)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank returns its slice."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, fused: bool = False):
        super().__init__(input_size, _divide(output_size, tp_size(), "output features"), bias, shard_dim=0,
                         fused=fused)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input packed into one matmul (e.g. gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, fused: bool = False):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, fused)
        _set_packed_parts(self, dict(enumerate(output_sizes)))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int) -> None:
        world, rows = tp_size(), _rows_per_entry(self, param)
        offset = sum(self.output_sizes[:shard_id]) // world // rows
        size = self.output_sizes[shard_id] // world // rows
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp_rank() * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections packed into one matmul, split by heads across ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 fused: bool = False):
        world = tp_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, world, "num_attention_heads")
        self.num_kv_heads = _divide(num_kv_heads, world, "num_key_value_heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, fused)
        kv_rows = num_kv_heads * head_dim
        _set_packed_parts(self, {"q": num_heads * head_dim, "k": kv_rows, "v": kv_rows})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        rows = _rows_per_entry(self, param)
        q_size = self.num_heads * self.head_dim // rows
        kv_size = self.num_kv_heads * self.head_dim // rows
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, tp_rank() * size, size))


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial products are summed with an all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, fused: bool = False):
        super().__init__(_divide(input_size, tp_size(), "input features"), output_size, bias, shard_dim=1,
                         fused=fused)
        self.reduce = tp_size() > 1  # the group this layer was built for, not whichever engine runs later

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The bias is added once, after the reduction.
        y = self.matmul(x, None)
        if self.reduce:
            y = all_reduce(y)
        return y + self.bias if self.bias is not None else y
