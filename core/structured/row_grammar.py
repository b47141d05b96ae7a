"""One output row's place in its grammar: which tokens may come next, and whether the row has ended."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from nanovllm.structured.compile_cache import CompiledConstraint


def clear_bits_past(bitmask: torch.Tensor, vocab_size: int) -> None:
    """Zero the bits of ids >= `vocab_size` in the last word of each row of `bitmask` (xgrammar may leave them
    set), so that no id past the grammar's vocabulary is allowed."""
    if vocab_size % 32:
        bitmask[:, vocab_size // 32] &= (1 << vocab_size % 32) - 1


class RowGrammar:
    """An xgrammar matcher for one row. While the grammar is incomplete its bitmask allows only tokens that keep
    the output a valid prefix; once complete, it also allows the stop tokens (EOS and the row's stop ids), and
    once nothing can follow, only them. Accepting a stop token terminates the row: it finishes with "stop".

    `slot` and `mask_at` belong to the GrammarManager: the row's line in its host mask tables, and (step mask
    number, slot) of the last mask written there for the row's current place."""

    __slots__ = ("compiled", "mask_vocab_size", "_matcher", "stop_token_ids", "num_accepted", "rejected_token",
                 "slot", "mask_at")

    def __init__(self, compiled: CompiledConstraint, stop_token_ids: Sequence[int]):
        self.compiled = compiled
        self.mask_vocab_size = compiled.vocabulary.mask_vocab_size  # ids past it are never allowed
        # a stop id past the tokenizer's ids can never be sampled in a constrained row
        stop = sorted({t for t in stop_token_ids if t < self.mask_vocab_size})
        if not stop:
            raise ValueError("a constrained row needs at least one stop token id (EOS) to end on")
        self._matcher = xgr.GrammarMatcher(compiled.grammar, override_stop_tokens=stop)
        self.stop_token_ids = tuple(stop)
        self.num_accepted = 0
        self.rejected_token: int | None = None  # the last token `accept` refused (the mask allows none: a bug)
        self.slot: int | None = None
        self.mask_at: tuple[int, int] | None = None

    def fork(self) -> RowGrammar:
        """An independent copy at the same place (its own slot, none yet)."""
        twin = object.__new__(RowGrammar)
        twin.compiled = self.compiled
        twin.mask_vocab_size = self.mask_vocab_size
        twin._matcher = self._matcher.fork()
        twin.stop_token_ids = self.stop_token_ids
        twin.num_accepted = self.num_accepted
        twin.rejected_token = self.rejected_token
        twin.slot = twin.mask_at = None
        return twin

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged, the token kept as `rejected_token`) if the grammar
        does not allow it here."""
        return self.note_accepted(token_id, self._matcher.accept_token(token_id))

    def note_accepted(self, token_id: int, accepted: bool) -> bool:
        """Count a token the matcher was given (one by one or in a batch)."""
        if accepted:
            self.num_accepted += 1
        else:
            self.rejected_token = token_id
        return accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (host int32 of `mask_vocab_size` bits, the layout of
        nanovllm.kernels.token_bitmask); a terminated row allows every token, since its sample is discarded."""
        if self._matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)
        clear_bits_past(bitmask[row:row + 1], self.mask_vocab_size)

    def is_terminated(self) -> bool:
        """A stop token was accepted: the row is done, with finish reason "stop"."""
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The output so far is a complete match (a stop token may come next)."""
        return self._matcher.is_completed()

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (a discarded speculative or in-flight step)."""
        if not 0 <= num_tokens <= self.num_accepted:
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.num_accepted} accepted")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens
            self.mask_at = None

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        """The underlying matcher (for a batched fill)."""
        return self._matcher
