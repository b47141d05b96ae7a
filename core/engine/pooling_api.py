"""The pooling half of `LLM` (vLLM's names, docs/ARCHITECTURE.md): `embed`, `classify`, `reward` and `score` for
whole batches, and the request-level `add_request(prompt, PoolingParams)` and `add_score_request`, which `step`
answers with `PoolingRequestOutput`s (engine/pooling_outputs.py). A pooling engine runs the model's pooling
tasks only; its rows are prefilled, pooled and done (engine/pooling_scheduler.py).

Mixed into `LLM`: it uses the engine's parts as LLM's own methods do (`pooling`, `prompts`, the scheduler, the
output assembler)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence as SequenceLike

from nanovllm.engine.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from nanovllm.engine.sequence import Sequence
from nanovllm.pooling import row_pooling
from nanovllm.pooling_params import PoolingParams, RowPooling
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenization import Prompt

# What a pooling row carries as its sampling settings: the runner fills a row's settings from them and finds
# nothing to sample with (greedy, no controls); nothing is ever sampled.
_NO_SAMPLING = SamplingParams(temperature=0.0, max_tokens=1)
_OUTPUT_TYPES = {"embed": EmbeddingRequestOutput, "classify": ClassificationRequestOutput,
                 "score": ScoringRequestOutput, "reward": PoolingRequestOutput}


def _prompt_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


class PoolingAPI:
    # ---- batch API ------------------------------------------------------------------------------------------------

    def embed(self, prompts: Prompt | list[Prompt],
              pooling_params: PoolingParams | list[PoolingParams] | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in order (`.outputs.embedding`); an invalid prompt gets an output with
        `error` set and the rest run."""
        return self._pool_batch(prompts, pooling_params, "embed")

    def classify(self, prompts: Prompt | list[Prompt],
                 pooling_params: PoolingParams | list[PoolingParams] | None = None
                 ) -> list[ClassificationRequestOutput]:
        """Each prompt's label probabilities (`.outputs.probs`, by label id; `.outputs.label` the likeliest)."""
        return self._pool_batch(prompts, pooling_params, "classify")

    def reward(self, prompts: Prompt | list[Prompt],
               pooling_params: PoolingParams | list[PoolingParams] | None = None) -> list[PoolingRequestOutput]:
        """Each prompt's reward: the head's raw output (`.outputs.data`, one value per label)."""
        return self._pool_batch(prompts, pooling_params, "reward")

    def score(self, text_1: Prompt | list[Prompt], text_2: Prompt | list[Prompt],
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """The score (`.outputs.score`) of each pair, as vLLM pairs them: one text_1 with each text_2 (1:1,
        1:N), or text_1[i] with text_2[i] (N:N). A cross-encoder scores a pair as one input (its activation
        applied); an embedder by the similarity of the two texts' embeddings."""
        firsts, seconds = _prompt_list(text_1), _prompt_list(text_2)
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        elif len(firsts) != len(seconds):
            raise ValueError(f"score pairs one text_1 with every text_2, or text_1[i] with text_2[i]: got "
                             f"{len(firsts)} text_1 and {len(seconds)} text_2")
        outputs: dict[str, ScoringRequestOutput] = {}
        request_ids = []
        for index, (first, second) in enumerate(zip(firsts, seconds)):
            request_id = f"score-{next(self._seq_ids)}"
            request_ids.append(request_id)
            try:
                self.add_score_request(first, [second], request_id, pooling_params)
            except ValueError as exc:
                outputs[request_id] = ScoringRequestOutput(request_id, None, [], error=f"pair {index}: {exc}",
                                                           invalid_request=True)
        for output in self._drain():
            outputs[output.request_id] = ScoringRequestOutput(**{**vars(output), "outputs": output.outputs[0]})
        return [outputs[request_id] for request_id in request_ids]

    def _pool_batch(self, prompts: Prompt | list[Prompt], pooling_params, task: str) -> list[PoolingRequestOutput]:
        prompts = _prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            pooling_params = [pooling_params or PoolingParams()] * len(prompts)
        if len(pooling_params) != len(prompts):
            raise ValueError(f"got {len(pooling_params)} pooling params for {len(prompts)} prompts")
        outputs: dict[str, PoolingRequestOutput] = {}
        request_ids = []
        for index, (prompt, params) in enumerate(zip(prompts, pooling_params)):
            if params.task not in (None, task):
                raise ValueError(f"LLM.{task} got PoolingParams(task={params.task!r})")
            request_id = f"{task}-{next(self._seq_ids)}"
            request_ids.append(request_id)
            try:
                self.add_request(prompt, dataclasses.replace(params, task=task), request_id)
            except ValueError as exc:
                outputs[request_id] = _OUTPUT_TYPES[task](request_id, None, [], error=f"prompt {index}: {exc}",
                                                          invalid_request=True)
        outputs.update((output.request_id, output) for output in self._drain())
        return [outputs[request_id] for request_id in request_ids]

    def _drain(self) -> list[PoolingRequestOutput]:
        outputs = []
        while self.has_unfinished_requests():
            outputs += self.step()
        return outputs

    # ---- request-level API ----------------------------------------------------------------------------------------

    def add_score_request(self, query: Prompt, documents: list[Prompt], request_id: str | None = None,
                          params: PoolingParams | None = None) -> str:
        """Queue the scores of `documents` against `query` as one request; `step` answers it with a
        `PoolingRequestOutput` whose `outputs` are a `ScoringOutput` per document, in order. Raises ValueError
        (and queues nothing) when an input is invalid or can never fit."""
        self._check_usable()
        params = params or PoolingParams()
        if params.task not in (None, "score"):
            raise ValueError(f"add_score_request got PoolingParams(task={params.task!r})")
        if not isinstance(documents, list) or not documents:
            raise ValueError("documents must be a non-empty list of prompts")
        rule = self._row_pooling(dataclasses.replace(params, task="score"))
        request_id = str(next(self._seq_ids)) if request_id is None else request_id
        if rule.task == "score":  # a cross-encoder: one input per (query, document) pair
            seqs = [self._pooling_sequence(request_id, *self.prompts.tokenize_pair(query, document), rule)
                    for document in documents]
        else:  # an embedder: the query's embedding against each document's
            seqs = [self._pooling_sequence(request_id, self.tokenize(text), None, rule, text)
                    for text in [query, *documents]]
        self._outputs.add_group(seqs)
        for seq in seqs:
            self._scheduler.add(seq)
        return request_id

    def _add_pooling_request(self, prompt: Prompt | None, params: PoolingParams | SamplingParams | None,
                             request_id: str | None, prompt_token_ids: list[int] | None) -> str:
        """`add_request` of a pooling row (see LLM.add_request)."""
        if self.pooling is None:
            raise ValueError(f"model {self.model_name!r} generates: PoolingParams need a pooling model (an embedding "
                             "or classification checkpoint, or LLM(..., runner='pooling') / task=...)")
        if not isinstance(params, PoolingParams | None):
            raise ValueError(f"model {self.model_name!r} runs as a pooling model (task {self.pooling.task!r}): "
                             "pass PoolingParams, or use LLM.embed / classify / score / reward")
        rule = self._row_pooling(params or PoolingParams())
        token_ids = prompt_token_ids if prompt_token_ids is not None else self.tokenize(prompt)
        request_id = str(next(self._seq_ids)) if request_id is None else request_id
        self._scheduler.add(self._pooling_sequence(request_id, token_ids, None, rule,
                                                   prompt if isinstance(prompt, str) else None))
        return request_id

    def _row_pooling(self, params: PoolingParams) -> RowPooling:
        if not isinstance(params, PoolingParams):
            raise ValueError("pooling params must be a PoolingParams")
        return row_pooling(params, self.pooling, self.hf_config)

    def _pooling_sequence(self, request_id: str, token_ids: SequenceLike[int], token_type_ids: list[int] | None,
                          rule: RowPooling, prompt: str | None = None) -> Sequence:
        if not token_ids:
            raise ValueError("the input is empty")
        seq = Sequence(next(self._seq_ids), request_id, list(token_ids), _NO_SAMPLING, 0, prompt, pooling=rule,
                       token_type_ids=token_type_ids)
        error = self._scheduler.capacity_error(seq)
        if error:
            raise ValueError(error)
        return seq

