"""Many LoRA adapters in one batch: every token names an adapter slot (-1: the base model alone), and each
projection adds its tokens' low-rank updates in two launches for the whole batch, whatever the mix of adapters:

    y[t, columns of slice i] += (x[t] @ A[slot_t, i]^T) @ B[slot_t, columns of slice i]^T

A projection's adapters live in a slot pool: A [slots, slices, R, in], B [slots, out, R], with R = max_lora_rank
and every slot's rank zero-padded up to it; per slot and slice its rank (0: no adapter there). B holds the
adapter's scale (PEFT's lora_alpha / r) folded in when the slot is written, so no launch applies it. A packed
projection (q|k|v, gate|up) has one slice per part: each part has its own A, and its B fills that part's column
range of the packed output.

The rule:

1. `sort_tokens_by_slot` (once per step: every projection of every layer reuses it): the tokens sorted by slot,
   each slot's run padded to `block_m` rows, and the slot of every block of `block_m` rows. It is the MoE
   experts' layout (kernels/fused_moe.py `align_by_expert`) with one "expert" per slot plus one for the base
   model, whose blocks the LoRA kernels skip. The caller's token order is therefore free (rows of one adapter
   need not be adjacent): the runner keeps its rows in their order, which the attention metadata, sampling and
   logits indices all follow, and a decode batch of mixed adapters still multiplies each adapter's weights once
   per block of its tokens instead of once per token.
2. `_shrink_kernel` (one launch): a program takes one block of tokens (one slot), one tile of the rank and one
   slice, gathers the tokens' rows of x and multiplies them by the slot's A, in float32; with `split_k` > 1 the
   input dimension is split across programs, each writing its own partial sums (no atomics: the expand adds
   them in a fixed order, so results are deterministic).
3. `_expand_kernel` (one launch): the same blocks times the slot's B, over the slot's own rank only (a slot of
   rank 8 in a pool of rank 64 costs rank 8), added into the base projection's output in place. Each
   output element belongs to one program: no two programs write it.

Launches see only device tensors and grids that depend on the number of tokens alone: no host synchronisation,
so a decode step with adapters can be captured in a CUDA graph (the slot of each token is the graph's input).

kernels/lora_dense.py is the other way, for pools whose adapters are small next to the projection (the layer
chooses). The layer stores A as [slices, slots, R, in] and B as [out, slots, R] for it, and hands these kernels
the [slots, ...] views of the same storage.

float32 inputs multiply in IEEE float32 (tl.dot would otherwise round them to TF32); half types accumulate in
float32, and the expand rounds the shrink's sums to the weights' type before its product (as the model would)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.fused_moe import align_by_expert
from nanovllm.kernels.precision import dot_precision


class LoRABatch(NamedTuple):
    """A step's tokens sorted by slot (`sort_tokens_by_slot`)."""

    sorted_tokens: torch.Tensor  # [blocks * block_m] int32: token index, or num_tokens for a padding row
    block_group: torch.Tensor  # [blocks] int32: slot + 1 of each block (0: base-model tokens; -1: unused block)
    block_m: int
    num_tokens: int


class LoRATiles(NamedTuple):
    block_r: int  # rank columns per program (shrink) and rank step (expand)
    block_k: int  # input features per step (shrink)
    block_n: int  # output columns per program (expand)
    split_k: int  # programs sharing one shrink tile's input dimension
    num_warps: int = 4
    num_stages: int = 3


