"""One Llama-family decoder driven by the HF config: Llama (incl. SmolLM2), Qwen2 (q/k/v bias), Qwen3 (q/k RMSNorm),
Mistral (sliding window). Other families with the same skeleton (Gemma 2/3, Phi-3) describe their differences in a
`DecoderSpec` and reuse these modules. The feed-forward block is pluggable (`LlamaForCausalLM.mlp_for_layer`): the
mixture-of-experts families (models/moe.py) are this decoder with a sparse block in some or all layers."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.activation import GeluTanhAndMul, SiluAndMul
from nanovllm.layers.attention import Attention
from nanovllm.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanovllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanovllm.layers.norm import RMSNorm
from nanovllm.layers.rotary import RotaryEmbedding, rope_parameters
from nanovllm.models.geometry import head_dim_of, layer_windows

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "mixtral")
# HF's hidden_act names -> the [gate | up] activation
ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluTanhAndMul}


@dataclass(frozen=True)
class DecoderSpec:
    """How a pre-norm decoder of the Llama skeleton differs from Llama, read from the HF config by its family."""

    layer_windows: tuple[int | None, ...]  # per layer: its sliding window, None for global attention
    layer_rope: tuple[dict, ...]  # per layer: rope parameters (see layers/rotary.py)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    unit_offset_norms: bool = False  # Gemma: RMSNorm scale 1 + w
    sandwich_norms: bool = False  # Gemma 2/3: attention and MLP outputs are normed again before the residual add
    hidden_act: str = "silu"
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None


def llama_spec(config) -> DecoderSpec:
    model_type = config.model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported by the Llama decoder "
                         f"({', '.join(SUPPORTED_MODEL_TYPES)} are)")
    attention_bias = getattr(config, "attention_bias", False)
    # Qwen2 always has q/k/v bias and never an o_proj bias; Qwen2-MoE says so in `qkv_bias`; Llama and Qwen3 use
    # `attention_bias` for both.
    qkv_bias = (model_type == "qwen2" or attention_bias
                or (model_type == "qwen2_moe" and getattr(config, "qkv_bias", True)))
    return DecoderSpec(
        layer_windows=layer_windows(config), layer_rope=(rope_parameters(config),) * config.num_hidden_layers,
        qkv_bias=qkv_bias, o_bias=model_type not in ("qwen2", "qwen2_moe") and attention_bias,
        mlp_bias=getattr(config, "mlp_bias", False), qk_norm=model_type in ("qwen3", "qwen3_moe"),
        hidden_act=config.hidden_act)


class LlamaAttention(nn.Module):
    def __init__(self, config, spec: DecoderSpec, layer: int, fused: bool):
        super().__init__()
        self.head_dim = head_dim_of(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=spec.qkv_bias, fused=fused)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        bias=spec.o_bias, fused=fused)
        self.qk_norm = spec.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=spec.unit_offset_norms)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, unit_offset=spec.unit_offset_norms)
        self.rotary = RotaryEmbedding(self.head_dim, config.max_position_embeddings, spec.layer_rope[layer])
        self.qk_norm_rope = None
        if fused and self.rotary.rotary_dim == self.head_dim:  # q/k norm and rotary of all heads in one kernel
            from nanovllm.kernels.fused_ops import qk_norm_rope

            self.qk_norm_rope = qk_norm_rope
        scale = spec.attn_scale if spec.attn_scale is not None else self.head_dim ** -0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, scale,
                              sliding_window=spec.layer_windows[layer], logit_softcap=spec.attn_logit_softcap)

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
    def __init__(self, config, spec: DecoderSpec, fused: bool, intermediate_size: int | None = None):
        """`intermediate_size`: default the config's (MoE models' dense layers and shared experts set theirs)."""
        super().__init__()
        bias = spec.mlp_bias
        inter = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(config.hidden_size, [inter] * 2, bias=bias, fused=fused)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, bias=bias, fused=fused)
        if spec.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {spec.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)} are)")
        self.act = SiluAndMul(fused) if spec.hidden_act == "silu" else ACTIVATIONS[spec.hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def fp8_input_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(module, the one linear its output feeds): loaders/fp8_weights.py `fuse_activation_quantization`."""
        return [(self.act, self.down_proj)]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, spec: DecoderSpec, layer: int, fused: bool, mlp: nn.Module | None = None):
        """`mlp`: the feed-forward block (default the dense `LlamaMLP`)."""
        super().__init__()
        self.self_attn = LlamaAttention(config, spec, layer, fused)
        self.mlp = mlp if mlp is not None else LlamaMLP(config, spec, fused)

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, fused, unit_offset=spec.unit_offset_norms)

        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = spec.sandwich_norms
        if self.sandwich:  # HF's names: post_attention_layernorm is then the norm of the attention output
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()

    def forward(self, positions, hidden, residual, meta):
        """Returns (the MLP's output, the residual stream before it): the next norm adds the two."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        if self.sandwich:
            hidden = self.post_attention_layernorm(hidden)
            hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
            return self.post_feedforward_layernorm(self.mlp(hidden)), residual
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual

    def fp8_input_pairs(self) -> list[tuple[nn.Module, nn.Module]]:
        """(module, the one linear its output feeds): loaders/fp8_weights.py `fuse_activation_quantization`. The norm
        before the MLP feeds only gate|up where the MLP is the dense one (an MoE block also routes on it)."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, LlamaMLP):
            pairs.append((self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm,
                          self.mlp.gate_up_proj))
        return pairs


class LlamaModel(nn.Module):
    def __init__(self, config, spec: DecoderSpec, fused: bool, mlp_for_layer: Callable[[int], nn.Module | None]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # The scale rounded to the model's dtype (the default dtype while it is built), as HF's Gemma rounds it.
        self.embed_scale = None if spec.embed_scale is None else float(
            torch.tensor(spec.embed_scale, dtype=torch.get_default_dtype()))
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, spec, i, fused, mlp_for_layer(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused, unit_offset=spec.unit_offset_norms)

    def forward(self, input_ids, positions, meta):
        hidden, residual = self.embed_tokens(input_ids), None
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
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

    @staticmethod
    def decoder_spec(config) -> DecoderSpec:
        return llama_spec(config)

    def __init__(self, config, fused_ops: bool = False):
        """`fused_ops`: RMSNorm, q/k norm + rotary, SiLU-and-mul and decode-sized projections as Triton kernels
        (CUDA only)."""
        super().__init__()
        spec = self.spec = self.decoder_spec(config)
        self.config = config
        self.fused_ops = fused_ops
        self.model = LlamaModel(config, spec, fused_ops, self.mlp_for_layer)
        self.init_head(config)

    def init_head(self, config) -> None:
        """The head on the final hidden states (`compute_logits`): the LM head, tied to the embeddings where the
        config says so. The pooling variants of a family (models/decoder_pooling.py) put theirs here instead."""
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.final_logit_softcap = self.spec.final_logit_softcap
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
        logits = self.lm_head(hidden)
        if logits is not None and self.final_logit_softcap is not None:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]
