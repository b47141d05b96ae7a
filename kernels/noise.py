"""The sampler's random stream: a counter-based 32-bit hash of (request seed, output position, token id).

Shared by the fused kernel (`nanovllm.kernels.sampling`, which hashes in uint32 registers) and the torch path
(int64 tensors holding 32-bit values), so both draw the same noise."""
from __future__ import annotations

import torch

# `mix32` is Wellons' lowbias32 finaliser, a bijection of 32-bit words with full avalanche.
MIX_A = 0x21F0AAAD
MIX_B = 0x735A2D97
GOLDEN = 0x9E3779B9
SALT = 0x85EBCA6B
_LOW32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The kernel's 32-bit finaliser on int64 tensors holding 32-bit values (products are reduced mod 2**32)."""
    x = x ^ (x >> 16)
    x = (x * MIX_A) & _LOW32
    x = x ^ (x >> 15)
    x = (x * MIX_B) & _LOW32
    return x ^ (x >> 15)


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Each row's 32-bit noise key, a function of (seed, output position) only."""
    key = _mix32((seeds & _LOW32) ^ SALT)
    key = _mix32(key ^ ((seeds >> 32) & _LOW32))
    return _mix32(key ^ (positions & _LOW32))


def gumbel_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel samples of shape [batch, vocab], a pure function of (seed, position, vocabulary index)."""
    tokens = torch.arange(vocab_size, device=seeds.device, dtype=torch.int64)
    bits = _mix32(row_keys(seeds, positions).unsqueeze(1) ^ ((tokens * GOLDEN) & _LOW32))
    uniform = ((bits >> 9).to(torch.float32) * 2.0 + 1.0) * (1.0 / (1 << 24))  # exact, in (0, 1)
    return -torch.log(-torch.log(uniform))
