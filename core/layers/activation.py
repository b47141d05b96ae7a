import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """silu(gate) * up for the packed [gate | up] projection; `fused`: one Triton kernel (CUDA)."""

    def __init__(self, fused: bool = False):
        super().__init__()
        self.kernel = None
        if fused:  # imported only when used: the CPU path needs no Triton
            from nanovllm.kernels.fused_ops import silu_and_mul

            self.kernel = silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
