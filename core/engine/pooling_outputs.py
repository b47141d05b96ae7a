"""What a pooling request gives back (vLLM's shapes): `PoolingRequestOutput` whose `outputs` is an
`EmbeddingOutput` (`.embedding`), a `ClassificationOutput` (`.probs`), a `ScoringOutput` (`.score`) or, for a
reward, a `PoolingOutput` (`.data`, the head's raw output); and `PoolingOutputAssembler`, which builds them from
finished pooling rows and holds the rows of a score request (a query and its documents) until all have ended.

A score request of a cross-encoder has one row per (query, document) pair, whose output is the pair's score; of
an embedder, one row for the query and one per document, scored by the model's similarity (cosine, or dot) of
their embeddings, as sentence-transformers does."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import EngineStats
from nanovllm.pooling import PoolingSpec


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]  # per label, by label id (raw logits under PoolingParams(activation=False))
    label: str  # the most likely label's name (the checkpoint's id2label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingOutput:
    data: torch.Tensor  # a reward: the head's raw output, one value per label


@dataclass
class PoolingRequestOutput:
    """One pooling request's result. `outputs`: its task's output (a list of `ScoringOutput`, one per document,
    for a score request of `LLM.add_score_request`). `prompt_token_ids`: its input (a score request's rows'
    inputs, concatenated); `num_prompt_tokens` / `num_cached_tokens` count every row of the request."""

    request_id: str
    outputs: Any
    prompt_token_ids: list[int]
    finished: bool = True
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # input tokens served by the prefix cache
    error: str | None = None
    invalid_request: bool = False  # the error is the request's fault (a bad input), not the engine's
    arrival_time: float | None = None
    finish_time: float | None = None

    @property
    def token_ids(self) -> list[int]:
        """Generated tokens, as a RequestOutput has them: a pooling request generates none."""
        return []


class EmbeddingRequestOutput(PoolingRequestOutput):
    """`outputs`: an EmbeddingOutput."""


class ClassificationRequestOutput(PoolingRequestOutput):
    """`outputs`: a ClassificationOutput."""


class ScoringRequestOutput(PoolingRequestOutput):
    """`outputs`: a ScoringOutput."""


@dataclass
class _ScoreGroup:
    seqs: list[Sequence]  # cross-encoder: one per pair; embedder: the query, then the documents
    finished: set[int] = field(default_factory=set)  # seq ids


class PoolingOutputAssembler:
    def __init__(self, spec: PoolingSpec):
        self.spec = spec
        self._groups: dict[str, _ScoreGroup] = {}  # request id -> its rows, for score requests

    def add_group(self, seqs: list[Sequence]) -> None:
        """The rows of one score request (see the module docstring)."""
        self._groups[seqs[0].request_id] = _ScoreGroup(seqs)

    def clear(self) -> None:
        """Forget every unfinished score request (its requests were aborted)."""
        self._groups.clear()

    def assemble(self, finished: list[Sequence], stats: EngineStats) -> list[PoolingRequestOutput]:
        """The outputs of the requests whose last row is among `finished`, in finishing order."""
        outputs = []
        now = time.perf_counter()
        for seq in finished:
            seq.finish_time = now
            stats.record_finished(seq.num_prompt_tokens, 0, seq.arrival_time, None, now)
            group = self._groups.get(seq.request_id)
            if group is None:
                outputs.append(self._output(seq))
                continue
            group.finished.add(seq.seq_id)
            if len(group.finished) == len(group.seqs):
                del self._groups[seq.request_id]
                outputs.append(self._score_output(group.seqs))
        return outputs

    def _output(self, seq: Sequence) -> PoolingRequestOutput:
        task, values = seq.pooling.task, seq.pooled
        common = dict(request_id=seq.request_id, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
                      num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_prefix_hit_tokens or 0,
                      error=seq.error, arrival_time=seq.arrival_time, finish_time=seq.finish_time)
        if task == "embed":
            return EmbeddingRequestOutput(outputs=EmbeddingOutput(values.tolist()), **common)
        if task == "classify":
            probs = values.tolist()
            label = self.spec.labels[max(range(len(probs)), key=probs.__getitem__)]
            return ClassificationRequestOutput(outputs=ClassificationOutput(probs, label), **common)
        if task == "score":
            return ScoringRequestOutput(outputs=ScoringOutput(float(values[0])), **common)
        return PoolingRequestOutput(outputs=PoolingOutput(values.clone()), **common)

    def _score_output(self, seqs: list[Sequence]) -> PoolingRequestOutput:
        if seqs[0].pooling.task == "score":  # a cross-encoder's pairs
            scores = [float(seq.pooled[0]) for seq in seqs]
        else:
            query, documents = seqs[0].pooled, torch.stack([seq.pooled for seq in seqs[1:]])
            if self.spec.similarity == "cosine":
                query, documents = F.normalize(query, dim=-1), F.normalize(documents, dim=-1)
            scores = (documents @ query).tolist()
        first = seqs[0]
        return PoolingRequestOutput(
            request_id=first.request_id, outputs=[ScoringOutput(score) for score in scores],
            prompt_token_ids=[t for seq in seqs for t in seq.token_ids[:seq.num_prompt_tokens]],
            num_prompt_tokens=sum(seq.num_prompt_tokens for seq in seqs),
            num_cached_tokens=sum(seq.num_prefix_hit_tokens or 0 for seq in seqs),
            arrival_time=first.arrival_time, finish_time=max(seq.finish_time for seq in seqs))
