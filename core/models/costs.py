"""What a model's weights cost a step: the bytes a decode step reads and a token's matmul FLOPs (this rank's
shard under tensor parallelism), for the roofline of `nanovllm bench`.

Dense: every decode step reads all the weights. Mixture of experts: a step reads the weights every token uses
(attention, norms, routers, dense MLPs, shared experts, the LM head) plus, in each MoE layer, the distinct experts
its tokens select. Under uniform routing, B tokens that each pick k of E experts select on average
E (1 - (1 - k/E)^B) distinct ones. A token's matmul FLOPs are 2 x its active parameters: the shared matrices and
k experts per MoE layer. Embedding tables (words; an encoder's positions and token types) are only gathered from
(not read whole, no matmul) unless tied to the LM head. A pooling model has no LM head; its classifier head, if any,
is a matrix like the others (applied to pooled rows only, which the per-token count overstates by its size)."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from nanovllm.layers.embedding import VocabParallelEmbedding
from nanovllm.layers.moe import SparseMoeBlock


def expected_distinct_experts(num_experts: int, top_k: int, num_tokens: int) -> float:
    return num_experts * (1 - (1 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class ExpertLayer:
    num_experts: int
    top_k: int
    expert_bytes: int  # one expert's weights (this rank's shard)
    expert_params: int


@dataclass(frozen=True)
class WeightCosts:
    shared_bytes: int  # read by every decode step
    shared_matmul_params: int  # used by every token
    expert_layers: tuple[ExpertLayer, ...]  # empty for dense models

    @property
    def all_bytes(self) -> int:
        return self.shared_bytes + sum(layer.num_experts * layer.expert_bytes for layer in self.expert_layers)

    def decode_step_bytes(self, batch: int) -> float:
        """Weight bytes a decode step of `batch` sequences reads."""
        return self.shared_bytes + sum(expected_distinct_experts(layer.num_experts, layer.top_k, batch)
                                       * layer.expert_bytes for layer in self.expert_layers)

    def flops_per_token(self) -> int:
        return 2 * (self.shared_matmul_params + sum(layer.top_k * layer.expert_params for layer in self.expert_layers))


def weight_costs(model: nn.Module) -> WeightCosts:
    """The costs of a built model (embedding tables, `model.lm_head` where it has one, MoE blocks anywhere)."""
    head = getattr(model, "lm_head", None)
    tables = {id(m.weight): m.weight for m in model.modules()
              if isinstance(m, (nn.Embedding, VocabParallelEmbedding)) and m is not head
              and (head is None or m.weight is not head.weight)}
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    expert_params = {id(p) for block in blocks for p in block.experts.parameters()}
    shared = [p for p in model.parameters() if id(p) not in expert_params]  # tied weights counted once
    shared_bytes = sum(p.numel() * p.element_size() for p in shared if id(p) not in tables)
    shared_matmul = sum(p.numel() for p in shared if p.dim() == 2 and id(p) not in tables)
    layers = []
    for block in blocks:
        experts = block.experts
        params = sum(p.numel() for p in experts.parameters()) // experts.num_experts
        layers.append(ExpertLayer(experts.num_experts, block.top_k, params * experts.gate_up_proj.element_size(),
                                  params))
    return WeightCosts(shared_bytes, shared_matmul, tuple(layers))
