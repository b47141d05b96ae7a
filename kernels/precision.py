"""The `input_precision` of tl.dot for a kernel's operands: float32 operands (the engine's float32 reference mode)
multiply in IEEE float32, as torch's own float32 matmuls do; tl.dot would otherwise round them to TF32, enough to
flip a greedy choice against a float32 reference. The value is ignored for half types."""
from __future__ import annotations

import torch


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
