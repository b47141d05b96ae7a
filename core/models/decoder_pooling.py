"""The decoder families as pooling models: the same decoder (models/llama.py, gemma.py, phi3.py, moe.py) with the
LM head replaced.

- Embedder (Qwen3-Embedding, gte-Qwen2, e5-mistral style): no head; the final hidden states are the output, pooled
  by the task's method (the last token unless the checkpoint's sentence-transformers config says otherwise).
- Sequence classifier (HF's `*ForSequenceClassification`: classifiers, reward models, decoder cross-encoders): the
  `score` linear (no bias) on the last token's final hidden state.

Every pooling model answers `compute_logits(pooled hidden states)` with its output per pooled row (the vector of an
embedder, the label logits of a classifier) and names its `default_pooling`. Checkpoints store the decoder under
`model.` (task models) or at the top (`*Model` architectures): the loader maps either through `base_model_prefix`."""
from __future__ import annotations

import functools

import torch

from nanovllm.layers.linear import ReplicatedLinear
from nanovllm.models.llama import LlamaForCausalLM


class _DecoderEmbedder:
    default_pooling = "last"
    base_model_prefix = "model"
    ignored_checkpoint_prefixes = ("lm_head.",)  # an embedder saved as a causal LM keeps its unused LM head

    def init_head(self, config) -> None:
        """No head: the final hidden states are the embedding."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden


class _DecoderSequenceClassifier:
    default_pooling = "last"  # HF scores the last token
    base_model_prefix = "model"

    def init_head(self, config) -> None:
        self.score = ReplicatedLinear(config.hidden_size, config.num_labels)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.score(hidden)


_HEADS = {"embed": (_DecoderEmbedder, "ForEmbedding"), "classify": (_DecoderSequenceClassifier,
                                                                    "ForSequenceClassification")}


@functools.cache
def decoder_pooling_class(family: type[LlamaForCausalLM], head: str) -> type[LlamaForCausalLM]:
    """The pooling model of a decoder family (its causal-LM class): `head` "embed" or "classify"."""
    mixin, suffix = _HEADS[head]
    name = family.__name__.removesuffix("ForCausalLM") + suffix
    return type(name, (mixin, family), {"__module__": __name__, "__doc__": f"{family.__name__}'s decoder, {head}."})