def choose_block_m(num_tokens: int, max_loras: int) -> int:
    """Row blocks about as tall as a slot's average share of the tokens (16 to 64): a decode batch spread over
    the slots wastes little padding, a prefill chunk of one adapter gets full tensor-core tiles."""
    per_slot = max(num_tokens // (max_loras + 1), 1)
    return min(64, max(16, triton.next_power_of_2(per_slot)))


def choose_tiles(num_blocks: int, num_slices: int, max_rank: int, in_features: int) -> LoRATiles:
    """Rank tiles of up to 64; the input dimension split until the shrink has about 256 programs (its grid counts
    every block the layout has room for, used or not), so that the few blocks of a decode step still spread over
    the device. Untuned."""
    block_r = min(64, max(16, triton.next_power_of_2(max_rank)))
    programs = num_blocks * triton.cdiv(max_rank, block_r) * num_slices
    split_k = max(1, min(8, in_features // 512, 256 // programs))
    return LoRATiles(block_r=block_r, block_k=64, block_n=64, split_k=split_k)


# Shared memory the expand's pipelined stages may buffer beyond the first: well inside every recent GPU's limit.
EXPAND_STAGE_BYTES = 96 * 1024


def expand_stages(block_m: int, tiles: LoRATiles, weight_bytes: int) -> int:
    """The expand's pipeline depth: each stage of its rank loop holds one rank tile of every split's partial sums
    (float32) and one tile of B, so with many splits of a wide rank tile even a second stage would not fit (rank
    64, 8 splits, 64-row blocks: 136 KiB a stage)."""
    per_stage = tiles.split_k * block_m * tiles.block_r * 4 + tiles.block_n * tiles.block_r * weight_bytes
    return max(1, min(tiles.num_stages, 1 + EXPAND_STAGE_BYTES // per_stage))


def sort_tokens_by_slot(token_slots: torch.Tensor, max_loras: int, block_m: int | None = None) -> LoRABatch:
    """token_slots: [tokens] slot of each token (-1: the base model). Device work only (no host sync)."""
    num_tokens = token_slots.numel()
    block_m = block_m or choose_block_m(num_tokens, max_loras)
    groups = token_slots.reshape(-1, 1).to(torch.int64) + 1
    blocks = align_by_expert(groups, max_loras + 1, block_m)
    return LoRABatch(blocks.sorted_pairs, blocks.block_expert, block_m, num_tokens)


@triton.jit
def _shrink_kernel(x, lora_a, partials, sorted_tokens, block_group, ranks, num_tokens, in_features, num_slices,
                   stride_xt, stride_a_slot, stride_a_slice, stride_a_rank, stride_p_split, stride_p_slice,
                   stride_p_token,
                   BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """partials[split, slice, token, r] = x[token, k range of split] @ A[slot, slice, r, k range]^T for the
    tokens of one block, rank columns below the slot's rank only."""
    pid_r = tl.program_id(0)
    pid_m = tl.program_id(1)
    slice_id = tl.program_id(2)
    split = pid_r % SPLIT_K
    r_start = (pid_r // SPLIT_K) * BLOCK_R
    slot = tl.load(block_group + pid_m) - 1
    if slot < 0:
        return
    rank = tl.load(ranks + slot * num_slices + slice_id)
    if r_start >= rank:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(sorted_tokens + rows)
    row_ok = tokens < num_tokens
    offs_r = r_start + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    # Whole BLOCK_K steps per split, so only the last split of an uneven K is partial.
    k_per_split = tl.cdiv(tl.cdiv(in_features, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    x_tile = x + tokens.to(tl.int64)[:, None] * stride_xt + offs_k[None, :]
    a_tile = (lora_a + slot.to(tl.int64) * stride_a_slot + slice_id * stride_a_slice
              + offs_r.to(tl.int64)[:, None] * stride_a_rank + offs_k[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_ok = (k + offs_k) < k_end
        xs = tl.load(x_tile + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_tile + k, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(xs, tl.trans(a), acc, input_precision=PRECISION)
    dst = (partials + split * stride_p_split + slice_id * stride_p_slice
           + tokens.to(tl.int64)[:, None] * stride_p_token + offs_r[None, :])
    tl.store(dst, acc, mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _expand_kernel(partials, lora_b, y, sorted_tokens, block_group, ranks, slice_starts, num_tokens,
                   num_slices, stride_p_split, stride_p_slice, stride_p_token, stride_b_slot, stride_b_row, stride_yt,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """y[token, start + n] += (sum of the splits' partials[token, :rank]) @ B[slot, start + n, :rank]^T for the
    tokens of one block and one tile of the slice's columns."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    slice_id = tl.program_id(2)
    slot = tl.load(block_group + pid_m) - 1
    if slot < 0:
        return
    rank = tl.load(ranks + slot * num_slices + slice_id)
    col_start = tl.load(slice_starts + slice_id)
    width = tl.load(slice_starts + slice_id + 1) - col_start
    if (rank == 0) | (pid_n * BLOCK_N >= width):
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = tl.load(sorted_tokens + rows)
    row_ok = tokens < num_tokens
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < width
    cols = col_start + offs_n
    offs_r = tl.arange(0, BLOCK_R)
    p_tile = partials + slice_id * stride_p_slice + tokens.to(tl.int64)[:, None] * stride_p_token + offs_r[None, :]
    b_tile = lora_b + slot.to(tl.int64) * stride_b_slot + cols.to(tl.int64)[:, None] * stride_b_row + offs_r[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r in range(0, rank, BLOCK_R):
        r_ok = (r + offs_r) < rank
        s = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):
            s += tl.load(p_tile + split * stride_p_split + r, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(b_tile + r, mask=n_ok[:, None] & r_ok[None, :], other=0.0)
        acc = tl.dot(s.to(b.dtype), tl.trans(b), acc, input_precision=PRECISION)
    dst = y + tokens.to(tl.int64)[:, None] * stride_yt + cols[None, :]
    mask = row_ok[:, None] & n_ok[None, :]
    base = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (base + acc).to(y.dtype.element_ty), mask=mask)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: torch.Tensor,
             slice_starts: torch.Tensor, max_slice_width: int, batch: LoRABatch,
             tiles: LoRATiles | None = None) -> torch.Tensor:
    """y [tokens, out] += each token's adapter update of x [tokens, in], in place; returns y. Tokens of slot -1 are
    left as they are. lora_a: [slots, slices, R, in]; lora_b: [slots, out, R], the adapter's scale folded in;
    ranks: int32 [slots, slices]; slice_starts: [slices + 1] int32, slice i's columns of y are [starts[i], starts[i + 1]);
    max_slice_width: the widest slice's columns (host side: it sizes the grid)."""
    num_tokens, in_features = x.shape
    num_slots, num_slices, max_rank, _ = lora_a.shape
    assert lora_a.shape[3] == in_features and lora_b.shape == (num_slots, y.shape[1], max_rank)
    assert ranks.shape == (num_slots, num_slices) and slice_starts.numel() == num_slices + 1
    assert y.shape[0] == num_tokens == batch.num_tokens and x.stride(1) == 1 and y.stride(1) == 1
    assert lora_a.stride(3) == 1 and lora_b.stride(2) == 1 and ranks.is_contiguous()
    if num_tokens == 0:
        return y
    num_blocks = batch.block_group.numel()
    tiles = tiles or choose_tiles(num_blocks, num_slices, max_rank, in_features)
    precision = dot_precision(x.dtype)
    partials = torch.empty(tiles.split_k, num_slices, num_tokens, max_rank, dtype=torch.float32, device=x.device)
    _shrink_kernel[(triton.cdiv(max_rank, tiles.block_r) * tiles.split_k, num_blocks, num_slices)](
        x, lora_a, partials, batch.sorted_tokens, batch.block_group, ranks, num_tokens, in_features, num_slices,
        x.stride(0), *lora_a.stride()[:3], *partials.stride()[:3],
        BLOCK_M=batch.block_m, BLOCK_R=tiles.block_r, BLOCK_K=tiles.block_k, SPLIT_K=tiles.split_k,
        PRECISION=precision, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    _expand_kernel[(triton.cdiv(max_slice_width, tiles.block_n), num_blocks, num_slices)](
        partials, lora_b, y, batch.sorted_tokens, batch.block_group, ranks, slice_starts, num_tokens,
        num_slices, *partials.stride()[:3], *lora_b.stride()[:2],
        y.stride(0), BLOCK_M=batch.block_m, BLOCK_N=tiles.block_n, BLOCK_R=tiles.block_r, SPLIT_K=tiles.split_k,
        PRECISION=precision, num_warps=tiles.num_warps,
        num_stages=expand_stages(batch.block_m, tiles, lora_b.element_size()))
    return y

