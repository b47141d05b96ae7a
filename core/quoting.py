"""How an error message quotes a value it refuses: a bounded prefix of its repr, so that a huge value (a megabyte
of `logit_bias`, a hundred thousand choices) makes a short message, on stderr and in its error record alike."""
from __future__ import annotations

QUOTE_LIMIT = 80  # characters of the repr


def cut(text: str, limit: int = QUOTE_LIMIT) -> str:
    """`text`, or its first `limit` characters and how long it is."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def quoted(value: object, limit: int = QUOTE_LIMIT) -> str:
    """`repr(value)`, cut to `limit` characters."""
    return cut(repr(value), limit)
