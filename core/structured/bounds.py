"""What one request's constraint may be at most, so that no constraint can hold up the others: xgrammar's compile
time and memory grow with the size of what it compiles (a 100,000-string choice took 74 s and 850 MB, a schema of
10,000 properties 12 s, one nested 500 deep 14 s), and a compile cannot be stopped once started. Each limit is
checked before the compile, and a constraint past one is that request's ValueError naming the limit; what stays
slow within them meets the compile time limit (`compile_cache.COMPILE_TIME_LIMIT_S`).

A JSON schema's `$ref` must point inside the schema ("#" or a JSON pointer "#/..."): a reference to a file or a URL
is never fetched, and one that resolves nowhere is an error rather than "any value"."""
from __future__ import annotations

import re
from urllib.parse import unquote

from nanovllm.quoting import quoted

MAX_CHOICES = 1024  # strings of a `choice`
MAX_CHOICE_CHARS = 1 << 16  # characters of all of them together
MAX_REGEX_CHARS = 1 << 14
MAX_GRAMMAR_CHARS = 1 << 16
MAX_SCHEMA_CHARS = 1 << 18  # of the schema's JSON
MAX_SCHEMA_PROPERTIES = 1024  # properties declared in all the schema's objects together
MAX_SCHEMA_DEPTH = 32  # subschemas inside each other
MAX_SCHEMA_ENUM_VALUES = 1024  # values of all the schema's `enum`s together

# Keywords whose value maps names to subschemas (the map itself is no level of nesting), and keywords whose value is
# data, not a schema.
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})
_DATA = frozenset({"enum", "const", "default", "examples", "required", "$ref", "$comment", "description", "title"})


def check_choices(choices: list[str]) -> str | None:
    """Why a choice list is too large, or None."""
    if len(choices) > MAX_CHOICES:
        return f"{len(choices):,} choices, more than the limit of {MAX_CHOICES:,}"
    chars = sum(map(len, choices))
    if chars > MAX_CHOICE_CHARS:
        return f"{chars:,} characters of choices, more than the limit of {MAX_CHOICE_CHARS:,}"
    return None


def check_text(text: str, limit: int, what: str) -> str | None:
    """Why a regex or grammar is too long, or None."""
    return f"a {what} of {len(text):,} characters, more than the limit of {limit:,}" if len(text) > limit else None


def check_schema(schema: dict, text_chars: int) -> str | None:
    """Why a JSON schema (a dict; its JSON is `text_chars` long) is too large or refers outside itself, or None."""
    if text_chars > MAX_SCHEMA_CHARS:
        return f"a schema of {text_chars:,} characters, more than the limit of {MAX_SCHEMA_CHARS:,}"
    properties = enum_values = deepest = 0
    refs: list[object] = []
    stack: list[tuple[object, int]] = [(schema, 1)]
    while stack:  # iterative: any depth is measured, never a recursion error
        node, depth = stack.pop()
        if isinstance(node, list):
            stack.extend((item, depth) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_SCHEMA_DEPTH:
            return f"subschemas nested more than {MAX_SCHEMA_DEPTH} deep (the limit)"
        for key, value in node.items():
            if key == "$ref":
                refs.append(value)
            elif key == "enum" and isinstance(value, list):
                enum_values += len(value)
            elif key in _DATA:
                continue
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                properties += len(value) if key == "properties" else 0
                stack.extend((sub, depth + 1) for sub in value.values())
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1))
    if properties > MAX_SCHEMA_PROPERTIES:
        return f"{properties:,} properties, more than the limit of {MAX_SCHEMA_PROPERTIES:,}"
    if enum_values > MAX_SCHEMA_ENUM_VALUES:
        return f"{enum_values:,} enum values, more than the limit of {MAX_SCHEMA_ENUM_VALUES:,}"
    for ref in refs:
        problem = _ref_problem(schema, ref)
        if problem:
            return problem
    return None


def _ref_problem(schema: dict, ref: object) -> str | None:
    if not isinstance(ref, str):
        return f"$ref must be a string, not {quoted(ref)}"
    if ref != "#" and not ref.startswith("#/"):
        return (f"$ref {quoted(ref)} points outside the schema: only references inside it (\"#\" or \"#/...\") are "
                "resolved, never files or URLs")
    node: object = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        name = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and name in node:
            node = node[name]
        elif isinstance(node, list) and re.fullmatch("[0-9]{1,9}", name) and int(name) < len(node):
            node = node[int(name)]
        else:
            return f"$ref {quoted(ref)} resolves to nothing in the schema"
    return None
