"""What a finished request gives back: `RequestOutput` with its `CompletionOutput`s (vLLM's shapes), and
`OutputAssembler`, which turns finished sequences into them (text, logprobs, the structured-output verdict) and
holds the sequences of a request with n / best_of > 1 until all of them have finished."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nanovllm.engine.logprob_records import PositionLogprobs, TokenTexts, output_logprobs
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.stats import EngineStats
from nanovllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from nanovllm.structured import GrammarManager


@dataclass
class CompletionOutput:
    """One completion of a prompt (vLLM's shape); a request with `n` > 1 has n of them."""

    index: int
    text: str | None
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: PositionLogprobs | None  # a sequence of {token id: Logprob}, as RequestOutput.logprobs
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str | None  # None when the model has no tokenizer
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "error"
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served by the prefix cache
    error: str | None = None
    invalid_request: bool = False  # the error is the request's fault (HTTP 400), not the engine's (500)
    # Structured outputs: whether the output is a complete match of the constraint (None: unconstrained). False
    # when it was cut (max_tokens, a stop string): the text may not parse.
    structured_complete: bool | None = None
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Only for a request that asked (SamplingParams.logprobs / prompt_logprobs), in vLLM's shape: per token a
    # {token id: Logprob} of the top k and the chosen token, built on access; prompt_logprobs[0] is None.
    logprobs: PositionLogprobs | None = None
    prompt_logprobs: PositionLogprobs | None = None
    cumulative_logprob: float | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it; None for EOS or length
    # Every completion (n of them; best first when best_of chose them). The fields above are outputs[0]'s.
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class _Group:
    """The sequences of one request with n / best_of > 1, and those finished so far."""

    params: SamplingParams
    seqs: list[Sequence]
    finished: list[Sequence]
    build: Callable[[list[RequestOutput]], object] | None = None  # the request's output from its sequences'


class OutputAssembler:
    def __init__(self, tokenizer, grammars: GrammarManager | None = None):
        self.tokenizer = tokenizer
        self.grammars = grammars
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        self._groups: dict[str, _Group] = {}  # request id -> its completions, for n / best_of > 1

    def add_group(self, params: SamplingParams, seqs: list[Sequence],
                  build: Callable[[list[RequestOutput]], object] | None = None) -> None:
        """The sequences of one request with n / best_of > 1 (`params` as the user gave them), or whose output
        `build` makes from their outputs, in completion-index order (choice scores: engine/choice_scores.py)."""
        self._groups[seqs[0].request_id] = _Group(params, seqs, [], build)

    def clear(self) -> None:
        """Forget every unfinished group (its requests were aborted)."""
        self._groups.clear()

    def assemble(self, finished: list[Sequence], stats: EngineStats) -> list[RequestOutput]:
        """The outputs of the requests whose last sequence is among `finished`, in finishing order."""
        outputs = []
        for seq in finished:
            group = self._groups.get(seq.request_id)
            if group is None:
                outputs.append(self._output(seq, stats))
                continue
            group.finished.append(seq)
            if len(group.finished) == len(group.seqs):
                del self._groups[seq.request_id]
                outputs.append(self._group_output(group, stats))
        return outputs

    def _output(self, seq: Sequence, stats: EngineStats) -> RequestOutput:
        seq.finish_time = time.perf_counter()
        stats.record_finished(seq.num_prompt_tokens, seq.num_output_tokens, seq.arrival_time, seq.first_token_time,
                              seq.finish_time)
        text, structured_complete = seq.stop_text, None
        finish_reason, error = seq.finish_reason, seq.error
        if seq.grammar_future is not None:
            # A constrained row's text is exactly what its grammar accepted (tokens' bytes, not a decode's clean-up);
            # a stop string that cut it makes it incomplete.
            row = self.grammars.output(seq)
            structured_complete = row.complete and (text is None or text == row.text)
            text = row.text if text is None else text
            if row.error is not None and error is None:
                finish_reason, error = "error", row.error
                seq.invalid_request = row.invalid_request
        elif text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)
        logprobs = prompt_logprobs = None
        if seq.output_logprobs is not None or seq.prompt_logprob_spans is not None:
            logprobs, prompt_logprobs = output_logprobs(seq, self._token_texts)
        completion = CompletionOutput(seq.completion_index, text, seq.output_token_ids, seq.cumulative_logprob,
                                      logprobs, finish_reason, seq.stop_reason)
        return RequestOutput(
            request_id=seq.request_id, prompt=seq.prompt, prompt_token_ids=seq.token_ids[:seq.num_prompt_tokens],
            text=text, token_ids=seq.output_token_ids, finish_reason=finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_prefix_hit_tokens or 0,
            error=error, invalid_request=seq.invalid_request, arrival_time=seq.arrival_time,
            first_token_time=seq.first_token_time, finish_time=seq.finish_time,
            structured_complete=structured_complete,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, cumulative_logprob=seq.cumulative_logprob,
            stop_reason=seq.stop_reason, outputs=[completion])

    def _group_output(self, group: _Group, stats: EngineStats) -> RequestOutput:
        """One output for the n completions of a request: in index order, or the n of highest cumulative
        logprob, best first, under best_of."""
        seqs = sorted(group.finished, key=lambda s: s.completion_index)
        if group.build is not None:
            return group.build([self._output(seq, stats) for seq in seqs])
        if len(seqs) > group.params.n:
            seqs = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[:group.params.n]
        outputs = [self._output(seq, stats) for seq in seqs]
        completions = [o.outputs[0] for o in outputs]
        for index, c in enumerate(completions):
            c.index = index
        if group.params.logprobs is None:  # asked only to rank best_of
            for c in completions:
                c.logprobs = c.cumulative_logprob = None
        first = outputs[0]
        return dataclasses.replace(first, text=completions[0].text, token_ids=completions[0].token_ids,
                                   logprobs=completions[0].logprobs,
                                   cumulative_logprob=completions[0].cumulative_logprob, outputs=completions)
