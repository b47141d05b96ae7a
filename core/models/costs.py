"""What a model's weights cost a step: the bytes a decode step reads and a token's matmul FLOPs (this rank's
shard under tensor parallelism), for the roofline of `nanovllm bench`.

Dense: every decode step reads all the weights. Mixture of experts: a step reads the weights every token uses
(attention, norms, routers, dense MLPs, shared experts, the LM head) plus, in each MoE layer, the distinct experts
its tokens select. Under uniform routing, B tokens that each pick k of E experts select on average
E (1 - (1 - k/E)^B) distinct ones. A token's matmul FLOPs are 2 x its active parameters: the shared matrices and
k experts per MoE layer. The input embedding table is only gathered from (not read whole, no matmul) unless it
is tied to the LM head."""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

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
    """The costs of a built model (`model.model.embed_tokens`, `model.lm_head`, MoE blocks anywhere)."""
    embedding = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embedding
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    expert_params = {id(p) for block in blocks for p in block.experts.parameters()}
    shared = [p for p in model.parameters() if id(p) not in expert_params]  # tied weights counted once
    untied_embedding = 0 if tied else 1
    shared_bytes = sum(p.numel() * p.element_size() for p in shared) - untied_embedding * embedding.numel() * \
        embedding.element_size()
    shared_matmul = sum(p.numel() for p in shared if p.dim() == 2) - untied_embedding * embedding.numel()
    layers = []
    for block in blocks:
        experts = block.experts
        params = sum(p.numel() for p in experts.parameters()) // experts.num_experts
        layers.append(ExpertLayer(experts.num_experts, block.top_k, params * experts.gate_up_proj.element_size(),
                                  params))
    return WeightCosts(shared_bytes, shared_matmul, tuple(layers))
