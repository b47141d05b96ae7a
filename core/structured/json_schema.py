"""The JSON-schema features a grammar enforces exactly, and the rewrites that make xgrammar enforce them exactly.

xgrammar compiles most of JSON Schema, but it ignores some keywords (`uniqueItems`, `contains`, `multipleOf` on
numbers, a length beside a `pattern` or `format`, unknown formats) and enforces others loosely (`oneOf` as
`anyOf`, an `allOf` of several schemas) and its format rules loosely (see FORMAT_PATTERNS). An output that is
complete under a looser grammar may not validate, so
`prepare_schema` rejects each of those by name and place (`UnsupportedSchema`), and passes on only schemas whose
every complete output validates (tests/test_structured_property.py checks that with `jsonschema`).

Two rewrites. A string's `pattern` becomes a placeholder, whose rules `json_pattern.splice_patterns` writes into
the grammar (xgrammar's own pattern rule accepts strings the pattern does not match). A string's
`minLength`/`maxLength` (no pattern, no format) becomes the pattern `^.{min,max}$`, left to xgrammar's rule.
xgrammar's own rule for a length-bounded string lets raw control characters (U+0000-U+001F but CR and LF) into the
string, which is not JSON, and it makes every fill near the bound check most of the vocabulary (a row's fill takes
milliseconds instead of tens of microseconds). The pattern's `.` is one character that needs no JSON escape (no
quote, backslash or control character), so the output is valid JSON and its value has the right length. Above
`PATTERN_MAX_LENGTH` characters xgrammar stops precomputing the pattern's masks (fills of tens of milliseconds), so
longer bounds keep xgrammar's rule, with its character class corrected in the grammar text (`fix_string_class`)."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from nanovllm.structured.json_pattern import PLACEHOLDER

# Keywords that only describe (JSON Schema annotations); a grammar ignores them, and so does validation.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                         "readOnly", "writeOnly", "discriminator"})
# Container of named subschemas for $ref.
DEFINITIONS = ("$defs", "definitions")
TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
# String formats, each as the pattern that decides it exactly (RFC 3339 dates and times with a valid day of the
# month, leap years included, and an upper-case T and Z; RFC 4122 UUIDs; dotted-quad IPv4 without leading zeros,
# which validators read as octal). xgrammar's own format rules are looser (leading zeros, 30 February), and it
# would read any other format as a plain string.
_YEAR = "([1-9][0-9]{3}|0[1-9][0-9]{2}|00[1-9][0-9]|000[1-9])"
_LEAP_YEAR = "([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_MONTH_DAY = "((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_DATE = f"({_YEAR}-{_MONTH_DAY}|{_LEAP_YEAR}-02-29)"
_TIME = "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
_BYTE = "(25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_HEX = "[0-9a-fA-F]"
FORMAT_PATTERNS = {
    "date": f"^{_DATE}$",
    "time": f"^{_TIME}$",
    "date-time": f"^{_DATE}T{_TIME}$",
    "uuid": f"^{_HEX}{{8}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{4}}-{_HEX}{{12}}$",
    "ipv4": f"^{_BYTE}(\\.{_BYTE}){{3}}$",
}
# Up to this bound a length-bounded string is compiled as a pattern (see the module docstring).
PATTERN_MAX_LENGTH = 100
_SUPPORTED = frozenset({
    "type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", *DEFINITIONS,
    "properties", "required", "additionalProperties",
    "items", "prefixItems", "minItems", "maxItems",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "pattern", "format", "minLength", "maxLength",
})
_WHY_NOT = {
    "uniqueItems": "xgrammar ignores it",
    "contains": "xgrammar ignores it",
    "minContains": "xgrammar ignores it",
    "maxContains": "xgrammar ignores it",
    "multipleOf": "xgrammar ignores it on numbers",
    "nullable": "it is OpenAPI, not JSON Schema; use \"type\": [..., \"null\"]",
}


class UnsupportedSchema(ValueError):
    """A schema (or part of one) that no grammar would enforce exactly; the message names the keyword and where."""


@dataclass
class PreparedSchema:
    schema: dict  # what xgrammar compiles
    patterns: list[str]  # the string patterns, replaced by PLACEHOLDER.format(index): json_pattern.splice_patterns
    long_strings: bool  # a string length above PATTERN_MAX_LENGTH: its grammar text needs fix_string_class

    @property
    def needs_grammar_text(self) -> bool:
        return bool(self.patterns) or self.long_strings


def prepare_schema(schema: dict) -> PreparedSchema:
    """A copy of `schema` rewritten as the module says. Raises UnsupportedSchema naming the first unsupported
    keyword and where it is."""
    prepared = copy.deepcopy(schema)
    walker = _Walker(prepared)
    walker.visit(prepared, "")
    return PreparedSchema(prepared, walker.patterns, walker.long_strings)


# xgrammar's character class for a length-bounded string (raw control characters allowed), and the class of its
# unbounded JSON string: no control character, quote or backslash.
_LOOSE_CLASS = r'[^\"\\\r\n]'
_JSON_CLASS = r'[^\0-\x1f\"\\]'


def fix_string_class(grammar_text: str) -> str:
    """xgrammar's grammar text of a schema with length-bounded strings, with their character class corrected; the
    text must hold that class (else xgrammar changed, and the correction would silently not apply)."""
    if _LOOSE_CLASS not in grammar_text:
        raise UnsupportedSchema("a string's minLength/maxLength above "
                                f"{PATTERN_MAX_LENGTH}: this xgrammar's rule for it is not the one nanovllm corrects; "
                                f"lower the bound to {PATTERN_MAX_LENGTH} or less")
    return grammar_text.replace(_LOOSE_CLASS, _JSON_CLASS)


def _where(path: str) -> str:
    return f"at {path}" if path else "at the top level"


class _Walker:
    def __init__(self, root: dict):
        self.root = root
        self.long_strings = False
        self.patterns: list[str] = []

    def visit(self, schema: Any, path: str) -> None:
        if isinstance(schema, bool):
            return
        if not isinstance(schema, dict):
            raise UnsupportedSchema(f"{_where(path)}: a schema must be an object or a boolean, got {schema!r}")
        for keyword in schema:
            if keyword in _SUPPORTED or keyword in ANNOTATIONS:
                continue
            why = _WHY_NOT.get(keyword, "it is not enforced by the grammar")
            raise UnsupportedSchema(f"unsupported keyword {keyword!r} {_where(path)} ({why}); remove it")
        self._check_type(schema, path)
        self._check_numbers(schema, path)
        self._check_string(schema, path)
        self._check_combinations(schema, path)
        if "$ref" in schema:
            ref = schema["$ref"]
            if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
                raise UnsupportedSchema(f"$ref {ref!r} {_where(path)}: only references inside the schema (\"#/...\") "
                                        "are supported")
        for name in DEFINITIONS:
            for key, sub in _mapping(schema, name, path).items():
                self.visit(sub, f"{path}/{name}/{key}")
        for key, sub in _mapping(schema, "properties", path).items():
            self.visit(sub, f"{path}/properties/{key}")
        if isinstance(schema.get("additionalProperties"), dict):
            self.visit(schema["additionalProperties"], f"{path}/additionalProperties")
        if "items" in schema:
            if isinstance(schema["items"], list):
                raise UnsupportedSchema(f"\"items\" as a list {_where(path)}: use \"prefixItems\"")
            self.visit(schema["items"], f"{path}/items")
        for i, sub in enumerate(schema.get("prefixItems") or []):
            self.visit(sub, f"{path}/prefixItems/{i}")
        for name in ("anyOf", "oneOf", "allOf"):
            for i, sub in enumerate(schema.get(name) or []):
                self.visit(sub, f"{path}/{name}/{i}")

    @staticmethod
    def _check_type(schema: dict, path: str) -> None:
        kinds = schema.get("type")
        if kinds is None:
            return
        listed = kinds if isinstance(kinds, list) else [kinds]
        unknown = [k for k in listed if k not in TYPES]
        if unknown or not listed:
            raise UnsupportedSchema(f"\"type\": {kinds!r} {_where(path)}: each type must be one of "
                                    f"{', '.join(sorted(TYPES))}")

    @staticmethod
    def _check_numbers(schema: dict, path: str) -> None:
        for name in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            value = schema.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise UnsupportedSchema(f"{name}={value!r} {_where(path)}: must be a number (a boolean "
                                        "exclusiveMinimum/exclusiveMaximum is draft 4: give the bound itself)")

    def _check_string(self, schema: dict, path: str) -> None:
        lengths = [name for name in ("minLength", "maxLength") if name in schema]
        fmt = schema.get("format")
        if fmt is not None:
            if fmt not in FORMAT_PATTERNS:
                raise UnsupportedSchema(f"format {fmt!r} {_where(path)} is not enforced exactly (supported: "
                                        f"{', '.join(sorted(FORMAT_PATTERNS))}); drop it or give a pattern")
            for other in ("pattern", *lengths):
                if other in schema:
                    raise UnsupportedSchema(f"format together with {other} {_where(path)}: a grammar enforces one of "
                                            "them; put both into one pattern")
            schema["pattern"] = FORMAT_PATTERNS[schema.pop("format")]
        if "pattern" in schema:
            if not isinstance(schema["pattern"], str):
                raise UnsupportedSchema(f"pattern={schema['pattern']!r} {_where(path)}: must be a string")
            self.patterns.append(schema["pattern"])
            schema["pattern"] = PLACEHOLDER.format(len(self.patterns) - 1)
        if not lengths:
            return
        for name in lengths:
            value = schema[name]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise UnsupportedSchema(f"{name}={value!r} {_where(path)}: must be a non-negative integer")
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if high is not None and low > high:
            raise UnsupportedSchema(f"minLength {low} > maxLength {high} {_where(path)}")
        if "pattern" in schema:
            raise UnsupportedSchema(f"{' and '.join(lengths)} together with pattern {_where(path)}: xgrammar would "
                                    "ignore the length; put the length into the pattern (e.g. ^[a-z]{1,20}$)")
        if high is not None and high > PATTERN_MAX_LENGTH:
            self.long_strings = True
            return
        for name in lengths:
            del schema[name]
        schema["pattern"] = f"^.{{{low},{'' if high is None else high}}}$"

    def _check_combinations(self, schema: dict, path: str) -> None:
        for name in ("anyOf", "oneOf", "allOf"):
            if name in schema and (not isinstance(schema[name], list) or not schema[name]):
                raise UnsupportedSchema(f"{name} {_where(path)}: must be a non-empty list of schemas")
        if len(schema.get("allOf") or []) > 1:
            raise UnsupportedSchema(f"allOf of {len(schema['allOf'])} schemas {_where(path)}: xgrammar does not "
                                    "intersect schemas; merge them into one")
        branches = schema.get("oneOf")
        if branches and len(branches) > 1 and not self._disjoint(branches):
            raise UnsupportedSchema(f"oneOf {_where(path)} whose branches may overlap: xgrammar enforces it as "
                                    "anyOf; use anyOf, or make the branches exclusive (different types, or a "
                                    "required property with a different const in each)")

    def _disjoint(self, branches: list) -> bool:
        """Whether no value can match two branches: each has a single type, all different (integer counts as a
        number), or all are objects with one required property that each gives a different const or enum."""
        resolved = [self._resolve(b) for b in branches]
        if not all(isinstance(b, dict) for b in resolved):
            return False
        kinds = [b.get("type") for b in resolved]
        if all(isinstance(k, str) for k in kinds):
            numeric = {"integer", "number"}
            widened = ["number" if k in numeric else k for k in kinds]
            if len(set(widened)) == len(widened):
                return True
        common = set.intersection(*(set(b.get("required") or ()) for b in resolved))
        for key in common:
            values = []
            for b in resolved:
                prop = self._resolve((b.get("properties") or {}).get(key))
                if not isinstance(prop, dict):
                    break
                allowed = [prop["const"]] if "const" in prop else prop.get("enum")
                if not isinstance(allowed, list):
                    break
                values.append({repr(v) for v in allowed})
            else:
                if sum(len(v) for v in values) == len(set().union(*values)):
                    return True
        return False

    def _resolve(self, schema: Any) -> Any:
        """A local $ref followed (a few levels), for the disjointness check."""
        for _ in range(8):
            if not isinstance(schema, dict) or set(schema) - ANNOTATIONS != {"$ref"}:
                return schema
            target: Any = self.root
            for part in schema["$ref"].lstrip("#").split("/")[1:]:
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    return None
                target = target[part]
            schema = target
        return schema


def _mapping(schema: dict, name: str, path: str) -> dict:
    value = schema.get(name, {})
    if not isinstance(value, dict):
        raise UnsupportedSchema(f"{name} {_where(path)}: must be an object")
    return value
