"""Mixture-of-experts families: the Llama-family decoder (models/llama.py) with a sparse MoE block as the
feed-forward of its sparse layers.

- Qwen3-MoE: q/k RMSNorm attention; top-k renormalised when `norm_topk_prob`; layers listed in `mlp_only_layers`
  or off the `decoder_sparse_step` cadence keep a dense MLP of `intermediate_size`.
- Qwen2-MoE: q/k/v bias; the same layer rule; every MoE block also has a shared expert whose output is scaled by
  sigmoid(shared_expert_gate(x)).
- Mixtral: every layer sparse, top-k always renormalised, checkpoint names under `block_sparse_moe` and experts
  `w1` (gate), `w3` (up), `w2` (down)."""
from __future__ import annotations

from torch import nn

from nanovllm.layers.moe import SparseMoeBlock
from nanovllm.models.llama import LlamaForCausalLM, LlamaMLP


def _check_silu(config) -> None:
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu is)")


class _MoeForCausalLM(LlamaForCausalLM):
    """What the MoE families share: the checkpoint's per-expert tensors stack into `experts.gate_up_proj` and
    `experts.down_proj` (core/loaders/weights.py reads `expert_projections`: checkpoint projection name -> part)."""

    expert_projections = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}

    def __init__(self, config, fused_ops: bool = False):
        _check_silu(config)
        super().__init__(config, fused_ops)

    def is_sparse_layer(self, index: int) -> bool:
        config = self.config
        step = getattr(config, "decoder_sparse_step", 1) or 1
        return index not in (getattr(config, "mlp_only_layers", None) or []) and (index + 1) % step == 0


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    def mlp_for_layer(self, index: int) -> nn.Module | None:
        config = self.config
        if not self.is_sparse_layer(index):
            return None
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                              fused=self.fused_ops)

    @classmethod
    def tensor_parallel_dims(cls, config) -> dict[str, int]:
        return {**super().tensor_parallel_dims(config), "moe_intermediate_size": config.moe_intermediate_size}


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    def mlp_for_layer(self, index: int) -> nn.Module | None:
        config = self.config
        if not self.is_sparse_layer(index):
            return None
        shared = LlamaMLP(config, self.spec, self.fused_ops, config.shared_expert_intermediate_size)
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                              fused=self.fused_ops, shared_expert=shared)

    @classmethod
    def tensor_parallel_dims(cls, config) -> dict[str, int]:
        return {**super().tensor_parallel_dims(config),
                "shared_expert_intermediate_size": config.shared_expert_intermediate_size}


class MixtralForCausalLM(_MoeForCausalLM):
    expert_projections = {"w1": "gate", "w3": "up", "w2": "down"}
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def mlp_for_layer(self, index: int) -> nn.Module | None:
        config = self.config
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True, fused=self.fused_ops)
