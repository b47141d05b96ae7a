"""A JSON-schema string `pattern` as grammar rules whose every match is a JSON string body with a matching value.

xgrammar compiles a schema's pattern with its own `Regex(..., json_string=true)` rule, which accepts strings the
pattern does not match (`^a{0,4}( b{0,4})?$` accepts "aaaab"). Its regex-to-grammar conversion (the one behind
`Grammar.from_regex`, and the `regex` constraint) gets them right, but knows nothing of JSON: a character the
pattern allows may need an escape in a JSON string (quote, backslash, control characters). So each pattern is
converted by `Grammar.from_regex`, and every character element of the result is made JSON-safe: a character that
needs an escape is written as its escape (`"` as `\\"`, a newline as `\\n`, U+0011 as `\\u0011`), so the string's
decoded value matches the pattern exactly. `splice_patterns` puts these rules where xgrammar's schema grammar
refers to each pattern (by a placeholder pattern that `json_schema.prepare_schema` left there)."""
from __future__ import annotations

import re

PLACEHOLDER = "^nvpattern{}$"
_FORBIDDEN = frozenset([*range(0x20), 0x22, 0x5C])  # characters a JSON string holds only as escapes
_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "\\b", 0x0C: "\\f", 0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
# xgrammar's grammar text: string literals, character classes, rule names, anything else one character at a time.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[A-Za-z_][A-Za-z0-9_]*|\s+|.', re.S)
_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "0": 0x00, "b": 0x08}


def splice_patterns(grammar_text: str, patterns: list[str]) -> str:
    """`grammar_text` (xgrammar's grammar of a schema whose k-th pattern was replaced by PLACEHOLDER.format(k))
    with each placeholder's rule replaced by JSON-safe rules of `patterns[k]`."""
    from nanovllm.structured.regex import python_regex

    parts = [grammar_text]
    for k, pattern in enumerate(patterns):
        call = f'Regex("{PLACEHOLDER.format(k)}", json_string=true)'
        if call not in parts[0]:
            raise ValueError(f"pattern {pattern!r}: xgrammar's grammar of the schema does not hold it where expected")
        name = f"nv_pattern_{k}"
        parts[0] = parts[0].replace(call, name)
        parts.append(_json_safe_rules(python_regex(pattern), name))
    return "\n".join(parts)


def _json_safe_rules(pattern: str, name: str) -> str:
    import xgrammar as xgr

    rules = str(xgr.Grammar.from_regex(pattern))
    out = []
    for token in _TOKEN.findall(rules):
        if token == "root" or token.startswith("root_"):
            out.append(name + token[4:])
        elif token.startswith('"') and len(token) > 1:
            out.append(_literal([point for point, _ in _decode(token[1:-1])]))
        elif token.startswith("[") and len(token) > 1:
            out.append(_char_class(token))
        else:
            out.append(token)
    return "".join(out)


def _decode(body: str) -> list[tuple[int, bool]]:
    """The code points of a literal's or class's body, escapes resolved, each with whether it was escaped."""
    points, i = [], 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            points.append((ord(ch), False))
            i += 1
            continue
        kind = body[i + 1]
        digits = {"x": 2, "u": 4, "U": 8}.get(kind)
        if digits:
            points.append((int(body[i + 2:i + 2 + digits], 16), True))
            i += 2 + digits
        else:
            points.append((_ESCAPES.get(kind, ord(kind)), True))
            i += 2
    return points


def _encode(point: int) -> str:
    """One code point inside a literal or class of xgrammar's grammar text."""
    ch = chr(point)
    if ch.isascii() and ch.isalnum():
        return ch
    return f"\\u{point:04x}" if point <= 0xFFFF else f"\\U{point:08x}"


def _json_text(point: int) -> str:
    """How a JSON string holds one character."""
    if point not in _FORBIDDEN:
        return chr(point)
    return _SHORT_ESCAPES.get(point, f"\\u{point:04x}")


def _literal(points: list[int]) -> str:
    return '"' + "".join(_encode(ord(c)) for p in points for c in _json_text(p)) + '"'


def _char_class(token: str) -> str:
    """A class as JSON-safe grammar: its characters that need no escape as a class, the others as escapes."""
    body = token[1:-1]
    negated = body.startswith("^")
    points = _decode(body[1:] if negated else body)
    ranges, i = [], 0
    while i < len(points):  # `a-z`: an unescaped dash between two members
        if i + 2 < len(points) and points[i + 1] == (ord("-"), False):
            ranges.append((points[i][0], points[i + 2][0]))
            i += 3
        else:
            ranges.append((points[i][0], points[i][0]))
            i += 1

    def member(point: int) -> bool:
        return any(low <= point <= high for low, high in ranges) != negated

    escaped = sorted(p for p in _FORBIDDEN if member(p))
    if negated:  # the class without the escaped characters: also exclude every character that needs an escape
        excluded = ranges + [(p, p) for p in sorted(_FORBIDDEN)]
        plain = "[^" + "".join(_range_text(low, high) for low, high in excluded) + "]"
        has_plain = True
    else:
        kept = [r for low, high in ranges for r in _without_forbidden(low, high)]
        plain = "[" + "".join(_range_text(low, high) for low, high in kept) + "]"
        has_plain = bool(kept)
    choices = ([plain] if has_plain else []) + [_literal([p]) for p in escaped]
    return choices[0] if len(choices) == 1 else "(" + " | ".join(choices) + ")"


def _without_forbidden(low: int, high: int) -> list[tuple[int, int]]:
    pieces, start = [], low
    for point in range(low, min(high, 0x5C) + 1):
        if point in _FORBIDDEN:
            if start < point:
                pieces.append((start, point - 1))
            start = point + 1
    if start <= high:
        pieces.append((start, high))
    return pieces


def _range_text(low: int, high: int) -> str:
    return _encode(low) if low == high else f"{_encode(low)}-{_encode(high)}"
