"""Whether a compiled grammar accepts any output at all: a JSON schema whose `$ref` refers only to itself, or an
object that requires itself, compiles to a grammar with no finite match; the sampler would then meet a mask that
allows nothing (or an output that can only go on), which reads as an engine failure. Caught once per compile.

The check is the classic one for a context-free grammar: a rule is productive when one of its alternatives is
made only of terminals and productive rules (an element that may repeat zero times always is), found by fixpoint
over xgrammar's printed EBNF. A printed form this parser does not know is taken as productive (no false alarm).
"""
from __future__ import annotations

import re

_TOKEN = re.compile(r'''\s*(?:(?P<string>"(?:[^"\\]|\\.)*")|(?P<cls>\[(?:[^\]\\]|\\.)*\])|(?P<call>[A-Za-z_]\w*\()'''
                    r'''|(?P<name>[A-Za-z_][\w.-]*)|(?P<repeat>\{\s*\d+\s*,\s*-?\d+\s*\}|\{\s*\d+\s*\})'''
                    r'''|(?P<op>\(=|[()|*+?]))''')


_POSTFIX = (("op", "*"), ("op", "+"), ("op", "?"))


def _least(repeat: str) -> int:
    """The least count of a "{m, n}" or "{m}" repetition."""
    return int(re.match(r"\{\s*(\d+)", repeat).group(1))


class _Unknown(Exception):
    pass


def _tokens(body: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(body):
        if body[pos:].isspace():
            break
        match = _TOKEN.match(body, pos)
        if not match:
            raise _Unknown(body[pos:pos + 20])
        kind = match.lastgroup
        if kind == "call":  # a built-in terminal such as Regex("...", json_string=true): skip to its ")"
            depth, i = 1, match.end()
            while depth:
                if i >= len(body):
                    raise _Unknown("unclosed call")
                if body[i] == '"':
                    i = _TOKEN.match(body, i).end()
                    continue
                depth += {"(": 1, ")": -1}.get(body[i], 0)
                i += 1
            out.append(("terminal", ""))
            pos = i
            continue
        text = match.group(kind)
        out.append(("terminal" if kind in ("string", "cls") else kind, text))
        pos = match.end()
    return out


class _Parser:
    """Alternatives -> sequences -> elements: ("alt", [("seq", [(atom, optional)])]), an atom ("terminal",),
    ("ref", name) or a nested "alt"."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens, self.i = tokens, 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def alternatives(self) -> tuple:
        seqs = [self.sequence()]
        while self.peek() == ("op", "|"):
            self.i += 1
            seqs.append(self.sequence())
        return ("alt", seqs)

    def sequence(self) -> tuple:
        elements = []
        while (token := self.peek()) is not None and token not in (("op", "|"), ("op", ")")):
            elements.append(self.element())
        return ("seq", elements)

    def element(self) -> tuple:
        kind, text = self.tokens[self.i]
        self.i += 1
        if kind == "terminal":
            atom = ("terminal",)
        elif kind == "name":
            atom = ("ref", text)
        elif (kind, text) in (("op", "("), ("op", "(=")):
            inner = self.alternatives()
            if self.peek() != ("op", ")"):
                raise _Unknown("unbalanced")
            self.i += 1
            atom = ("terminal",) if text == "(=" else inner  # a lookahead consumes nothing
        else:
            raise _Unknown(text)
        optional = False  # may occur zero times: then it never makes its sequence unproductive
        while (token := self.peek()) is not None and (token[0] == "repeat" or token in _POSTFIX):
            self.i += 1
            optional |= token[1] in ("*", "?") or (token[0] == "repeat" and _least(token[1]) == 0)
        return (atom, optional)


def _productive(node: tuple, rules: set[str]) -> bool:
    kind = node[0]
    if kind == "terminal":
        return True
    if kind == "ref":
        return node[1] in rules
    if kind == "alt":
        return any(_productive(seq, rules) for seq in node[1])
    return all(optional or _productive(atom, rules) for atom, optional in node[1])  # "seq"


def parse_rules(ebnf: str) -> dict[str, tuple]:
    """xgrammar's printed EBNF (one `name ::= body` per line) as rule name -> body tree; ValueError for a form this
    parser does not know."""
    rules = {}
    try:
        for line in ebnf.splitlines():
            name, sep, body = line.partition(" ::= ")
            if not sep:
                raise _Unknown(line[:20])
            parser = _Parser(_tokens(body))
            rules[name.strip()] = parser.alternatives()
            if parser.peek() is not None:
                raise _Unknown("trailing input")
    except (_Unknown, RecursionError) as exc:
        raise ValueError(f"unknown printed grammar form near {str(exc)!r}") from None
    return rules


def accepts_some_output(ebnf: str, root: str = "root") -> bool:
    """False only when `ebnf` (xgrammar's printed form) certainly has no finite match from `root`."""
    try:
        rules = parse_rules(ebnf)
    except ValueError:
        return True
    productive: set[str] = set()
    grew = True
    while grew:
        grew = False
        for name, body in rules.items():
            if name not in productive and _productive(body, productive):
                productive.add(name)
                grew = True
    return root in productive or root not in rules
