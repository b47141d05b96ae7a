"""Logprobs of the model's raw distribution, computed on the device in the step that sampled the tokens.

Like vLLM's default, they are log_softmax of the raw logits in float32: before temperature, penalties, logit bias
or any filter, so they score the model, not the sampling settings. A token's rank is the number of vocabulary
entries whose logprob is >= its own (1 = the most likely; vLLM counts the same way). The caller runs this only for
rows that asked (zero cost otherwise); prompt logprobs are the same computation over the logits of every prompt
position, each scoring the prompt token that follows it."""
from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class TokenLogprobs:
    logprobs: torch.Tensor  # float32 [rows]: log p(token)
    ranks: torch.Tensor  # int64 [rows]
    top_ids: torch.Tensor  # int64 [rows, num_top], most likely first
    top_logprobs: torch.Tensor  # float32 [rows, num_top]


def _torch_stats(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(each token's logprob, its rank, each row's log Z)."""
    logits = logits.float()
    chosen = logits.gather(1, token_ids.unsqueeze(1))
    log_z = torch.logsumexp(logits, dim=-1)
    return (chosen.squeeze(1) - log_z), (logits >= chosen).sum(dim=-1), log_z


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> TokenLogprobs:
    """logits [rows, vocab] any float dtype, token_ids int64 [rows] -> each token's logprob and rank, and the
    num_top most likely tokens with their logprobs (num_top may be 0). On CUDA two short kernels
    (`nanovllm.kernels.logprobs`) give the logprobs and ranks, and the top tokens up to its MAX_TOP (ties: the
    smaller id first), a top-k beyond; torch elsewhere. float32 throughout."""
    if not 0 <= num_top <= logits.shape[1]:
        raise ValueError(f"num_top must be in [0, {logits.shape[1]}], got {num_top}")
    if logits.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        from nanovllm.kernels.logprobs import MAX_TOP, logprobs_and_top
        logprobs, ranks, top_ids, top_logprobs, log_z = logprobs_and_top(logits, token_ids,
                                                                        num_top if num_top <= MAX_TOP else 0)
        if num_top <= MAX_TOP:
            return TokenLogprobs(logprobs=logprobs, ranks=ranks, top_ids=top_ids, top_logprobs=top_logprobs)
    else:
        logprobs, ranks, log_z = _torch_stats(logits, token_ids)
    top_values, top_ids = logits.topk(num_top, dim=-1)
    return TokenLogprobs(logprobs=logprobs, ranks=ranks, top_ids=top_ids,
                         top_logprobs=top_values.float() - log_z.unsqueeze(1))


def chunked_logprobs(logits_of: Callable[[int, int], torch.Tensor | None], token_ids: torch.Tensor, num_top: int,
                     chunk_rows: int = 1024) -> TokenLogprobs | None:
    """Logprobs of `token_ids` [n] (e.g. each prompt position's next prompt token), a chunk of rows at a time to
    bound the temporaries of a long prompt: `logits_of(start, end)` gives rows start..end's logits, or None (a
    tensor-parallel worker, whose LM head still has to run: it is collective). None when no chunk had logits."""
    parts = []
    for start in range(0, len(token_ids), chunk_rows):
        logits = logits_of(start, start + chunk_rows)
        if logits is not None:
            parts.append(compute_logprobs(logits, token_ids[start:start + chunk_rows], num_top))
    if not parts:
        return None
    return TokenLogprobs(*(torch.cat([getattr(part, name) for part in parts])
                           for name in ("logprobs", "ranks", "top_ids", "top_logprobs")))
