"""Integer images of float32 logits whose order is the float order, for selections and sorts in Triton.

A logit's key is an int64 in [0, 2**32) (-inf included; -0.0 orders just below +0.0, where float comparison
calls them equal); a slot packs a key above an id's complement into one
int64, so that the largest slot is the largest logit and, among equal logits, the smallest id: one max reduction
finds both, and a sort orders (logit descending, id ascending)."""
from __future__ import annotations

import triton
import triton.language as tl

HALF = tl.constexpr(2147483648)
NO_KEY = tl.constexpr(-9223372036854775808)  # below every slot


@triton.jit
def key_of(values):
    """int64 in [0, 2**32): the order of the fp32 values (-inf included)."""
    bits = values.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64) + HALF


@triton.jit
def value_of(keys):
    ordered = (keys - HALF).to(tl.int32)
    return tl.where(ordered < 0, ordered ^ 0x7FFFFFFF, ordered).to(tl.float32, bitcast=True)


@triton.jit
def slot_key(values, ids):
    """The value's key above the id's complement (a larger slot is a larger value, then a smaller id); NO_KEY is
    below every slot."""
    return ((key_of(values) - HALF) << 32) | (0xFFFFFFFF - ids.to(tl.int64))


@triton.jit
def slot_parts(slots):
    """(value keys, values, ids) of slots."""
    keys = (slots >> 32) + HALF
    return keys, value_of(keys), 0xFFFFFFFF - (slots & 0xFFFFFFFF)
