from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """`fused`: one Triton kernel (residual add included) instead of the torch ops below; 2-D inputs on CUDA.
    `quantize_output` (set by layers/fp8.py where this norm feeds one FP8 linear): the kernel returns the normed
    value as an Fp8Activation.

    `unit_offset` (Gemma): the checkpoint stores w and the scale is 1 + w. The loader adds the 1, so the weight
    held here is always the scale itself and every path (torch, fused kernels) multiplies by it unchanged."""

    def __init__(self, hidden_size: int, eps: float, fused: bool = False, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.kernel = None
        self.quantize_output = False
        if fused:  # imported only when used: the CPU path needs no Triton
            from nanovllm.kernels.fused_ops import rms_norm

            self.kernel = rms_norm
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.float() + 1.0 if self.unit_offset else loaded)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x.to(dtype) * self.weight

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without `residual`: norm(x). With it: (norm(x + residual), x + residual), the pre-norm block's pair."""
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual, self.quantize_output)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
