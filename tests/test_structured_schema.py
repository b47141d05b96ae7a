"""Which JSON-schema features nanovllm passes to xgrammar, and its rewrites of string lengths and patterns (pure
Python: no compile). That the grammars then enforce them exactly is tests/test_structured_property.py's job."""
import pytest

from nanovllm.structured.json_schema import (
    PATTERN_MAX_LENGTH,
    UnsupportedSchema,
    fix_string_class,
    prepare_schema,
)


def test_string_lengths_become_a_pattern_of_json_safe_characters():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "minLength": 2, "maxLength": 20, "description": "kept"},
        "b": {"type": "string", "minLength": 1},
        "c": {"type": "string", "maxLength": PATTERN_MAX_LENGTH + 1},
        "d": {"type": "array", "items": {"type": "string", "maxLength": 3}}}}
    prepared = prepare_schema(schema)
    props = prepared.schema["properties"]
    assert props["a"] == {"type": "string", "pattern": "^.{2,20}$", "description": "kept"}
    assert props["b"] == {"type": "string", "pattern": "^.{1,}$"}
    assert props["c"] == {"type": "string", "maxLength": PATTERN_MAX_LENGTH + 1}  # xgrammar's rule, corrected
    assert props["d"]["items"] == {"type": "string", "pattern": "^.{0,3}$"}
    assert prepared.long_strings and prepared.patterns == []
    assert schema["properties"]["a"]["maxLength"] == 20  # the caller's schema is left alone
    assert not prepare_schema({"type": "string", "maxLength": 5}).needs_grammar_text


def test_patterns_are_left_to_the_grammar_text_by_placeholder():
    schema = {"type": "array", "prefixItems": [{"type": "string", "pattern": "^a+$"}],
              "items": {"type": "string", "pattern": "b?", "description": "kept"}}
    prepared = prepare_schema(schema)
    assert set(prepared.patterns) == {"^a+$", "b?"} and prepared.needs_grammar_text and not prepared.long_strings
    first, items = prepared.schema["prefixItems"][0], prepared.schema["items"]
    assert prepared.patterns[int(first["pattern"][len("^nvpattern"):-1])] == "^a+$"
    assert prepared.patterns[int(items["pattern"][len("^nvpattern"):-1])] == "b?"
    assert items["description"] == "kept"


def test_the_long_string_class_is_corrected_or_refused():
    assert fix_string_class(r'x ::= [^\"\\\r\n]{0, 200}') == r'x ::= [^\0-\x1f\"\\]{0, 200}'
    with pytest.raises(UnsupportedSchema, match="lower the bound"):
        fix_string_class(r"x ::= [a-z]{0, 200}")


