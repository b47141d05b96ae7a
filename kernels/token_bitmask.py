"""Grammar token bitmask applied to a step's logits before sampling.

Rule: for each i with `row_indices[i] >= 0`, token t of logits row `row_indices[i]` keeps its logit when bit
`t % 32` of `bitmask[i, t // 32]` is 1 and becomes -inf when it is 0 (xgrammar's layout: int32 words, bit 0 is
the lowest token of its word). A bitmask row may be narrower than the logits: tokens past its 32 x width bits
become -inf (a model's vocabulary padded past its tokenizer's); bits past the logits' vocabulary are ignored.
Entries with `row_indices[i] < 0` do nothing, so a launch may be padded to a fixed size (a CUDA graph captures
one grid). A logits row is named at most once; rows that no entry names are untouched: only the constrained rows
of a batch carry a bitmask row.

The kernel only writes the disallowed positions and never reads the logits: its traffic is the bitmask plus
the -inf stores, not a pass over [rows, vocab]."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 4096


def bitmask_width(vocab_size: int) -> int:
    """int32 words per bitmask row."""
    return -(-vocab_size // 32)


# A bitmask's row stride is its tokenizer's word count, which Triton would specialize on (divisible by 16 or not):
# unspecialized, the kernel that engine start-up compiles is the one every tokenizer's masks use.
@triton.jit(do_not_specialize=["stride_bitmask"])
def _apply_token_bitmask_kernel(logits, bitmask, row_indices, stride_logits, stride_bitmask, vocab_size,
                                mask_tokens, BLOCK: tl.constexpr):
    entry = tl.program_id(0).to(tl.int64)
    row = tl.load(row_indices + entry).to(tl.int64)
    if row >= 0:
        tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        in_vocab = tokens < vocab_size
        words = tl.load(bitmask + entry * stride_bitmask + tokens // 32, mask=in_vocab & (tokens < mask_tokens),
                        other=0)
        allowed = ((words >> (tokens % 32)) & 1) != 0
        tl.store(logits + row * stride_logits + tokens, float("-inf"), mask=in_vocab & ~allowed)


def _check(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be a [rows, vocab] tensor with contiguous rows, got shape {tuple(logits.shape)}")
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.stride(1) != 1:
        raise ValueError(f"bitmask must be a 2-D int32 tensor with contiguous rows, got {bitmask.dtype} "
                         f"{tuple(bitmask.shape)}")
    if bitmask.shape[1] > bitmask_width(logits.shape[1]):
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; a vocabulary of {logits.shape[1]} "
                         f"needs at most {bitmask_width(logits.shape[1])}")
    if row_indices.dim() != 1 or row_indices.dtype not in (torch.int32, torch.int64):
        raise ValueError("row_indices must be a 1-D int32 or int64 tensor")
    if row_indices.shape[0] > bitmask.shape[0]:
        raise ValueError(f"{row_indices.shape[0]} row indices but only {bitmask.shape[0]} bitmask rows")
    if not (logits.device == bitmask.device == row_indices.device):
        raise ValueError("logits, bitmask and row_indices must be on one device")


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    """In place, by the rule of this module: one program per (bitmask entry, block of BLOCK_TOKENS tokens)."""
    _check(logits, bitmask, row_indices)
    if row_indices.shape[0] == 0:
        return
    grid = (row_indices.shape[0], triton.cdiv(logits.shape[1], BLOCK_TOKENS))
    _apply_token_bitmask_kernel[grid](logits, bitmask, row_indices, logits.stride(0), bitmask.stride(0),
                                      logits.shape[1], 32 * bitmask.shape[1], BLOCK=BLOCK_TOKENS, num_warps=4)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    """The reference (and CPU) path of the same rule, in place."""
    _check(logits, bitmask, row_indices)
    named = row_indices >= 0
    rows = row_indices[named].long()
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[:row_indices.shape[0]][named].unsqueeze(-1) >> shifts) & 1
    allowed = torch.nn.functional.pad(bits.flatten(1), (0, max(logits.shape[1] - bits.shape[1] * 32, 0)))
    allowed = allowed[:, :logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, row_indices: torch.Tensor) -> None:
    """Set the logits that the constrained rows' bitmask disallows to -inf, in place: the Triton kernel on a
    CUDA device, the torch path elsewhere. `bitmask[i]` belongs to logits row `row_indices[i]`."""
    if logits.is_cuda:
        apply_token_bitmask_triton(logits, bitmask, row_indices)
    else:
        apply_token_bitmask_torch(logits, bitmask, row_indices)
