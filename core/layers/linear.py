"""Linear layers that shard across tensor-parallel ranks. Each parameter carries a `weight_loader` that takes the
full checkpoint tensor (or one packed part of it) and copies this rank's slice, and the shape of that full tensor
(`full_shape`; packed parameters also `packed_parts`: part id -> its rows) for loaders that make weights up."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def _set_packed_parts(layer: nn.Module, parts: dict) -> None:
    """Record which checkpoint tensors (part id -> full rows) are stacked along dim 0 of the layer's parameters."""
    for param in (layer.weight, layer.bias):
        if param is not None:
            param.packed_parts = parts


class LinearBase(nn.Module):
    """y = x W^T + b with W of shape [output_size, input_size]; `shard_dim` is the dim split across ranks.

    `fused` (CUDA): decode-sized half-precision batches go through the skinny GEMM kernel, which joins the
    decode step's chain of programmatically launched kernels (kernels/pdl.py), instead of cuBLAS."""

    def __init__(self, input_size: int, output_size: int, bias: bool, shard_dim: int, fused: bool = False):
        super().__init__()
        self.shard_dim = shard_dim
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.skinny = None
        if fused:  # imported only when used: the CPU path needs no Triton
            from nanovllm.kernels.skinny_gemm import MAX_ROWS, skinny_linear, workspace

            self.skinny, self.skinny_max_rows = skinny_linear, MAX_ROWS
            if self.weight.is_cuda:
                workspace(self.weight.device)
        self.weight.weight_loader = self.weight_loader
        full = [output_size, input_size]
        full[shard_dim] *= tp_size()
        self.weight.full_shape = tuple(full)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
            self.bias.full_shape = (full[0],)
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if not (param.dim() == 1 and self.shard_dim == 1):
            size = param.shape[self.shard_dim]
            loaded = loaded.narrow(self.shard_dim, tp_rank() * size, size)
        param.data.copy_(loaded)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # fp32 stays with cuBLAS: the kernel's tl.dot would round it to TF32.
        if self.skinny is not None and x.shape[0] <= self.skinny_max_rows and x.dtype != torch.float32:
            return self.skinny(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


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
        world = tp_size()
        offset = sum(self.output_sizes[:shard_id]) // world
        size = self.output_sizes[shard_id] // world
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
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
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
