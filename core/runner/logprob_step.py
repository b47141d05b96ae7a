"""Which logprobs a step computes, and its results on their way to the host (docs/ARCHITECTURE.md).

Rows that ask for `logprobs` get, in the step that samples them, the logprob and rank of the sampled token and the
k most likely tokens; rows that ask for `prompt_logprobs` get the same for every prompt token their chunk's logits
score (position p scores token p + 1; the last prompt position's logits are the sampling logits, which score the
first output token instead). Nothing here runs for a step in which no row asks: the runner checks two counters.
"""
from __future__ import annotations

import numpy as np
import torch

from nanovllm.layers.logprobs import TokenLogprobs
from nanovllm.runner.persistent_batch import SequenceRows
from nanovllm.step_types import LogprobPlan, ScheduledBatch


def plan_logprobs(rows: SequenceRows, batch: ScheduledBatch, batch_rows: np.ndarray) -> LogprobPlan | None:
    """What `batch` computes for the rows that asked, or None when none did (the step skips every logprob op)."""
    if not rows.num_asking:
        return None
    top = rows.logprobs[batch_rows]
    asking = top >= 0
    if not all(batch.samples):
        asking &= np.asarray(batch.samples, dtype=bool)
    sampled = np.flatnonzero(asking)
    spans: list[tuple[int, int, int]] = []
    token_indices: list[np.ndarray] = []
    targets: list[int] = []
    prompt_top = rows.prompt_logprobs[batch_rows]
    asking_prompt = np.flatnonzero(prompt_top >= 0)
    if len(asking_prompt):
        offsets = np.concatenate(([0], np.cumsum(batch.num_new_tokens)))
        for i in asking_prompt.tolist():
            seq, start = batch.seqs[i], int(batch.start_positions[i])
            end = min(start + batch.num_new_tokens[i], seq.num_prompt_tokens - 1)
            if end > start:
                spans.append((i, start, end - start))
                token_indices.append(np.arange(offsets[i], offsets[i] + end - start))
                targets += seq.token_ids[start + 1:end + 1]
    if not len(sampled) and not spans:
        return None
    prompt_targets = np.stack([np.concatenate(token_indices), np.asarray(targets, dtype=np.int64)]) if spans else None
    return LogprobPlan(sampled, int(top[sampled].max()) if len(sampled) else 0, spans, prompt_targets,
                       int(max(prompt_top[i] for i, _, _ in spans)) if spans else 0)


def copy_to_host(results: TokenLogprobs | None) -> TokenLogprobs | None:
    """Queue the copy of device results to pinned host memory (the caller records the event that covers it)."""
    if results is None or not results.logprobs.is_cuda:
        return results

    def pinned(t: torch.Tensor) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host

    return TokenLogprobs(*(pinned(getattr(results, name))
                           for name in ("logprobs", "ranks", "top_ids", "top_logprobs")))
