"""Penalties and logit controls as batched device ops, with vLLM's semantics, applied before sampling.

Order (vLLM's): allowed_token_ids, bad_words, min_tokens, logit_bias, then the penalties (repetition, then
frequency and presence); temperature and the filters come after, in the sampler. Every op takes float32 logits
[batch, vocab] and edits them in place; a caller skips an op when no row of the batch uses it, so rows without
controls pay nothing.

Per-row state lives on the device and is addressed by *entries* rather than per-row Python:

- Token history (`TokenHistory`): per-slot tables for the rows that need their tokens (repetition / presence /
  frequency penalties, bad words), in a pool of slots sized by the engine (not by the batch): output token counts
  int32 [slots, vocab] and a prompt-token mask bool [slots, vocab] (looked up by token), the list of the slot's
  distinct seen tokens (prompt and output) int32 [slots, vocab + 1] with its length, the last `window` output
  tokens and the output length. Penalties touch only the listed tokens (`kernels/penalties.py` on CUDA): a step
  costs what the histories hold, not the vocabulary. At vocab 151,936 a slot costs 1.4 MB, so a pool of 64 slots
  is 87 MB; rows without such controls hold no slot. `record` appends a step's samples.
- Sparse controls (logit_bias, min_tokens' stop ids, bad words) are flat entry lists (persistent row, token[,
  value]) that the engine keeps as device tensors keyed by its persistent row ids. A step maps them to its batch
  rows through `batch_index_of` (-1: the row is not in the step, and its entries do nothing).
  allowed_token_ids is a bitmask row per persistent row (`allowed_bitmask`), applied by the structured outputs'
  mask kernel (`kernels/token_bitmask.py`).

On CUDA each op is one kernel (`kernels/penalties.py`, `kernels/logit_controls.py`, `kernels/token_bitmask.py`):
a step with controls runs a handful of launches rather than dozens of small torch ops, which cost more host time
than their device work. Elsewhere the same ops run in torch, with the kernels' results bit for bit.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def _check_float32(logits: torch.Tensor) -> None:
    if logits.dtype != torch.float32:
        raise TypeError(f"logits must be float32 for logit controls, got {logits.dtype}")


def upload(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host values on the device without waiting for the work queued there: the driver stages a pageable copy at
    once, where a blocking one would first synchronise the stream (stalling the async loop at every join)."""
    return torch.as_tensor(values, dtype=dtype).to(device, non_blocking=True)


