"""What a request constrains its output to, with vLLM's names, and the OpenAI `response_format` that maps to it."""
from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass, fields
from typing import Any

from nanovllm.quoting import cut, quoted
from nanovllm.structured import bounds

CONSTRAINT_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint: `json` (a JSON schema, as a dict or its JSON text), `json_object` (any JSON
    object), `regex` (the whole output matches it), `choice` (the output is one of these strings) or `grammar`
    (an EBNF grammar in xgrammar's/GBNF syntax with a `root` rule). Every problem is a ValueError naming the field,
    a constraint past one of the size limits of `bounds` too (naming the limit)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"structured_outputs.{name}={quoted(getattr(self, name))}: {why}")

        set_fields = [f.name for f in fields(self) if getattr(self, f.name) not in (None, False)]
        if len(set_fields) != 1:
            raise ValueError(f"structured_outputs: exactly one of {', '.join(CONSTRAINT_FIELDS)} must be set, "
                             f"got {', '.join(set_fields) if set_fields else 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = jsonlib.loads(schema)
                except ValueError as e:
                    raise bad("json", f"not valid JSON text ({e})") from None
            if not isinstance(schema, dict):
                raise bad("json", "must be a JSON schema object (a dict or its JSON text)")
            chars = len(self.json) if isinstance(self.json, str) else len(jsonlib.dumps(schema, ensure_ascii=False))
            too_large = bounds.check_schema(schema, chars)
            if too_large:
                raise bad("json", too_large)
        if not isinstance(self.json_object, bool):
            raise bad("json_object", "must be a boolean")
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise bad("regex", "must be a non-empty string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise bad("choice", "must be a non-empty list of strings")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise bad("choice", "every choice must be a non-empty string")
            object.__setattr__(self, "choice", list(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise bad("grammar", "must be a non-empty EBNF string")
        too_large = (bounds.check_choices(self.choice) if self.choice is not None
                     else bounds.check_text(self.regex, bounds.MAX_REGEX_CHARS, "regex") if self.regex is not None
                     else bounds.check_text(self.grammar, bounds.MAX_GRAMMAR_CHARS, "grammar") if self.grammar is not None
                     else None)
        if too_large:
            raise bad(self.kind, too_large)

    @classmethod
    def from_dict(cls, data: Any) -> StructuredOutputsParams:
        """From a row's `structured_outputs` mapping; unknown keys are rejected by name."""
        if not isinstance(data, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(CONSTRAINT_FIELDS)}")
        unknown = sorted(set(data) - set(CONSTRAINT_FIELDS))
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {cut(', '.join(unknown))} "
                             f"(known: {', '.join(CONSTRAINT_FIELDS)})")
        return cls(**data)

    @property
    def kind(self) -> str:
        return next(name for name in CONSTRAINT_FIELDS if getattr(self, name) not in (None, False))

    def canonical_key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar. A schema is keyed by its JSON without
        whitespace (dict or text, any formatting: one key). Its key order is kept, not sorted: the grammar emits
        properties in the schema's order, so two orders are two different output formats. Computed once per
        instance: rows sharing their params look their grammar up in O(1)."""
        key = self.__dict__.get("_canonical_key")
        if key is None:
            key = self._make_key()
            object.__setattr__(self, "_canonical_key", key)
        return key

    def _make_key(self) -> tuple[str, str]:
        kind = self.kind
        if kind == "json":
            schema = jsonlib.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, jsonlib.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            return kind, jsonlib.dumps(self.choice, ensure_ascii=False)
        return kind, getattr(self, kind)


_RESPONSE_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "schema", "strict", "description"}


def from_response_format(response_format: Any) -> StructuredOutputsParams | None:
    """The constraint of an OpenAI `response_format`; None for `{"type": "text"}`. The schema is always enforced
    in full, which is what `strict: true` asks for and what `strict: false` permits."""
    if not isinstance(response_format, dict):
        raise ValueError("response_format must be an object with a `type`")
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMAT_KEYS:
        raise ValueError(f"response_format.type={quoted(kind)}: must be one of {', '.join(_RESPONSE_FORMAT_KEYS)}")
    unknown = sorted(set(response_format) - _RESPONSE_FORMAT_KEYS[kind])
    if unknown:
        raise ValueError(f"response_format: unknown field(s) {cut(', '.join(unknown))} for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema: must be an object with `name` and `schema`")
    unknown = sorted(set(spec) - _JSON_SCHEMA_KEYS)
    if unknown:
        raise ValueError(f"response_format.json_schema: unknown field(s) {cut(', '.join(unknown))} "
                         f"(known: {', '.join(sorted(_JSON_SCHEMA_KEYS))})")
    if not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ValueError("response_format.json_schema.name: required, a non-empty string")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise ValueError(f"response_format.json_schema.strict={quoted(spec['strict'])}: must be a boolean")
    if "description" in spec and not isinstance(spec["description"], str):
        raise ValueError("response_format.json_schema.description: must be a string")
    if not isinstance(spec.get("schema"), dict):
        raise ValueError("response_format.json_schema.schema: required, a JSON schema object")
    return StructuredOutputsParams(json=spec["schema"])
