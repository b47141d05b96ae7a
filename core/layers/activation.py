import torch
import torch.nn.functional as F
from torch import nn


class GeluTanhAndMul(nn.Module):
    """gelu(gate) * up with GELU's tanh approximation (HF's gelu_pytorch_tanh, Gemma) for the packed
    [gate | up] projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class SiluAndMul(nn.Module):
    """silu(gate) * up for the packed [gate | up] projection; `fused`: one Triton kernel (CUDA).
    `quantize_output` (set by layers/fp8.py where this feeds one FP8 linear): the kernel returns an Fp8Activation."""

    def __init__(self, fused: bool = False):
        super().__init__()
        self.kernel = None
        self.quantize_output = False
        if fused:  # imported only when used: the CPU path needs no Triton
            from nanovllm.kernels.fused_ops import silu_and_mul

            self.kernel = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x, self.quantize_output)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
