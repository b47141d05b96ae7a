"""The experts of a mixture-of-experts layer as two grouped GEMM launches, whatever the number of experts.

Every token picks `top_k` experts; each (token, slot) pair is one row of work. The rule:

1. `align_by_expert`: the pairs are sorted by expert id (stable, so a pair's order within its expert is its
   order in the batch) and each expert's run of pairs is padded up to a multiple of `block_m`. Every block of
   `block_m` rows of that layout then belongs to exactly one expert, recorded per block (-1: a block past the
   last expert's run, for which the launch grid has room but there is no work). Padding rows carry the id
   `num_pairs`, which no pair has. All of it is device work with no host synchronisation (one launch of
   `_align_kernel` for decode-sized batches), so the layer can be captured in a CUDA graph, and the grids depend
   only on the number of tokens.
2. `_gate_up_kernel` (one launch for all experts): a program takes one block of rows and one tile of the
   intermediate dimension, reads its expert from the block, gathers its tokens' hidden states and multiplies
   them by that expert's gate and up rows, and writes silu(gate) * up in the sorted layout.
3. `_down_kernel` (one launch): the same blocks times the expert's down projection; the epilogue multiplies
   each row by its pair's router weight and writes it to the pair's own row ([tokens * top_k, hidden]).
4. The top_k rows of each token are summed in a fixed order (deterministic).

A decode step of one token therefore reads only the `top_k` experts it picked, in two launches; no launch is
ever made per expert. The per-expert loop it replaces, `moe_experts_torch`, is in core/layers/moe.py (the CPU
path, the kernels' reference and the benchmark's baseline: no Triton there).

float32 inputs multiply in IEEE float32 (tl.dot would otherwise round them to TF32); half types accumulate in
float32."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanovllm.kernels.precision import dot_precision


class MoeBlocks(NamedTuple):
    """The expert-sorted layout of a batch's (token, slot) pairs (see the module docstring)."""

    sorted_pairs: torch.Tensor  # [num_blocks * block_m] int32: pair id (token * top_k + slot), or num_pairs
    block_expert: torch.Tensor  # [num_blocks] int32: the expert of each block of rows, -1 for unused blocks
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks the padded layout can need: each expert with pairs rounds its run up by at most one block."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


ALIGN_KERNEL_MAX_PAIRS = 2048  # above this the torch ops' parallel sort beats the one-program kernel


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                    use_kernel: bool | None = None) -> MoeBlocks:
    """topk_ids: [tokens, top_k] expert ids. Sort the pairs by expert and pad each expert's run to `block_m`.

    `use_kernel` (default: on CUDA, for decode-sized batches of up to ALIGN_KERNEL_MAX_PAIRS pairs): one launch
    of `_align_kernel`; otherwise `align_by_expert_torch` (~20 small launches, a parallel sort). Both give the
    same layout."""
    num_pairs = topk_ids.numel()
    if use_kernel is None:
        use_kernel = topk_ids.is_cuda and num_pairs <= ALIGN_KERNEL_MAX_PAIRS
    if not use_kernel:
        return align_by_expert_torch(topk_ids, num_experts, block_m)
    topk_ids = topk_ids.contiguous()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=topk_ids.device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=topk_ids.device)
    _align_kernel[(1,)](topk_ids, sorted_pairs, block_expert, num_pairs, num_experts, num_blocks,
                        EXPERTS=triton.next_power_of_2(num_experts), BLOCK=64, BLOCK_M=block_m)
    return MoeBlocks(sorted_pairs, block_expert, block_m)


