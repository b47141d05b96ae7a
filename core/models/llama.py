"""One Llama-family decoder driven by the HF config: Llama (incl. SmolLM2), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm).

Its feed-forward block is pluggable (`LlamaForCausalLM.mlp_for_layer`): the mixture-of-experts families
(models/moe.py) are this decoder with a different block in some or all layers."""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.distributed import tp_size
from nanovllm.layers.activation import SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding, rope_parameters


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config, fused: bool):
        super().__init__()
        model_type = config.model_type
        self.head_dim = head_dim_of(config)
        # Qwen2 always has q/k/v bias and never an o_proj bias; Qwen2-MoE says so in `qkv_bias`; Llama and Qwen3
        # use `attention_bias` for both.
        qkv_bias = (model_type == "qwen2" or getattr(config, "attention_bias", False)
                    or (model_type == "qwen2_moe" and getattr(config, "qkv_bias", True)))
        o_bias = model_type not in ("qwen2", "qwen2_moe") and getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=qkv_bias, fused=fused)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
                                        fused=fused)
        self.qk_norm = model_type in ("qwen3", "qwen3_moe")
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, rope_parameters(config))
        self.qk_norm_rope = None
        if fused:  # q/k norm and rotary of all heads in one kernel
            from nanovllm.kernels.fused_ops import qk_norm_rope

            self.qk_norm_rope = qk_norm_rope
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm_rope is not None:
            q_weight, k_weight = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            self.qk_norm_rope(q, k, positions, self.rotary.cos_sin, q_weight, k_weight,
                              self.q_norm.eps if self.qk_norm else 0.0)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config, fused: bool, intermediate_size: int | None = None):
        """`intermediate_size`: default the config's (MoE models' dense layers and shared experts set theirs)."""
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias=bias, fused=fused)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, fused=fused)
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported (silu is)")
        self.act = SiluAndMul(fused)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, fused: bool, mlp: nn.Module | None = None):
        """`mlp`: the feed-forward block (default the dense `LlamaMLP`)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, fused)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, fused)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(self, positions, hidden, residual, meta):
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config, fused: bool, mlp_for_layer: Callable[[int], nn.Module | None] = lambda index: None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, fused, mlp_for_layer(index))
                                    for index in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused)

    def forward(self, input_ids, positions, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (packed parameter fragment, part id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config, fused_ops: bool = False):
        """`fused_ops`: RMSNorm, q/k norm + rotary, SiLU-and-mul and decode-sized projections as Triton kernels
        (CUDA only)."""
        super().__init__()
        self.config = config
        self.fused_ops = fused_ops
        self.model = LlamaModel(config, fused_ops, self.mlp_for_layer)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def mlp_for_layer(self, index: int) -> nn.Module | None:
        """The feed-forward block of layer `index`; None: the dense `LlamaMLP`."""
        return None

    @classmethod
    def tensor_parallel_dims(cls, config) -> dict[str, int]:
        """The config sizes that tensor parallelism splits evenly across ranks."""
        return {"num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": config.num_key_value_heads,
                "intermediate_size": config.intermediate_size}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


def kv_heads_per_rank(config) -> int:
    return config.num_key_value_heads // tp_size()


def kv_block_bytes(config, block_size: int, itemsize: int, num_kv_heads: int) -> int:
    """Bytes of one KV-cache block over all layers (K and V) holding `num_kv_heads` heads."""
    return 2 * config.num_hidden_layers * block_size * num_kv_heads * head_dim_of(config) * itemsize