def _use_kernel(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def batch_index_of(batch_rows: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of a step's row list (distinct persistent row ids, but for a padded step's padding row, which holds
    no controls): for each persistent row id its batch index this step, or -1 (device op)."""
    if _use_kernel(batch_rows):
        from nanovllm.kernels.logit_controls import batch_index_map
        return batch_index_map(batch_rows, num_rows)
    inverse = torch.full((num_rows,), -1, dtype=torch.int64, device=batch_rows.device)
    inverse[batch_rows] = torch.arange(len(batch_rows), device=batch_rows.device)
    return inverse


def _in_step(batch_index: torch.Tensor, rows: torch.Tensor, *columns: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The entries of rows in the step (the torch paths): their batch rows, then their `columns`."""
    batch_rows = batch_index[rows]
    present = batch_rows >= 0
    return (batch_rows[present], *(column[present] for column in columns))


HISTORY_WINDOW = 8  # the output tokens a slot keeps in `recent`: bad words of up to 9 tokens


@dataclass
class TokenHistory:
    """Device token history of the rows holding a slot (see the module docstring for the layout)."""

    output_counts: torch.Tensor  # int32 [slots, vocab]
    prompt_mask: torch.Tensor  # bool [slots, vocab]
    # int32 [slots, vocab + 1]: the first num_seen are the distinct tokens of the prompt and the output (the extra
    # entry takes `record`'s write of a token already listed when every token is)
    seen_tokens: torch.Tensor
    num_seen: torch.Tensor  # int32 [slots]
    recent: torch.Tensor  # int64 [slots, window]: the last output tokens, oldest first, -1 before the first
    output_lens: torch.Tensor  # int64 [slots]

    @classmethod
    def allocate(cls, num_slots: int, vocab_size: int, window: int, device: torch.device) -> TokenHistory:
        return cls(output_counts=torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=device),
                   prompt_mask=torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=device),
                   seen_tokens=torch.zeros(num_slots, vocab_size + 1, dtype=torch.int32, device=device),
                   num_seen=torch.zeros(num_slots, dtype=torch.int32, device=device),
                   recent=torch.full((num_slots, window), -1, dtype=torch.int64, device=device),
                   output_lens=torch.zeros(num_slots, dtype=torch.int64, device=device))

    @property
    def window(self) -> int:
        return self.recent.shape[1]

    def reset(self, slot: int, prompt_ids: Sequence[int], output_ids: Sequence[int] = ()) -> None:
        """Give a slot to a request (once, when it joins): its prompt, and any output it already has (a request
        that resumes). The tables are built on the host and uploaded in one copy that does not wait for the
        device."""
        prompt = np.asarray(prompt_ids, dtype=np.int64)
        output = np.asarray(output_ids, dtype=np.int64)
        seen = np.unique(np.concatenate([prompt, output]))
        output_tokens, counts = np.unique(output, return_counts=True)
        prompt_tokens = np.unique(prompt)
        tail = np.full(self.window, -1, dtype=np.int64)
        if len(output):
            tail[self.window - min(len(output), self.window):] = output[-self.window:]
        parts = (output_tokens, counts, prompt_tokens, seen, tail)
        payload = upload(np.concatenate(parts), torch.int64, self.output_counts.device)
        output_tokens, counts, prompt_tokens, seen, tail = payload.split([len(part) for part in parts])
        self.output_counts[slot].zero_()
        self.output_counts[slot, output_tokens] = counts.to(torch.int32)
        self.prompt_mask[slot].zero_()
        self.prompt_mask[slot, prompt_tokens] = True
        self.seen_tokens[slot, :len(seen)] = seen.to(torch.int32)
        self.num_seen[slot] = len(seen)
        self.recent[slot] = tail
        self.output_lens[slot] = len(output)

    def record(self, slots: torch.Tensor, sampled: torch.Tensor, rows: torch.Tensor) -> None:
        """Append one sampled token per slot (distinct slots), sampled[rows[i]] to slots[i], on the device (one
        kernel on CUDA). A token new to the slot joins its seen list (every token is written past the list's end;
        only a new one extends it)."""
        if _use_kernel(sampled):
            from nanovllm.kernels.logit_controls import record_history
            record_history(sampled, rows, slots, self.output_counts, self.prompt_mask, self.seen_tokens,
                           self.num_seen, self.recent, self.output_lens)
            return
        token_ids = sampled.index_select(0, rows)
        new = (self.output_counts[slots, token_ids] == 0) & ~self.prompt_mask[slots, token_ids]
        self.seen_tokens[slots, self.num_seen[slots].long()] = token_ids.to(torch.int32)
        self.num_seen[slots] += new.to(torch.int32)
        self.output_counts.index_put_((slots, token_ids), torch.ones_like(token_ids, dtype=torch.int32),
                                      accumulate=True)
        self.recent[slots] = torch.cat([self.recent[slots, 1:], token_ids.unsqueeze(1)], dim=1)
        self.output_lens[slots] += 1


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, history: TokenHistory,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> None:
    """rows [n]: batch rows with penalties, slots [n]: their history slots, penalties float32 [n].

    Repetition (HF / CTRL): a token seen in the prompt or the output has a positive logit divided by the penalty,
    a negative one multiplied. Then OpenAI's formula over output tokens: logit -= frequency * count +
    presence * (count > 0). Only each row's seen tokens change, and only they are touched (a kernel on CUDA; the
    same operations in torch elsewhere)."""
    _check_float32(logits)
    if _use_kernel(logits):
        from nanovllm.kernels.penalties import apply_history_penalties
        apply_history_penalties(logits, rows, slots, repetition, presence, frequency, history.seen_tokens,
                                history.num_seen, history.output_counts)
        return
    lengths = history.num_seen[slots].long()
    width = int(lengths.max()) if len(lengths) else 0
    listed = torch.arange(width, device=logits.device) < lengths.unsqueeze(1)
    which = listed.nonzero(as_tuple=True)[0]  # the penalised row of each listed token
    tokens = history.seen_tokens[slots, :width][listed].long()
    counts = history.output_counts[slots[which], tokens]
    values = logits[rows[which], tokens]
    penalty = repetition[which]
    values = torch.where(values > 0, values / penalty, values * penalty)
    values -= frequency[which] * counts + presence[which] * (counts > 0)
    logits[rows[which], tokens] = values


