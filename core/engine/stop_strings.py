from __future__ import annotations

from nanovllm.engine.sequence import Sequence


class StopStringDetector:
    """Detokenizes the output of sequences that have stop strings, a few tokens at a time, and finds the stops.

    Decoding a window that starts a few tokens back keeps word boundaries right; text is released only once it
    no longer ends in an incomplete UTF-8 character."""

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.state: dict[int, tuple[str, int, int]] = {}  # seq_id -> (text so far, prefix offset, read offset)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def check(self, seq: Sequence) -> tuple[str, str] | None:
        """Advance `seq`'s text by its newest tokens; when a stop string appeared, (the text before it, the stop
        string)."""
        text, prefix, read = self.state.get(
            seq.seq_id, ("", max(seq.num_prompt_tokens - self.CONTEXT_TOKENS, 0), seq.num_prompt_tokens))
        ids = seq.token_ids
        stop_at = stop_found = None
        skip = seq.params.skip_special_tokens
        before = self._decode(ids[prefix:read], skip)
        after = self._decode(ids[prefix:], skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            new_text = after[len(before):]
            searched_from = len(text)
            text += new_text
            prefix, read = read, len(ids)
            for stop in seq.params.stop:
                index = text.find(stop, max(searched_from - len(stop) + 1, 0))
                if index >= 0 and (stop_at is None or index < stop_at):
                    stop_at, stop_found = index, stop
        self.state[seq.seq_id] = (text, prefix, read)
        return None if stop_at is None else (text[:stop_at], stop_found)

    def forget(self, seq: Sequence) -> None:
        self.state.pop(seq.seq_id, None)
