"""Logprobs on the host: a step's results recorded into its sequences, and their output shape (vLLM's).

A sequence that asked keeps raw entries (token id, logprob, rank, top ids, top logprobs): one per output token in
order, and one per prompt position (position 0 has none: nothing scores the first prompt token). A prompt position
computed twice (recomputation after a preemption) is overwritten with the same values. Only sequences that asked
are touched, from the index lists the runner's plan carries."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nanovllm.batch import ScheduledBatch
from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.runner.logprob_step import StepLogprobs

# (token id, logprob, rank, top-k token ids, top-k logprobs)
Entry = tuple[int, float, int, list[int], list[float]]


@dataclass(slots=True)
class Logprob:
    """One token's logprob, its rank in the model's distribution (1 = most likely), and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


def record_step_logprobs(batch: ScheduledBatch, sampled_ids: list[int], results: StepLogprobs) -> None:
    """Store one step's results in the sequences they belong to (called before the step is committed; results
    of a sequence preempted or finished since the step was scheduled are void, like its sample)."""
    plan = results.plan

    def valid(i: int) -> bool:
        seq = batch.seqs[i]
        return seq.epoch == batch.epochs[i] and seq.status is not SequenceStatus.FINISHED

    if results.sampled is not None:
        columns = _columns(results.sampled)
        for j, i in enumerate(plan.sampled_indices.tolist()):
            if valid(i):
                seq = batch.seqs[i]
                entry = _entry(sampled_ids[i], columns, j)
                seq.output_logprobs.append(entry)
                seq.cumulative_logprob += entry[1]
    if results.prompt is not None:
        columns = _columns(results.prompt)
        at = 0
        for i, first, count in plan.prompt_spans:
            if valid(i):
                seq = batch.seqs[i]
                for k in range(count):
                    position = first + 1 + k  # the prompt token the logits of position first + k score
                    seq.prompt_logprob_entries[position] = _entry(seq.token_ids[position], columns, at + k)
            at += count


def _columns(results) -> tuple[list, list, list, list]:
    return (results.logprobs.tolist(), results.ranks.tolist(), results.top_ids.tolist(),
            results.top_logprobs.tolist())


def _entry(token_id: int, columns: tuple[list, list, list, list], j: int) -> Entry:
    logprobs, ranks, top_ids, top_logprobs = columns
    return token_id, logprobs[j], ranks[j], top_ids[j], top_logprobs[j]


class TokenTexts:
    """The text of single token ids for `Logprob.decoded_token`, each decoded once: a token's text alone does not
    depend on its context, and top-k entries repeat the same few thousand ids."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def entry_dict(entry: Entry, num_top: int, decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    """vLLM's shape of one position: {token id: Logprob} of the top `num_top` tokens and the scored token (k or
    k + 1 entries)."""
    token_id, logprob, rank, top_ids, top_logprobs = entry
    out = {tid: Logprob(lp, r + 1, decode(tid) if decode else None)
           for r, (tid, lp) in enumerate(zip(top_ids[:num_top], top_logprobs[:num_top]))}
    if token_id not in out:
        out[token_id] = Logprob(logprob, rank, decode(token_id) if decode else None)
    else:
        out[token_id].rank = rank
    return out


def output_logprobs(seq: Sequence, decode: Callable[[int], str] | None
                    ) -> tuple[list[dict[int, Logprob]] | None, list[dict[int, Logprob] | None] | None]:
    """(logprobs, prompt_logprobs) of a finished sequence in vLLM's shape; None for what it did not ask."""
    params = seq.params
    logprobs = prompt_logprobs = None
    if params.logprobs is not None:
        logprobs = [entry_dict(e, params.logprobs, decode) for e in seq.output_logprobs[:seq.num_output_tokens]]
    if params.prompt_logprobs is not None:
        prompt_logprobs = [None if e is None else entry_dict(e, params.prompt_logprobs, decode)
                           for e in seq.prompt_logprob_entries]
    return logprobs, prompt_logprobs
