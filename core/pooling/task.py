"""Which task a checkpoint runs, decided in one place from the checkpoint and the caller's `runner` / `task`.

- `*ForSequenceClassification` -> a classifier model: `classify` (softmax over its labels; sigmoid for one label or
  a multi-label problem), `reward` (the raw score of a one-label head, as reward models are read) and, with one
  label, `score` (a cross-encoder: the sigmoid, or the activation its sentence-transformers config names, of the
  pair's logit). Its default task: `score` for a cross-encoder (a sentence-transformers CrossEncoder config, or a
  one-label BERT / XLM-RoBERTa head), `reward` for another one-label head, else `classify`.
- a bare base model (`*Model`: BertModel, XLMRobertaModel, Qwen3Model, ...) -> an embedder: `embed` and `score`
  (the similarity of the two texts' embeddings).
- a causal LM -> generation, unless its checkpoint is a sentence-transformers bi-encoder (Qwen3-Embedding), or
  the caller asks for `runner="pooling"` or an embedding task: then its decoder alone embeds.

An embedder pools by its sentence-transformers Pooling module where it has one (and normalizes where a Normalize
module follows), else by the model's own rule (the last token for decoders, CLS for encoders) and normalizes."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanovllm.config import RUNNERS
from nanovllm.models.registry import MODEL_CLASSES, POOLING_MODEL_CLASSES, architectures_of, model_class_for
from nanovllm.pooling.methods import PoolingMethod
from nanovllm.pooling.outputs import classifier_activation, labels_of
from nanovllm.pooling.st_config import read_sentence_transformers_config
from nanovllm.pooling_params import POOLING_TASKS as TASKS

ENCODER_CLASSIFIERS = ("BertForSequenceClassification", "XLMRobertaForSequenceClassification")


@dataclass(frozen=True)
class PoolingSpec:
    """How a checkpoint runs as a pooling model."""

    task: str  # the task it runs unless the caller names another of `tasks`
    tasks: tuple[str, ...]  # the tasks it serves
    model_kind: str  # its model class: models/registry.py model_class_for(hf_config, model_kind)
    pooling: PoolingMethod
    output_size: int  # the embedding's size, or the number of labels
    normalize: bool = False  # embed: L2-normalize the pooled vector
    similarity: str = "cosine"  # score of an embedder: how two embeddings compare
    labels: tuple[str, ...] = ()  # classify: the label names, by label id
    activations: tuple[tuple[str, str], ...] = ()  # a classifier's activation per task (pooling/outputs.py)
    max_seq_length: int | None = None  # the sentence-transformers input limit, where set
    lowercase: bool = False  # sentence-transformers lower-cases inputs before tokenization
    max_input_len: int = 0  # the longest input the model takes (its positions)
    encoder: bool = False  # bidirectional attention (BERT, XLM-R): a row is computed whole, no KV cache
    token_types: bool = False  # pair inputs carry token types (BERT)

    def activation(self, task: str) -> str:
        return dict(self.activations)[task]


def _check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, choices))}")


def resolve_task(hf_config, directory: Path | None, runner: str = "auto", task: str | None = None) -> PoolingSpec | None:
    """The pooling spec of the checkpoint at `directory` (its config.json is `hf_config`; None: no files beyond
    the config), or None where it runs as a generator. `runner`: "auto" (from the checkpoint), "generate" or
    "pooling"; `task`: one of TASKS, or None for the checkpoint's default."""
    _check_choice("runner", runner, RUNNERS)
    if task is not None:
        _check_choice("task", task, TASKS)
    names = set(architectures_of(hf_config))
    if runner == "generate":
        if task is not None:
            raise ValueError(f"task={task!r} is a pooling task: it needs runner='pooling' (or 'auto'), not 'generate'")
        return None
    st = read_sentence_transformers_config(directory, hf_config)
    if names & set(POOLING_MODEL_CLASSES["classify"]):
        return _classifier_spec(hf_config, names, st, task)
    if names & set(POOLING_MODEL_CLASSES["embed"]):
        return _embedder_spec(hf_config, names, st, task)
    if names & set(MODEL_CLASSES):
        if runner == "pooling" or task is not None or (st is not None and not st.cross_encoder):
            return _embedder_spec(hf_config, names, st, task, kind="a causal LM, which pools as an embedder")
        return None
    model_class_for(hf_config)  # raises: the architecture is not supported
    return None


def _model_facts(model_class, hf_config) -> dict:
    """What the model class says about its inputs: their longest, encoder or decoder, token types."""
    max_input_len = getattr(model_class, "max_input_len", None)
    takes_token_types = getattr(model_class, "takes_token_types", None)
    return dict(max_input_len=max_input_len(hf_config) if max_input_len else hf_config.max_position_embeddings,
                encoder=getattr(model_class, "bidirectional", False),
                token_types=bool(takes_token_types and takes_token_types(hf_config)))


def _check_task(task: str | None, tasks: tuple[str, ...], names: set[str], kind: str) -> None:
    if task is not None and task not in tasks:
        other = "an embedding checkpoint (a base model, or a sentence-transformers bi-encoder)" if task == "embed" \
            else "a sequence-classification checkpoint (*ForSequenceClassification)"
        raise ValueError(f"task={task!r} needs {other}; {', '.join(sorted(names))} is {kind} serving "
                         f"{', '.join(tasks)}")


def _embedder_spec(hf_config, names: set[str], st, task: str | None, kind: str = "an embedder") -> PoolingSpec:
    tasks = ("embed", "score")
    _check_task(task, tasks, names, kind)
    if st is not None and st.cross_encoder:
        raise ValueError(f"the checkpoint's sentence-transformers config is a CrossEncoder's, but "
                         f"{', '.join(sorted(names))} has no classification head")
    model_class = model_class_for(hf_config, "embed")
    return PoolingSpec(
        task=task or "embed", tasks=tasks, model_kind="embed",
        pooling=st.pooling if st is not None else PoolingMethod(model_class.default_pooling),
        output_size=hf_config.hidden_size, normalize=st.normalize if st is not None else True,
        similarity=st.similarity if st is not None else "cosine",
        max_seq_length=st.max_seq_length if st is not None else None, lowercase=st is not None and st.lowercase,
        **_model_facts(model_class, hf_config))


def _classifier_spec(hf_config, names: set[str], st, task: str | None) -> PoolingSpec:
    num_labels = hf_config.num_labels
    if st is not None and not st.cross_encoder:
        raise ValueError(f"the checkpoint's sentence-transformers config is a bi-encoder's (a Pooling module), but "
                         f"{', '.join(sorted(names))} is a sequence classifier")
    cross_encoder = st is not None or bool(names & set(ENCODER_CLASSIFIERS))
    tasks = ("classify", "reward", "score") if num_labels == 1 else ("classify", "reward")
    _check_task(task, tasks, names, f"a classifier of {num_labels} labels")
    default = "classify" if num_labels > 1 else "score" if cross_encoder else "reward"
    score_activation = st.activation if st is not None and st.activation else "sigmoid"
    activations = (("classify", classifier_activation(hf_config)), ("reward", "none"), ("score", score_activation))
    model_class = model_class_for(hf_config, "classify")
    return PoolingSpec(task=task or default, tasks=tasks, model_kind="classify",
                       pooling=PoolingMethod(model_class.default_pooling), output_size=num_labels,
                       labels=labels_of(hf_config), activations=activations,
                       max_seq_length=st.max_seq_length if st is not None else None,
                       lowercase=st is not None and st.lowercase, **_model_facts(model_class, hf_config))
