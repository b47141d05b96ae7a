"""Scoring choices with a generative model (evaluation jobs): the log-probability of each candidate continuation
given a prompt, summed over its tokens and per token, through the prompt-logprobs machinery.

A choices request is one sequence per choice, prompt + choice, asking the logprob of each prompt token
(`prompt_logprobs=0`) from the prompt's last position on (`Sequence.prompt_logprobs_from`: the logits at position
p score token p + 1), so that the KV of the blocks wholly before it is shared: the first choice computes the
prompt, and the others are its siblings (`parent`), admitted once it has, on its blocks (BlockManager.fork) or,
when it has already ended, on its blocks in the prefix cache. Each sequence samples one token, which is dropped.
Choices are tokenized on their own (no special tokens), so a text choice carries its leading space ("Paris" after
"The capital is" is " Paris")."""
from __future__ import annotations

from dataclasses import dataclass

from nanovllm.engine.outputs import RequestOutput
from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams
from nanovllm.tokenization import Prompt

_SCORING = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)


@dataclass
class ChoiceScore:
    index: int
    token_ids: list[int]
    logprob: float  # summed over the choice's tokens
    normalized_logprob: float  # per token: logprob / len(token_ids)


@dataclass
class ChoicesRequestOutput:
    """The choices of one prompt, scored; `best` and `best_normalized` index the choice of the highest summed and
    per-token logprob. `num_prompt_tokens`: the prompt's; `num_cached_tokens`: over every choice's sequence."""

    request_id: str
    prompt_token_ids: list[int]
    choices: list[ChoiceScore]
    best: int | None
    best_normalized: int | None
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    error: str | None = None
    invalid_request: bool = False

    @property
    def token_ids(self) -> list[int]:
        """Generated tokens, as a RequestOutput has them: none (the choices are scored, not generated)."""
        return []


def choices_output(num_prompt_tokens: int, outputs: list[RequestOutput]) -> ChoicesRequestOutput:
    """The choices request's output from its sequences' outputs (in choice order)."""
    choices = []
    for index, output in enumerate(outputs):
        token_ids = output.prompt_token_ids[num_prompt_tokens:]
        positions = output.prompt_logprobs[num_prompt_tokens:]
        logprob = sum(position[token].logprob for token, position in zip(token_ids, positions))
        choices.append(ChoiceScore(index, token_ids, logprob, logprob / len(token_ids)))
    first = outputs[0]
    return ChoicesRequestOutput(
        first.request_id, first.prompt_token_ids[:num_prompt_tokens], choices,
        max(range(len(choices)), key=lambda i: choices[i].logprob),
        max(range(len(choices)), key=lambda i: choices[i].normalized_logprob), num_prompt_tokens,
        sum(output.num_cached_tokens for output in outputs))


class ChoicesAPI:
    """Mixed into `LLM`, with which it shares the engine's parts."""

    def score_choices(self, prompts: list[Prompt], choices: list[list[Prompt]]) -> list[ChoicesRequestOutput]:
        """Each prompt's choices scored (see the module docstring), in order; an invalid request gets an output
        with `error` set and the others run."""
        if len(prompts) != len(choices):
            raise ValueError(f"got {len(choices)} lists of choices for {len(prompts)} prompts")
        outputs: dict[str, ChoicesRequestOutput] = {}
        request_ids = []
        for index, (prompt, options) in enumerate(zip(prompts, choices)):
            request_id = f"choices-{next(self._seq_ids)}"
            request_ids.append(request_id)
            try:
                self.add_choices_request(prompt, options, request_id)
            except ValueError as exc:
                outputs[request_id] = ChoicesRequestOutput(request_id, [], [], None, None, 0,
                                                           error=f"prompt {index}: {exc}", invalid_request=True)
        while self.has_unfinished_requests():
            outputs.update((output.request_id, output) for output in self.step())
        return [outputs[request_id] for request_id in request_ids]

    def add_choices_request(self, prompt: Prompt | None, choices: list[Prompt], request_id: str | None = None,
                            prompt_token_ids: list[int] | None = None) -> str:
        """Queue the scoring of `choices` (texts or token-id lists) as continuations of `prompt` (or of
        `prompt_token_ids`); `step` answers it with one ChoicesRequestOutput. Raises ValueError (and queues
        nothing) when the request is invalid or can never fit."""
        self._check_usable()
        if self.pooling is not None:
            raise ValueError(f"model {self.model_name!r} runs as a pooling model: choices are scored by a generator")
        prompt_ids = list(prompt_token_ids) if prompt_token_ids is not None else self.tokenize(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty: a choice is scored given at least one prompt token")
        if not isinstance(choices, list) or not choices:
            raise ValueError("choices must be a non-empty list of texts or token-id lists")
        request_id = str(next(self._seq_ids)) if request_id is None else request_id
        seqs = []
        for index, choice in enumerate(choices):
            choice_ids = self._choice_token_ids(choice)
            seq = Sequence(next(self._seq_ids), request_id, prompt_ids + choice_ids, _SCORING, 0,
                           prompt if isinstance(prompt, str) else None)
            seq.prompt_logprobs_from = len(prompt_ids) - 1
            if seqs:
                seq.parent, seq.completion_index = seqs[0], index
            error = self._scheduler.capacity_error(seq)
            if error:
                raise ValueError(f"choice {index}: {error}")
            seqs.append(seq)
        num_prompt_tokens = len(prompt_ids)
        self._outputs.add_group(_SCORING, seqs, build=lambda outputs: choices_output(num_prompt_tokens, outputs))
        for seq in seqs:
            self._scheduler.add(seq)
        return request_id

    def _choice_token_ids(self, choice: Prompt) -> list[int]:
        if isinstance(choice, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.model_name!r} has no tokenizer: pass choices as token ids")
            token_ids = self.tokenizer(choice, add_special_tokens=False).input_ids
        else:
            token_ids = self.tokenize(choice)
        if not token_ids:
            raise ValueError(f"choice {choice!r} has no tokens")
        return list(token_ids)
