"""Mixture-of-experts feed-forward block: a router, top-k experts stored as stacked tensors, an optional shared
expert (Qwen2-MoE).

Tensor parallelism shards every expert's intermediate dimension across the ranks (each rank holds all experts,
a slice of each: gate/up rows and down columns), like the dense MLP; the ranks' partial sums meet in one
all-reduce after the shared expert is added. Expert parallelism (whole experts per rank) is not implemented."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.distributed import all_reduce, tp_rank, tp_size
from nanovllm.layers.linear import ReplicatedLinear, _divide


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts (float32), the top_k of it; `renormalize`: the top_k weights rescaled to sum to 1
    (Mixtral always, Qwen-MoE when `norm_topk_prob`). Returns (weights [T, k] float32, expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]) with one matmul pair per expert that has tokens
    (a loop in Python, one host synchronisation to learn the experts' counts): the CPU path, the reference of
    kernels/fused_moe.py and its benchmark's baseline. w13: [E, 2I, H] (gate rows, then up rows); w2: [E, H, I].
    Accumulates in float32."""
    num_tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).float()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        gate_up = F.linear(x[tokens], w13[expert])
        hidden = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        out.index_add_(0, tokens, F.linear(hidden, w2[expert]).float() * weights[pairs, None])
    return out.to(x.dtype)


class StackedExperts(nn.Module):
    """`num_experts` SwiGLU experts: gate_up_proj [E, 2 I, H] (this rank's gate rows, then its up rows) and
    down_proj [E, H, I] (this rank's columns), I = intermediate_size / tensor_parallel_size.

    On CUDA always the grouped Triton GEMMs of kernels/fused_moe.py: the per-expert loop would wait on the host
    and cannot be captured in a CUDA graph. On the CPU the loop, unless `fused` (tests run the kernels in
    Triton's interpreter). Returns this rank's partial sum (not reduced)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, fused: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.local_inter = _divide(intermediate_size, tp_size(), "moe intermediate size")
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * self.local_inter, hidden_size),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, self.local_inter), requires_grad=False)
        self.gate_up_proj.full_shape = (num_experts, 2 * intermediate_size, hidden_size)
        self.down_proj.full_shape = (num_experts, hidden_size, intermediate_size)
        for param, parts in ((self.gate_up_proj, ("gate", "up")), (self.down_proj, ("down",))):
            param.expert_parts = num_experts * len(parts)  # checkpoint tensors that fill it, one per expert and part
        self.fused = fused

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, part: tuple[int, str] | None = None) -> None:
        """`part` None: the whole stacked tensor (full_shape); else (expert, "gate" | "up" | "down"): one expert's
        checkpoint matrix ([I, H] for gate and up, [H, I] for down). Copies this rank's slice."""
        size, start = self.local_inter, tp_rank() * self.local_inter
        if part is None:
            if param is self.down_proj:
                param.data.copy_(loaded[:, :, start:start + size])
            else:
                full_inter = loaded.shape[1] // 2
                param.data[:, :size].copy_(loaded[:, start:start + size])
                param.data[:, size:].copy_(loaded[:, full_inter + start:full_inter + start + size])
            return
        expert, kind = part
        if kind == "down":
            param.data[expert].copy_(loaded[:, start:start + size])
        else:
            offset = 0 if kind == "gate" else size
            param.data[expert, offset:offset + size].copy_(loaded[start:start + size])

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.fused or x.is_cuda:
            from nanovllm.kernels.fused_moe import fused_moe  # imported only when used: the CPU path needs no Triton

            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)
        return moe_experts_torch(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """router -> top-k experts (+ sigmoid-gated shared expert) -> one all-reduce under tensor parallelism.

    Parameter names follow the HF checkpoints: `gate` (the router, [E, H]), `experts`, `shared_expert`,
    `shared_expert_gate`."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int, renormalize: bool,
                 fused: bool = False, shared_expert: nn.Module | None = None):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, fused)
        self.shared_expert = shared_expert  # a dense MLP (gate_up_proj, down_proj)
        if shared_expert is not None:
            shared_expert.down_proj.reduce = False  # its partial sum joins the experts' in the block's one reduce
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        self.reduce = tp_size() > 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return all_reduce(out) if self.reduce else out
