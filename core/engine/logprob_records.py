"""Logprobs on the host: a step's results recorded into its sequences, and their output shape (vLLM's).

A step's results stay as they came, one `LogprobChunk` of arrays per step; a sequence that asked keeps references
into the chunks: `(chunk, row)` per output token, in order, and `(first position, chunk, first row, count)` per
prompt span its steps scored (position 0 has none: nothing scores the first prompt token; a span computed again
after a preemption is recorded again with the same values, and the later one wins). So recording a step costs one
tuple per sampled row and one per prompt span, whatever k is, and the garbage collector stops tracking chunks
and references after one pass: a job's millions of positions cost it neither objects nor collection time. The
{token id: Logprob} dictionaries are built on access (`PositionLogprobs`), as vLLM's flat logprobs are.
Only sequences that asked are touched, from the index lists the runner's plan carries."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import overload

import numpy as np

from nanovllm.engine.sequence import Sequence, SequenceStatus
from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.step_types import ScheduledBatch, StepLogprobs


@dataclass(slots=True)
class Logprob:
    """One token's logprob, its rank in the model's distribution (1 = most likely), and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One step's results for the rows that asked, in the plan's order, as host arrays: logprob of the scored token
# (float32 [rows]), its rank (int64 [rows]), the top k ids and their logprobs (int64 / float32 [rows, k], most
# likely first). A plain tuple, as are the (chunk, row) references into it: the garbage collector stops tracking
# both after one pass (it never does for instances of tuple subclasses such as a NamedTuple).
LogprobChunk = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


def logprob_chunk(results: TokenLogprobs) -> LogprobChunk:
    """Copies of a step's results (which may be pinned buffers, not to be held)."""
    return tuple(t.numpy().copy() for t in (results.logprobs, results.ranks, results.top_ids, results.top_logprobs))


def record_step_logprobs(batch: ScheduledBatch, results: StepLogprobs) -> None:
    """Store one step's results in the sequences they belong to (called before the step is committed; results
    of a sequence preempted or finished since the step was scheduled are void, like its sample)."""
    plan, seqs, epochs, finished = results.plan, batch.seqs, batch.epochs, SequenceStatus.FINISHED
    if results.sampled is not None:
        chunk = logprob_chunk(results.sampled)
        values = chunk[0].tolist()
        for j, i in enumerate(plan.sampled_indices.tolist()):
            seq = seqs[i]
            if seq.epoch == epochs[i] and seq.status is not finished:
                seq.output_logprobs.append((chunk, j))
                seq.cumulative_logprob += values[j]
    if results.prompt is not None:
        chunk = logprob_chunk(results.prompt)
        at = 0
        for i, first, count in plan.prompt_spans:
            seq = seqs[i]
            if seq.epoch == epochs[i] and seq.status is not finished:
                seq.prompt_logprob_spans.append((first + 1, chunk, at, count))  # logits at p score token p + 1
            at += count


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


Ref = tuple[LogprobChunk, int]


class PositionLogprobs(SequenceABC):
    """vLLM's shape, built on access: position i is {token id: Logprob} of the top `num_top` tokens and the scored
    token `token_ids[i]` (k or k + 1 entries), or None where nothing scored it (the first prompt token).
    Compares equal to a list of the same dictionaries."""

    def __init__(self, token_ids: list[int], refs: list[Ref | None], num_top: int,
                 decode: Callable[[int], str] | None):
        self._token_ids = token_ids
        self._refs = refs
        self._num_top = num_top
        self._decode = decode

    def __len__(self) -> int:
        return len(self._refs)

    @overload
    def __getitem__(self, index: int) -> dict[int, Logprob] | None: ...

    @overload
    def __getitem__(self, index: slice) -> list[dict[int, Logprob] | None]: ...

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        ref = self._refs[index]
        return None if ref is None else self._position(self._token_ids[index], *ref)

    def __iter__(self) -> Iterator[dict[int, Logprob] | None]:
        for token_id, ref in zip(self._token_ids, self._refs):
            yield None if ref is None else self._position(token_id, *ref)

    def __eq__(self, other) -> bool:
        return isinstance(other, SequenceABC) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"PositionLogprobs({list(self)!r})"

    def __reduce__(self):
        """Pickled (to another process: data-parallel replicas) with this request's rows only, not the whole
        steps' chunks it points into, and with the texts of its ids instead of the tokenizer."""
        rows = [ref for ref in self._refs if ref is not None]
        refs, decode = list(self._refs), None
        if rows:
            k = self._num_top
            chunk = tuple(np.stack([c[f][j] if f < 2 else c[f][j, :k] for c, j in rows]) for f in range(4))
            at = iter(range(len(rows)))
            refs = [None if ref is None else (chunk, next(at)) for ref in self._refs]
            if self._decode is not None:
                ids = set(self._token_ids) | set(chunk[2].flatten().tolist())
                decode = {i: self._decode(i) for i in ids}.__getitem__
        return PositionLogprobs, (self._token_ids, refs, self._num_top, decode)

    def _position(self, token_id: int, chunk: LogprobChunk, row: int) -> dict[int, Logprob]:
        logprobs, ranks, top_ids, top_logprobs = chunk
        decode, rank = self._decode, int(ranks[row])
        ids, values = top_ids[row, :self._num_top].tolist(), top_logprobs[row, :self._num_top].tolist()
        out = {tid: Logprob(lp, r + 1, decode(tid) if decode else None) for r, (tid, lp) in enumerate(zip(ids, values))}
        if token_id in out:
            out[token_id].rank = rank
        else:
            out[token_id] = Logprob(float(logprobs[row]), rank, decode(token_id) if decode else None)
        return out


def output_logprobs(seq: Sequence, decode: Callable[[int], str] | None
                    ) -> tuple[PositionLogprobs | None, PositionLogprobs | None]:
    """(logprobs, prompt_logprobs) of a finished sequence in vLLM's shape; None for what it did not ask."""
    params = seq.params
    logprobs = prompt_logprobs = None
    if params.logprobs is not None:
        refs = seq.output_logprobs[:seq.num_output_tokens]
        logprobs = PositionLogprobs(seq.output_token_ids, refs, params.logprobs, decode)
    if params.prompt_logprobs is not None:
        refs: list[Ref | None] = [None] * seq.num_prompt_tokens
        for first, chunk, at, count in seq.prompt_logprob_spans:
            refs[first:first + count] = [(chunk, at + k) for k in range(count)]
        prompt_logprobs = PositionLogprobs(seq.token_ids[:seq.num_prompt_tokens], refs, params.prompt_logprobs, decode)
    return logprobs, prompt_logprobs
