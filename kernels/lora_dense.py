"""The multi-LoRA update of kernels/lora.py by dense products, for pools whose adapters are small next to the
projection: every token times every slot's A in one matrix product, each token's columns of other slots set to
zero, then one product per slice with every slot's B (the adapters' scales folded in) at once, added into the
output by the library's GEMM: three launches for an unpacked projection (`add_lora_dense`). The engine's layers
(core/lora/layers.py) store every A under the base weight instead, so that the first product is the base
projection's own (its extra columns: `add_dense_expand`'s input) and the update costs two launches.

It spends FLOPs on the slots a token does not use (`dense_extra_flops`: the share they add to the base
projection's), but a decode step is bound by reading weights, which both ways read alike, and a few library
GEMMs cost less per step than the grouped kernels' gathers and partial sums. Where the pool is wide (many slots
of a large rank, or a narrow projection) those FLOPs would count in prefill, and the grouped kernels run instead
(`DENSE_MAX_EXTRA`).

Its layout: A stored as [slices, slots, R, in] and B as [out, slots, R], so that each product reads one
contiguous matrix. Torch ops only: no host synchronisation, any device, capturable in a CUDA graph."""
from __future__ import annotations

import torch

# The dense update runs where its extra FLOPs stay below this share of the base projection's.
DENSE_MAX_EXTRA = 0.5


def dense_extra_flops(num_slots: int, num_slices: int, max_rank: int, in_features: int, out_features: int) -> float:
    """The dense update's FLOPs over the base projection's: each token times every slot's A of every slice
    (slots * slices * R columns of `in_features`) and every slot's B (slots * R per output column)."""
    return num_slots * max_rank * (num_slices / out_features + 1 / in_features)


def off_slot_mask(token_slots: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """The dense update's per-step input: [tokens, slots] bool, True where a token does not use the slot (every
    slot of a base-model token, slot -1). `slot_ids`: arange(slots) on the tokens' device."""
    return token_slots[:, None] != slot_ids[None]


def add_lora_dense(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   slice_starts: list[int], off_slot: torch.Tensor) -> torch.Tensor:
    """`add_lora`'s update by dense products (module docstring), in place; returns y. lora_a: [slots, slices, R,
    in] and lora_b: [slots, out, R], views of [slices, slots, R, in] and [out, slots, R] storage; off_slot:
    [tokens, slots] bool, True where a token does not use the slot (a base-model token's row is all True);
    slice_starts: host ints. Any device, torch ops only."""
    num_slots, num_slices, max_rank, in_features = lora_a.shape
    a = lora_a.transpose(0, 1)
    assert a.is_contiguous()
    if x.shape[0] == 0:
        return y
    return add_dense_expand(y, x @ a.view(num_slices * num_slots * max_rank, in_features).T, lora_b, slice_starts,
                            off_slot)


def add_dense_expand(y: torch.Tensor, shrunk: torch.Tensor, lora_b: torch.Tensor, slice_starts: list[int],
                     off_slot: torch.Tensor) -> torch.Tensor:
    """The dense update's second half, in place; returns y. shrunk: [tokens, slices * slots * R], each token
    times every slot's A of every slice (in that order) — `add_lora_dense`'s first product, or the extra columns
    of a base product whose weight has every A stacked under it (core/lora/layers.py); it is masked in place."""
    num_tokens = shrunk.shape[0]
    num_slots, _, max_rank = lora_b.shape
    b = lora_b.transpose(0, 1)
    assert b.is_contiguous() and off_slot.shape == (num_tokens, num_slots) and shrunk.stride(-1) == 1
    if num_tokens == 0:
        return y
    width = num_slots * max_rank
    by_slot = shrunk.view(num_tokens, len(slice_starts) - 1, num_slots, max_rank)
    # Set, not multiplied, to zero: another slot's product that overflowed (inf * 0 is NaN) must not reach the token.
    by_slot.masked_fill_(off_slot[:, None, :, None], 0.0)
    for i, (start, end) in enumerate(zip(slice_starts[:-1], slice_starts[1:])):
        y[:, start:end].addmm_(shrunk[:, i * width:(i + 1) * width], b[start:end].view(end - start, width).T)
    return y