def align_by_expert_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoeBlocks:
    """`align_by_expert` as torch ops: a stable sort by expert, each pair's rank in its expert's run."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    blocks_of_expert = (counts + block_m - 1) // block_m
    block_end = blocks_of_expert.cumsum(0)
    first_row = (block_end - blocks_of_expert) * block_m  # where each expert's run starts in the padded layout
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank_in_expert = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, first_row[sorted_experts] + rank_in_expert, order.to(torch.int32))
    block_expert = torch.searchsorted(block_end, torch.arange(num_blocks, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return MoeBlocks(sorted_pairs, block_expert, block_m)


@triton.jit
def _align_kernel(topk_ids, sorted_pairs, block_expert, num_pairs, num_experts, num_blocks,
                  EXPERTS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_M: tl.constexpr):
    """One program: count the pairs of each expert (one-hot sums over chunks of BLOCK pairs), lay the experts'
    padded runs out in order, fill every row with the padding id, then give each pair the row of its expert's
    run at its rank among that expert's earlier pairs (a running count plus the chunk's one-hot cumsum)."""
    experts = tl.arange(0, EXPERTS)
    counts = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids + offs, mask=offs < num_pairs, other=EXPERTS)
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
    blocks_of = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks_of, axis=0)
    first_row = (block_end - blocks_of) * BLOCK_M
    real = experts < num_experts
    for start in range(0, num_blocks, BLOCK):
        blocks = start + tl.arange(0, BLOCK)
        ended = tl.sum(((block_end[None, :] <= blocks[:, None]) & real[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert + blocks, tl.where(ended < num_experts, ended, -1), mask=blocks < num_blocks)
    for start in range(0, num_blocks * BLOCK_M, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        tl.store(sorted_pairs + rows, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=rows < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding ids are written before any thread writes a pair's row
    seen = tl.zeros((EXPERTS,), dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ids = tl.load(topk_ids + offs, mask=offs < num_pairs, other=EXPERTS)
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)
        row_of = first_row[None, :] + seen[None, :] + tl.cumsum(onehot, axis=0) - 1
        row = tl.sum(onehot * row_of, axis=1)
        tl.store(sorted_pairs + row, offs, mask=offs < num_pairs)
        seen += tl.sum(onehot, axis=0)


class MoeTiles(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(num_pairs: int, num_experts: int) -> MoeTiles:
    """Row blocks about as tall as an expert's average share of the pairs (16 to 64): decode-sized batches
    waste little padding, prefill chunks get full tensor-core tiles. 64 columns: the gate/up kernel keeps two
    accumulators, so wider tiles would spill registers at 64 rows. Untuned: scripts/bench_moe.py --sweep."""
    per_expert = max(num_pairs // num_experts, 1)
    block_m = min(64, max(16, triton.next_power_of_2(per_expert)))
    if block_m <= 32:  # decode: stream the weights in long K steps
        return MoeTiles(block_m, 64, 128, num_warps=4)
    return MoeTiles(block_m, 64, 64, num_warps=8)


@triton.jit
def _gate_up_kernel(x, w13, act, sorted_pairs, block_expert, num_pairs, inter, hidden,
                    stride_xt, stride_we, stride_wn, stride_ar,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr):
    """act[row] = silu(x[token] @ gate_e^T) * (x[token] @ up_e^T) for the rows of one block (expert e); w13[e]
    holds gate rows [0, inter) then up rows [inter, 2 inter)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(block_expert + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs + rows)
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)
    x_tile = x + tokens[:, None] * stride_xt + offs_k[None, :]
    gate_tile = w13 + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    up_tile = gate_tile + inter * stride_wn
    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        k_ok = (k + offs_k) < hidden
        a = tl.load(x_tile + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        acc_gate = tl.dot(a, tl.trans(tl.load(gate_tile + k, mask=w_mask, other=0.0)), acc_gate,
                          input_precision=PRECISION)
        acc_up = tl.dot(a, tl.trans(tl.load(up_tile + k, mask=w_mask, other=0.0)), acc_up, input_precision=PRECISION)
    result = acc_gate * tl.sigmoid(acc_gate) * acc_up
    out = act + rows.to(tl.int64)[:, None] * stride_ar + offs_n[None, :]
    tl.store(out, result.to(act.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _down_kernel(act, w2, out, topk_weights, sorted_pairs, block_expert, num_pairs, hidden, inter,
                 stride_ar, stride_we, stride_wn, stride_or,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[pair] = weight[pair] * (act[row] @ down_e^T) for the rows of one block (expert e); padding rows are
    not written."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    expert = tl.load(block_expert + pid_m)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs + rows)
    row_ok = pairs < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_tile = act + rows.to(tl.int64)[:, None] * stride_ar + offs_k[None, :]
    w_tile = w2 + expert.to(tl.int64) * stride_we + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        k_ok = (k + offs_k) < inter
        a = tl.load(a_tile + k, mask=k_ok[None, :], other=0.0)
        w = tl.load(w_tile + k, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)
    weight = tl.load(topk_weights + pairs, mask=row_ok, other=0.0).to(tl.float32)
    result = acc * weight[:, None]
    dst = out + pairs.to(tl.int64)[:, None] * stride_or + offs_n[None, :]
    tl.store(dst, result.to(out.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, tiles: MoeTiles | None = None) -> torch.Tensor:
    """x: [T, H]; w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I]; topk_weights, topk_ids: [T, K].
    Returns sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), [T, H] in x's dtype."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, inter)
    assert x.stride(1) == 1 and w13.is_contiguous() and w2.is_contiguous()
    num_pairs = num_tokens * top_k
    tiles = tiles or choose_tiles(num_pairs, num_experts)
    blocks = align_by_expert(topk_ids, num_experts, tiles.block_m)
    num_blocks = blocks.block_expert.numel()
    precision = dot_precision(x.dtype)
    act = torch.empty(blocks.sorted_pairs.numel(), inter, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(triton.cdiv(inter, tiles.block_n), num_blocks)](
        x, w13, act, blocks.sorted_pairs, blocks.block_expert, num_pairs, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(triton.cdiv(hidden, tiles.block_n), num_blocks)](
        act, w2, per_pair, topk_weights.reshape(-1), blocks.sorted_pairs, blocks.block_expert, num_pairs, hidden,
        inter, act.stride(0), w2.stride(0), w2.stride(1), per_pair.stride(0),
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return per_pair.view(num_tokens, top_k, hidden).sum(dim=1)