def apply_logit_bias(logits: torch.Tensor, batch_index: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     biases: torch.Tensor) -> None:
    """Entries (persistent row, token, float32 bias), a row's tokens distinct (dict keys): bias added to the
    logit. `batch_index` maps persistent rows to batch rows (`batch_index_of`; -1: the entry does nothing), as in
    every sparse control below."""
    _check_float32(logits)
    if _use_kernel(logits):
        from nanovllm.kernels.logit_controls import add_logit_bias
        add_logit_bias(logits, batch_index, rows, token_ids, biases)
        return
    rows, token_ids, biases = _in_step(batch_index, rows, token_ids, biases)
    logits.index_put_((rows, token_ids), biases, accumulate=True)


def allowed_bitmask(token_ids: Sequence[int], vocab_size: int) -> np.ndarray:
    """A row's allowed_token_ids as a bitmask row in kernels/token_bitmask.py's layout (int32 words, bit t % 32 of
    word t // 32 set for each allowed token t)."""
    from nanovllm.kernels.token_bitmask import bitmask_width
    ids = np.asarray(token_ids, dtype=np.int64)
    words = np.zeros(bitmask_width(vocab_size), dtype=np.uint32)
    np.bitwise_or.at(words, ids // 32, np.left_shift(np.uint32(1), (ids % 32).astype(np.uint32)))
    return words.view(np.int32)


def apply_allowed_tokens(logits: torch.Tensor, batch_index: torch.Tensor, allowed_rows: torch.Tensor,
                         bitmask: torch.Tensor) -> None:
    """Persistent rows allowing only some tokens (allowed_rows bool [r]; bitmask int32 [r, words], row i from
    `allowed_bitmask`): in the batch row of each that the step holds, every token its bitmask leaves out gets
    -inf, as a structured output's mask does (on CUDA the mask kernel, whose programs for the other rows return
    at once)."""
    from nanovllm.kernels.token_bitmask import apply_token_bitmask_torch, apply_token_bitmask_triton
    _check_float32(logits)
    apply = apply_token_bitmask_triton if _use_kernel(logits) else apply_token_bitmask_torch
    apply(logits, bitmask, torch.where(allowed_rows, batch_index[:len(allowed_rows)], -1))


def _ban_where(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor, ban: torch.Tensor) -> None:
    """-inf where `ban`, and nothing written elsewhere: entries repeating a (row, token) with different verdicts
    ban it."""
    logits[rows[ban], token_ids[ban]] = float("-inf")


def apply_min_tokens(logits: torch.Tensor, batch_index: torch.Tensor, rows: torch.Tensor, stop_ids: torch.Tensor,
                     min_tokens: torch.Tensor, output_lens: torch.Tensor) -> None:
    """Entries (persistent row, stop token id — EOS and the request's stop_token_ids —, the row's min_tokens): the
    token is banned while the row's output length (output_lens [batch], e.g. SamplingTensors.sample_positions)
    is below min_tokens."""
    _check_float32(logits)
    if _use_kernel(logits):
        from nanovllm.kernels.logit_controls import ban_until_min_tokens
        ban_until_min_tokens(logits, batch_index, rows, stop_ids, min_tokens, output_lens)
        return
    rows, stop_ids, min_tokens = _in_step(batch_index, rows, stop_ids, min_tokens)
    _ban_where(logits, rows, stop_ids, output_lens[rows] < min_tokens)


def pack_bad_words(bad_words: list[list[int]], window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's bad words (token sequences) -> (prefixes int64 [m, window] right-aligned, -1 padded; banned
    last tokens int64 [m]). A word longer than window + 1 tokens is an error naming the field."""
    prefixes = torch.full((len(bad_words), window), -1, dtype=torch.int64)
    last = torch.empty(len(bad_words), dtype=torch.int64)
    for index, word in enumerate(bad_words):
        if not word or len(word) - 1 > window:
            raise ValueError(f"bad_words: each word must have 1 to {window + 1} tokens, got {len(word)}")
        if len(word) > 1:
            prefixes[index, window - len(word) + 1:] = torch.tensor(word[:-1])
        last[index] = word[-1]
    return prefixes, last


def apply_bad_words(logits: torch.Tensor, batch_index: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                    prefixes: torch.Tensor, banned: torch.Tensor, history: TokenHistory) -> None:
    """Entries (persistent row, slot, prefix, banned token) from `pack_bad_words`: the banned token gets -inf when
    the row's output ends with the prefix (always for a one-token word). As vLLM, the prompt is not part of the
    match."""
    _check_float32(logits)
    if prefixes.shape[1] != history.window:
        raise ValueError(f"bad_words prefixes have width {prefixes.shape[1]}, the history window is "
                         f"{history.window}")
    if _use_kernel(logits):
        from nanovllm.kernels.logit_controls import ban_bad_words
        ban_bad_words(logits, batch_index, rows, slots, prefixes, banned, history.recent)
        return
    rows, slots, prefixes, banned = _in_step(batch_index, rows, slots, prefixes, banned)
    recent = history.recent[slots]
    match = ((recent == prefixes) | (prefixes < 0)).all(dim=1)
    _ban_where(logits, rows, banned, match)


def warm_up_controls(logits: torch.Tensor) -> None:
    """Run the history update and every control once on float32 `logits` [n >= 3, vocab] (in place), so that
    their kernels compile at engine start rather than in the first step that needs them. Batch rows 0, ..., n - 1
    are persistent rows n, ..., 1; each sparse control also has an entry of persistent row 0, not in the batch."""
    device = logits.device
    n = len(logits)

    def ids(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    history = TokenHistory.allocate(2, logits.shape[1], HISTORY_WINDOW, device)
    history.reset(0, [1, 2, 3], [2])
    history.record(ids(0, 1), ids(*range(3, 3 + n)), ids(0, 1))  # slot 0's output ends with 2, 3
    index = batch_index_of(torch.arange(n, 0, -1, device=device), n + 1)
    allowing = torch.zeros(n + 1, dtype=torch.bool, device=device)
    allowing[[0, n]] = True
    bitmask = torch.from_numpy(np.stack([allowed_bitmask(tokens, logits.shape[1]) for tokens in
                                         ([9], *([5, 6, 7],) * n)])).to(device)
    apply_allowed_tokens(logits, index, allowing, bitmask)
    prefixes, banned = pack_bad_words([[2, 3, 9], [8]], HISTORY_WINDOW)
    apply_bad_words(logits, index, ids(n - 1, 0), ids(0, 0), prefixes.to(device), banned.to(device), history)
    apply_min_tokens(logits, index, ids(n - 2, 0), ids(11, 11), ids(5, 5), torch.arange(n, device=device))
    apply_logit_bias(logits, index, ids(n, 0), ids(5, 12), torch.tensor([1.5, 2.0], device=device))
    apply_penalties(logits, ids(1, 0), ids(0, 1), history, torch.full((2,), 1.3, device=device),
                    torch.full((2,), 0.5, device=device), torch.full((2,), 0.2, device=device))