@pytest.mark.parametrize("schema, message", [
    ({"type": "array", "uniqueItems": True}, "unsupported keyword 'uniqueItems' at the top level .*ignores it"),
    ({"type": "array", "contains": {"const": 1}}, "'contains'"),
    ({"type": "number", "multipleOf": 0.5}, "'multipleOf'.*ignores it on numbers"),
    ({"type": "object", "properties": {"a": {"type": "integer", "nullable": True}}},
     r"'nullable' at /properties/a .*OpenAPI"),
    ({"not": {"type": "string"}}, "unsupported keyword 'not'"),
    ({"if": {"type": "integer"}, "then": {"minimum": 1}}, "unsupported keyword 'if'"),
    ({"type": "object", "patternProperties": {"^a": {}}}, "'patternProperties'"),
    ({"type": "object", "minProperties": 1}, "'minProperties'"),
    ({"type": "string", "maxlength": 3}, "unsupported keyword 'maxlength'"),  # a typo is not silently ignored
    ({"type": "strin"}, "each type must be one of"),
    ({"type": "string", "format": "iri"}, "format 'iri' .* is not enforced exactly"),
    ({"type": "string", "format": "email"}, "format 'email' .*supported: date, date-time, ipv4, time, uuid"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength together with pattern .*ignore the length"),
    ({"type": "string", "format": "date", "minLength": 3}, "format together with minLength"),
    ({"type": "string", "format": "uuid", "pattern": "^a"}, "format together with pattern"),
    ({"type": "string", "minLength": 4, "maxLength": 2}, "minLength 4 > maxLength 2"),
    ({"type": "string", "maxLength": -1}, "maxLength=-1 .*non-negative integer"),
    ({"type": "integer", "exclusiveMinimum": True}, "draft 4"),
    ({"allOf": [{"type": "integer"}, {"minimum": 2}]}, "allOf of 2 schemas .*merge them"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf at the top level whose branches may overlap"),
    ({"$ref": "https://example.com/s.json"}, "only references inside the schema"),
    ({"type": "array", "items": [{"type": "integer"}]}, "use \"prefixItems\""),
    ({"type": "object", "properties": {"a": 3}}, "at /properties/a: a schema must be an object or a boolean"),
])
def test_what_no_grammar_enforces_is_refused_by_name_and_place(schema, message):
    with pytest.raises(UnsupportedSchema, match=message):
        prepare_schema(schema)


@pytest.mark.parametrize("branches", [
    [{"type": "string"}, {"type": "integer"}, {"type": "null"}],
    [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["kind"]},
     {"type": "object", "properties": {"kind": {"enum": ["b", "c"]}}, "required": ["kind", "y"]}],
    [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}],  # pydantic's discriminated union
])
def test_one_of_with_exclusive_branches_is_kept(branches):
    defs = {"cat": {"type": "object", "properties": {"pet": {"const": "cat"}}, "required": ["pet"]},
            "dog": {"type": "object", "properties": {"pet": {"const": "dog"}}, "required": ["pet"]}}
    schema = {"$defs": defs, "oneOf": branches, "discriminator": {"propertyName": "pet"}}
    assert prepare_schema(schema).schema["oneOf"] == branches


def test_annotations_and_supported_keywords_pass_unchanged():
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "t", "type": "object",
              "properties": {"n": {"type": ["integer", "null"], "minimum": 0, "exclusiveMaximum": 9, "default": 1},
                             "e": {"enum": ["a", 1, None]}, "c": {"const": "x"},
                             "l": {"type": "array", "prefixItems": [{"type": "boolean"}], "items": {"type": "number"},
                                   "minItems": 1, "maxItems": 4},
                             "any": {"anyOf": [{"type": "boolean"}, {"$ref": "#/$defs/p"}]}},
              "required": ["n"], "additionalProperties": {"type": "integer"}, "$defs": {"p": {"type": "boolean"}}}
    prepared = prepare_schema(schema)
    assert prepared.schema == schema and not prepared.needs_grammar_text


def test_formats_become_patterns_that_decide_them_exactly():
    """The format patterns against Python's own parsers: every day of the calendar (leap years included) and
    dotted quads with leading zeros, which validators reject."""
    import datetime
    import ipaddress
    import re

    from nanovllm.structured.json_schema import FORMAT_PATTERNS

    prepared = prepare_schema({"type": "string", "format": "date"})
    assert "format" not in prepared.schema and prepared.patterns == [FORMAT_PATTERNS["date"]]
    date = re.compile(FORMAT_PATTERNS["date"])
    for year in (1, 4, 100, 400, 1900, 2000, 2023, 2024, 9999):
        for month in range(1, 13):
            for day in range(1, 32):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    valid = bool(datetime.date.fromisoformat(text))
                except ValueError:
                    valid = False
                assert bool(date.fullmatch(text)) == valid, text
    assert not date.fullmatch("0000-01-01")
    ipv4 = re.compile(FORMAT_PATTERNS["ipv4"])
    for text in ["0.0.0.0", "255.255.255.255", "1.2.3.04", "256.1.1.1", "01.1.1.1", "10.0.0.1", "199.99.9.0"]:
        try:
            valid = bool(ipaddress.IPv4Address(text))
        except ValueError:
            valid = False
        assert bool(ipv4.fullmatch(text)) == valid, text
    date_time = re.compile(FORMAT_PATTERNS["date-time"])
    for text, valid in [("2024-02-29T23:59:59.5+01:00", True), ("2023-02-29T00:00:00Z", False),
                        ("2024-01-01T24:00:00Z", False), ("2024-01-01T12:00:00", False)]:
        assert bool(date_time.fullmatch(text)) == valid, text
        if valid:
            datetime.datetime.fromisoformat(text)
