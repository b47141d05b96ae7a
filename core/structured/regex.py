"""A `regex` constraint read as Python's `re.fullmatch` reads it.

xgrammar's `.` also matches a newline; Python's (and JavaScript's) does not. Each `.` outside a character class
becomes `[^\n]`, so an output matches its regex under `re.fullmatch(regex, text)`. The rest of the syntax both
read alike, or xgrammar rejects it (lookarounds, backreferences: a per-request error)."""
from __future__ import annotations


def python_regex(regex: str) -> str:
    """`regex` with every unescaped `.` outside a character class replaced by `[^\\n]`."""
    out = []
    i, in_class, class_start = 0, False, False
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            out.append(regex[i:i + 2])
            i += 2
            continue
        if in_class:
            if ch == "]" and not class_start:
                in_class = False
            class_start = False
        elif ch == "[":
            in_class, class_start = True, True
            if regex.startswith("^", i + 1):  # a leading ^ negates; a "]" right after it is a literal
                out.append("[^")
                i += 2
                continue
        elif ch == ".":
            out.append("[^\\n]")
            i += 1
            continue
        out.append(ch)
        i += 1
    return "".join(out)
