"""What a sentence-transformers checkpoint says about its pooling: `modules.json` (the module pipeline),
the Pooling module's `config.json` (its mode), `config_sentence_transformers.json` (bi-encoder or cross-encoder,
the cross-encoder's activation, the similarity function) and `sentence_bert_config.json` (input length, lower-casing;
sentence-transformers v5 on keeps them in the tokenizer: its model_max_length, and a lower-casing normalizer).

Supported pipelines: a Transformer at the checkpoint's root, then for a bi-encoder one Pooling module (cls, mean or
lasttoken) and optionally Normalize. Any other module or pooling mode is rejected by name."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from nanovllm.pooling.methods import PoolingMethod

# sentence-transformers' pooling mode names -> ours; the legacy configs' boolean keys -> the mode
POOLING_MODES = {"cls": PoolingMethod.CLS, "mean": PoolingMethod.MEAN, "lasttoken": PoolingMethod.LAST}
_LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                        "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                        "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# A cross-encoder's activation_fn (a torch module's import path) -> ours (pooling/outputs.py)
CROSS_ENCODER_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                             "torch.nn.modules.linear.Identity": "none"}
SIMILARITY_FUNCTIONS = ("cosine", "dot")
_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class SentenceTransformersConfig:
    cross_encoder: bool
    pooling: PoolingMethod | None = None  # a bi-encoder's Pooling module
    normalize: bool = False  # a Normalize module follows the pooling
    activation: str | None = None  # a cross-encoder's activation_fn, where it names one
    similarity: str = "cosine"  # how two embeddings score (LLM.score of a bi-encoder)
    max_seq_length: int | None = None  # inputs are truncated to this many tokens (its config's, or the tokenizer's)
    lowercase: bool = False  # inputs are lower-cased before tokenization


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"sentence-transformers config {path} cannot be read: {e}") from e


def _pooling_mode(config: dict, path: Path) -> PoolingMethod:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = [m for key, m in _LEGACY_POOLING_KEYS.items() if config.get(key)]
        mode = modes if len(modes) != 1 else modes[0]
        mode = mode or "mean"  # sentence-transformers' default
    if isinstance(mode, list) and len(mode) == 1:
        mode = mode[0]
    if not isinstance(mode, str) or mode not in POOLING_MODES:
        raise ValueError(f"pooling mode {mode!r} in {path} is not supported ({', '.join(POOLING_MODES)} are)")
    if not config.get("include_prompt", True):
        raise ValueError(f"include_prompt false in {path} (prompt tokens left out of the pooling) is not supported")
    return POOLING_MODES[mode]


def _module_kind(entry: dict, directory: Path) -> str:
    kind = str(entry.get("type", "")).rsplit(".", 1)[-1]
    if kind not in _MODULES:
        raise ValueError(f"sentence-transformers module {entry.get('type')!r} ({directory / 'modules.json'}) is not "
                         f"supported: only {', '.join(_MODULES)} are")
    return kind


def read_sentence_transformers_config(directory: Path | None, hf_config) -> SentenceTransformersConfig | None:
    """The checkpoint's sentence-transformers settings, None where it has none (no modules.json, and no
    cross-encoder activation in config.json)."""
    legacy_activation = (getattr(hf_config, "sentence_transformers", None) or {}).get("activation_fn") \
        or getattr(hf_config, "sbert_ce_default_activation_function", None)
    modules_file = directory / "modules.json" if directory is not None else None
    if modules_file is None or not modules_file.exists():
        if legacy_activation is None:
            return None
        return SentenceTransformersConfig(cross_encoder=True, activation=_activation(legacy_activation))
    settings = _read_json(directory / "config_sentence_transformers.json") \
        if (directory / "config_sentence_transformers.json").exists() else {}
    cross_encoder = settings.get("model_type") == "CrossEncoder" or legacy_activation is not None
    pooling, normalize = None, False
    for entry in _read_json(modules_file):
        kind = _module_kind(entry, directory)
        path = directory / entry.get("path", "")
        if kind == "Transformer" and entry.get("path", "") != "":
            raise ValueError(f"the Transformer module of {directory} is in {entry['path']!r}: nanovllm loads it from "
                             "the checkpoint's root (move its files there)")
        if kind == "Pooling":
            pooling = _pooling_mode(_read_json(path / "config.json"), path / "config.json")
        normalize |= kind == "Normalize"
    if not cross_encoder and pooling is None:
        raise ValueError(f"{modules_file} has no Pooling module: nanovllm pools a bi-encoder's tokens there")
    similarity = settings.get("similarity_fn_name") or "cosine"
    if similarity not in SIMILARITY_FUNCTIONS:
        raise ValueError(f"similarity_fn_name {similarity!r} in {directory / 'config_sentence_transformers.json'} "
                         f"is not supported ({', '.join(SIMILARITY_FUNCTIONS)} are)")
    bert_config = directory / "sentence_bert_config.json"
    inputs = _read_json(bert_config) if bert_config.exists() else {}
    max_seq_length = inputs.get("max_seq_length") or _tokenizer_max_length(directory)
    activation = settings.get("activation_fn") or legacy_activation
    return SentenceTransformersConfig(
        cross_encoder=cross_encoder, pooling=pooling, normalize=normalize,
        activation=_activation(activation) if activation else None, similarity=similarity,
        max_seq_length=max_seq_length, lowercase=bool(inputs.get("do_lower_case", False)))


def _tokenizer_max_length(directory: Path) -> int | None:
    """The tokenizer's model_max_length: where sentence-transformers (v5 on) keeps max_seq_length, and what it cuts
    inputs to when its own config names none (transformers writes a huge number for no limit)."""
    path = directory / "tokenizer_config.json"
    length = _read_json(path).get("model_max_length") if path.exists() else None
    return length if isinstance(length, int) and 0 < length < 1 << 31 else None


def _activation(name: str) -> str:
    if name not in CROSS_ENCODER_ACTIVATIONS:
        raise ValueError(f"cross-encoder activation_fn {name!r} is not supported "
                         f"({', '.join(CROSS_ENCODER_ACTIVATIONS)} are)")
    return CROSS_ENCODER_ACTIVATIONS[name]
