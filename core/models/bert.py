"""BERT and XLM-RoBERTa encoders: the embedders most embedding checkpoints use (bge, e5, gte-base style; pooled by
CLS or mean as their sentence-transformers config says) and their `*ForSequenceClassification` cross-encoders
(ms-marco, bge-reranker style).

Post-LN layers (LayerNorm after each residual add), GELU feed-forward, absolute position embeddings and token-type
embeddings added to the word embeddings. XLM-RoBERTa counts positions from `pad_token_id + 1` (a pad token in a
sequence keeps position `pad_token_id` and is not counted), as HF does. Attention is bidirectional, over whole
sequences without a KV cache (attention/bidirectional.py): a sequence is never split over steps and the model has
no paged attention layers. Module and parameter names are HF's, q/k/v packed into one projection for tensor
parallelism."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanovllm.attention.bidirectional import bidirectional_attention
from nanovllm.attention.metadata import AttentionMetadata
from nanovllm.layers.embedding import VocabParallelEmbedding
from nanovllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear

# HF's hidden_act names -> the activation (exact GELU, or its tanh approximation)
ACTIVATIONS = {"gelu": dict(approximate="none"), "gelu_new": dict(approximate="tanh"),
               "gelu_pytorch_tanh": dict(approximate="tanh")}


def check_encoder_config(config) -> None:
    """Reject by name what these encoders do not implement."""
    if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"{config.model_type} with is_decoder / add_cross_attention is not supported: only the "
                         "bidirectional encoder is")
    kind = getattr(config, "position_embedding_type", "absolute")
    if kind != "absolute":
        raise ValueError(f"position_embedding_type {kind!r} is not supported (absolute is)")
    if config.hidden_act not in ACTIVATIONS:
        raise ValueError(f"hidden_act {config.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)} are)")


def roberta_positions(input_ids: torch.Tensor, positions: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """XLM-RoBERTa's position ids on a flat batch (`positions`: each token's index in its sequence): padding_idx +
    the count of non-pad tokens from the sequence's start to the token, padding_idx for a pad token."""
    not_pad = (input_ids != padding_idx).long()
    counts = F.pad(not_pad.cumsum(0), (1, 0))
    index = torch.arange(len(input_ids), device=input_ids.device)
    return (counts[index + 1] - counts[index - positions]) * not_pad + padding_idx


class BertEmbeddings(nn.Module):
    def __init__(self, config, positions_after_padding_idx: bool):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.padding_idx = config.pad_token_id if positions_after_padding_idx else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        if self.padding_idx is not None:
            positions = roberta_positions(input_ids, positions, self.padding_idx)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        hidden = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(hidden + self.position_embeddings(positions))


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, config.num_attention_heads,
                                          config.num_attention_heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads
        self.scale = self.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).view(-1, 3 * self.num_heads, self.head_dim).chunk(3, dim=1)
        out = bidirectional_attention(q, k, v, meta.query_start_loc, meta.max_query_len, self.scale)
        return out.reshape(out.shape[0], -1)


class BertResidualOutput(nn.Module):
    """dense, then LayerNorm of (its output + the sublayer's input): HF's BertSelfOutput and BertOutput."""

    def __init__(self, config, input_size: int):
        super().__init__()
        self.dense = RowParallelLinear(input_size, config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(hidden) + residual)


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(config, config.hidden_size)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.output(self.self(hidden, meta), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.gelu = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(hidden), **self.gelu)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.attention(hidden, meta)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, meta)
        return hidden


class BertPooler(nn.Module):
    """tanh(dense(x)) of the CLS token's hidden state: the input of BERT's classifier."""

    def __init__(self, config):
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden))


class _Encoder(nn.Module):
    """What the encoder models share: HF's checkpoint names with q/k/v packed, the tensor-parallel split, no paged
    attention layers (so no KV cache), and `forward` on a flat batch of whole sequences."""

    packed_modules_mapping = {"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}
    default_pooling = "cls"
    bidirectional = True  # a row is computed whole in one step, and nothing of it is kept (no KV cache)
    positions_after_padding_idx = False  # XLM-RoBERTa's rule (roberta_positions)

    @classmethod
    def max_input_len(cls, config) -> int:
        """The longest input: XLM-RoBERTa's positions start after its pad id."""
        offset = config.pad_token_id + 1 if cls.positions_after_padding_idx else 0
        return config.max_position_embeddings - offset

    @staticmethod
    def takes_token_types(config) -> bool:
        """Pair inputs carry token types where the model has more than one (BERT; XLM-RoBERTa has one)."""
        return config.type_vocab_size > 1

    @classmethod
    def tensor_parallel_dims(cls, config) -> dict[str, int]:
        return {"num_attention_heads": config.num_attention_heads, "intermediate_size": config.intermediate_size}

    def attention_layers(self) -> list:
        return []


class BertModel(_Encoder):
    """The encoder alone (HF's BertModel names at the top): an embedder, its output the final hidden states. The
    checkpoint's pooler (used only by classifiers) is not loaded."""

    base_model_prefix = "bert"
    ignored_checkpoint_prefixes = ("pooler.",)

    def __init__(self, config, fused_ops: bool = False, with_pooler: bool = False):
        """`fused_ops`: accepted for a uniform constructor; the encoder has no fused kernels. `with_pooler`: the
        pooler a classifier's head uses (BertForSequenceClassification)."""
        super().__init__()
        check_encoder_config(config)
        self.config = config
        self.embeddings = BertEmbeddings(config, self.positions_after_padding_idx)
        self.encoder = BertEncoder(config)
        if with_pooler:
            self.pooler = BertPooler(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions (index in the sequence), token_type_ids (None: all 0): [tokens] of whole
        sequences laid out by `meta.query_start_loc` -> final hidden states [tokens, hidden]."""
        return self.encoder(self.embeddings(input_ids, positions, token_type_ids), meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class XLMRobertaModel(BertModel):
    base_model_prefix = "roberta"
    positions_after_padding_idx = True


class BertForSequenceClassification(_Encoder):
    """BERT with HF's classification head on the CLS token: classifier(pooler(h))."""

    base_model_prefix = "bert"

    def __init__(self, config, fused_ops: bool = False):
        super().__init__()
        self.config = config
        self.bert = BertModel(config, with_pooler=True)
        self.classifier = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, meta, token_type_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.bert.pooler(hidden))


class XLMRobertaClassificationHead(nn.Module):
    """out_proj(tanh(dense(h))) of the <s> token: HF's XLMRobertaClassificationHead."""

    def __init__(self, config):
        super().__init__()
        self.dense = ReplicatedLinear(config.hidden_size, config.hidden_size, bias=True)
        self.out_proj = ReplicatedLinear(config.hidden_size, config.num_labels, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(hidden)))


class XLMRobertaForSequenceClassification(_Encoder):
    base_model_prefix = "roberta"
    positions_after_padding_idx = True

    def __init__(self, config, fused_ops: bool = False):
        super().__init__()
        self.config = config
        self.roberta = XLMRobertaModel(config)
        self.classifier = XLMRobertaClassificationHead(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.roberta(input_ids, positions, meta, token_type_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.classifier(hidden)
