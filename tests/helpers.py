"""Shared builders for engine tests."""
from __future__ import annotations

import itertools

from nanovllm.engine.sequence import Sequence
from nanovllm.sampling_params import SamplingParams

_ids = itertools.count()


def make_seq(token_ids: list[int], max_tokens: int = 16, **params) -> Sequence:
    seq_id = next(_ids)
    return Sequence(seq_id, str(seq_id), token_ids, SamplingParams(max_tokens=max_tokens, **params), sampling_seed=0)


def process_alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
