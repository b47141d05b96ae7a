"""One output row's place in its grammar: which tokens may come next, and whether the row has ended."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

from nanovllm.structured.vocabulary import clear_bits_past

if TYPE_CHECKING:
    from nanovllm.structured.compile_cache import CompiledConstraint


class RowGrammar:
    """An xgrammar matcher for one row. While the grammar is incomplete its bitmask allows only tokens that keep
    the output a valid prefix; once complete, it also allows the stop tokens (EOS and the row's stop ids), and
    once nothing can follow, only them. Accepting a stop token terminates the row: it finishes with "stop".

    `slot` and `mask_at` belong to the GrammarManager: the row's line in its host mask tables, and (step mask
    number, slot) of the last mask written there for the row's current place."""

    __slots__ = ("compiled", "mask_vocab_size", "_matcher", "stop_token_ids", "num_accepted", "rejected_token",
                 "dead_end", "slot", "mask_at")

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
        self.rejected_token: int | None = None  # the last token the grammar refused
        # Where it was refused, no token at all could follow: the constraint needs text this tokenizer cannot spell
        # (the mask allowed nothing, so the sampler's pick meant nothing); else the refusal is an engine bug.
        self.dead_end = False
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
        twin.dead_end = self.dead_end
        twin.slot = twin.mask_at = None
        return twin

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged, the token kept as `rejected_token`) if the grammar
        does not allow it here."""
        accepted = self._matcher.accept_token(token_id)
        if accepted:
            self.num_accepted += 1
        else:
            self.note_rejected(token_id)
        return accepted

    def note_rejected(self, token_id: int) -> None:
        """The grammar refused `token_id` here (given one by one or in a batch): the row fails, and why."""
        self.rejected_token = token_id
        self.dead_end = not self._allows_some_token()

    def _allows_some_token(self) -> bool:
        bitmask = xgr.allocate_token_bitmask(1, self.mask_vocab_size)
        self.fill_bitmask(bitmask, 0)
        return bool(torch.any(bitmask != 0))

    def rejection(self) -> str:
        """Why the row's output failed its constraint (after `accept` refused a token)."""
        if self.dead_end:
            return ("structured_outputs: no token can continue the output at this point of the constraint: it needs "
                    "text the model's tokenizer cannot produce")
        return f"structured_outputs: the grammar rejected sampled token {self.rejected_token}"

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
