"""What a pooling task returns for a pooled row: an embedding (Matryoshka truncation, then L2 normalization), or a
classifier's probabilities (softmax or sigmoid of its logits) with the checkpoint's labels.

The rules are vLLM's: `dimensions` is accepted only from a model that declares Matryoshka training
(`is_matryoshka` or `matryoshka_dimensions` in its config; the latter also lists the sizes allowed), and the
vector is truncated before it is normalized, as sentence-transformers' `truncate_dim` does. A classifier's
activation is a sigmoid for one label or a multi-label problem, else a softmax over the labels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("softmax", "sigmoid", "none")


def check_dimensions(dimensions: int | None, hf_config, embedding_size: int) -> None:
    """Raise ValueError where `dimensions` cannot apply to this model's embeddings, saying why."""
    if dimensions is None:
        return
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise ValueError(f"dimensions={dimensions!r} must be a positive integer")
    allowed = getattr(hf_config, "matryoshka_dimensions", None)
    if not allowed and not getattr(hf_config, "is_matryoshka", False):
        raise ValueError(f"dimensions={dimensions}: the model does not declare Matryoshka training (is_matryoshka or "
                         "matryoshka_dimensions in its config.json), and truncating its embeddings would make them "
                         "poor; leave dimensions unset")
    if allowed and dimensions not in allowed:
        raise ValueError(f"dimensions={dimensions}: the model allows only {sorted(allowed)} (matryoshka_dimensions)")
    if dimensions > embedding_size:
        raise ValueError(f"dimensions={dimensions} exceeds the model's embedding size {embedding_size}")


def embedding_output(pooled: torch.Tensor, normalize: bool, dimensions: int | None = None) -> torch.Tensor:
    """The embeddings of pooled rows [rows, hidden]: the first `dimensions` features (None: all), then L2-normalized
    where `normalize`; in fp32."""
    vectors = pooled.float()
    if dimensions is not None:
        vectors = vectors[:, :dimensions]
    return F.normalize(vectors, p=2, dim=-1) if normalize else vectors


def classifier_activation(hf_config) -> str:
    """A classifier's activation from its config: sigmoid for one label or `problem_type` multi-label (labels are
    independent), else softmax."""
    if getattr(hf_config, "problem_type", None) == "multi_label_classification" or hf_config.num_labels == 1:
        return "sigmoid"
    return "softmax"


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """[rows, labels] logits -> probabilities (fp32) under `activation` ("none": the logits as they are)."""
    logits = logits.float()
    if activation == "softmax":
        return logits.softmax(-1)
    if activation == "sigmoid":
        return logits.sigmoid()
    if activation == "none":
        return logits
    raise ValueError(f"activation {activation!r}: expected one of {', '.join(ACTIVATIONS)}")


def labels_of(hf_config) -> tuple[str, ...]:
    """The class names in label-id order, from the config's `id2label` (transformers fills LABEL_<i> where the
    checkpoint names none)."""
    id2label = {int(k): v for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    return tuple(id2label.get(i, f"LABEL_{i}") for i in range(hf_config.num_labels))
