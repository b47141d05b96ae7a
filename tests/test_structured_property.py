"""Property: every output a constrained request returns as complete satisfies its constraint.

Hypothesis generates JSON schemas (types, nesting, enums and consts with quotes, backslashes, newlines and
non-ASCII, string patterns and formats, integer and number bounds, string lengths, array sizes, optional fields,
additionalProperties, anyOf, $ref) and regexes; one engine decodes them all at once (each row its own constraint)
from a tiny random Llama with SmolLM2's tokenizer (`text_model`), sampling at temperature 1 with a logit bias
toward closing punctuation and EOS so that most rows end within max_tokens (the bias is added after the grammar's
mask: it never lets a forbidden token through). Every row whose output is `structured_complete` is checked with
an independent validator: `jsonschema` (formats too), `re.fullmatch`, membership of the choices. The returned
text must also be the exact text of its tokens' bytes (no decode clean-up)."""
import datetime
import json
import re

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm import LLM, SamplingParams

# Characters that need care in JSON (quote, backslash, newline, tab) or in UTF-8 (multi-byte).
TEXT = st.text(alphabet=st.sampled_from(list('abcXYZ 09_-"\\\n\té€')), min_size=1, max_size=6)
NAMES = st.text(alphabet=st.sampled_from(list("abcdexyz_")), min_size=1, max_size=6)
PATTERNS = ["^[a-z]{1,5}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no|maybe)$", "^[A-Z][a-z]{0,4}( [A-Z][a-z]{0,4})?$",
            r"^\d{2}:\d{2}$", "^[^,]{1,6}$", "^.{2,5}$", "^[a-c]+$"]
FORMATS = ["date", "ipv4", "uuid", "time", "date-time"]


def _integer(low, span, exclusive):
    schema = {"type": "integer", "minimum": low, "maximum": low + span}
    if exclusive:
        schema = {"type": "integer", "exclusiveMinimum": low - 1, "exclusiveMaximum": low + span + 1}
    return schema


LEAVES = st.one_of(
    st.builds(_integer, st.integers(-50, 50), st.integers(0, 200), st.booleans()),
    st.builds(lambda low, span: {"type": "number", "minimum": low / 4, "maximum": (low + span) / 4},
              st.integers(-20, 20), st.integers(1, 40)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.one_of(TEXT, st.integers(-5, 5)), min_size=1, max_size=4, unique=True).map(lambda v: {"enum": v}),
    TEXT.map(lambda v: {"const": v}),
    st.builds(lambda low, extra: {"type": "string", "minLength": low, "maxLength": low + extra},
              st.integers(0, 3), st.integers(0, 8)),
    st.sampled_from(PATTERNS).map(lambda p: {"type": "string", "pattern": p}),
    st.sampled_from(FORMATS).map(lambda f: {"type": "string", "format": f}),
    st.integers(0, 9).map(lambda n: {"type": ["integer", "null"], "minimum": 0, "maximum": n}),
)


def _object(properties, optional, closed):
    schema = {"type": "object", "properties": properties, "required": sorted(k for k in properties if k != optional)}
    if closed is not None:
        schema["additionalProperties"] = closed
    return schema


def _objects(children):
    return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
        lambda properties: st.builds(_object, st.just(properties), st.sampled_from([None, *sorted(properties)]),
                                     st.sampled_from([None, False, {"type": "integer", "minimum": 0, "maximum": 9}])))


def _arrays(children):
    return st.builds(lambda items, low, extra: {"type": "array", "items": items, "minItems": low,
                                                "maxItems": low + extra},
                     children, st.integers(0, 2), st.integers(0, 2))


def _with_ref(schema):
    """The schema reached through a reference."""
    return {"$defs": {"part": schema}, "type": "object", "properties": {"part": {"$ref": "#/$defs/part"}},
            "required": ["part"]}


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    _objects(children), _arrays(children), st.lists(children, min_size=2, max_size=2).map(lambda b: {"anyOf": b})),
    max_leaves=5)
TOP_SCHEMAS = st.one_of(_objects(SCHEMAS), SCHEMAS.map(_with_ref), SCHEMAS)

ATOMS = st.sampled_from(["a", "b", "x", "0", "-", " ", "é", "[a-c]", "[0-9]", r"\d", "[^a-z]", ".", r"\.", r"\s"])
QUANTIFIERS = st.sampled_from(["", "", "?", "{1,3}", "{2}", "+", "*"])
REGEXES = st.lists(
    st.lists(st.lists(st.tuples(ATOMS, QUANTIFIERS).map("".join), min_size=1, max_size=4).map("".join),
             min_size=1, max_size=3).map(lambda alts: alts[0] if len(alts) == 1 else "(" + "|".join(alts) + ")"),
    min_size=1, max_size=3).map("".join)
CHOICES = st.lists(TEXT, min_size=2, max_size=4, unique=True)


def format_checker() -> jsonschema.FormatChecker:
    """jsonschema's checks of date, ipv4 and uuid; Python's parsers for times (jsonschema's need another package)."""
    checker = jsonschema.FormatChecker(["date", "ipv4", "uuid"])
    checker.checks("time", raises=ValueError)(lambda value: bool(datetime.time.fromisoformat(value)))
    checker.checks("date-time", raises=ValueError)(lambda value: bool(datetime.datetime.fromisoformat(value)))
    return checker


@pytest.fixture(scope="module")
def llm(text_model):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box is small and shared: torch's pool only contends
    with LLM(text_model, max_model_len=256, max_num_seqs=32) as engine:
        yield engine
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def closing_bias(llm):
    """A logit bias toward the tokens made only of closing punctuation (and EOS), so that random weights end most
    rows within max_tokens."""
    tokenizer = llm.tokenizer
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    bias = {i: 5.0 for i, text in enumerate(texts) if text.strip() and set(text.strip()) <= set('"}],')}
    bias[tokenizer.eos_token_id] = 5.0
    return bias


def _token_text(llm, token_ids):
    vocabulary = llm.grammar_compile_cache().vocabulary()
    ids = token_ids[:-1] if token_ids and token_ids[-1] == llm.tokenizer.eos_token_id else token_ids
    return vocabulary.text(ids)


@settings(max_examples=5, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(schemas=st.lists(TOP_SCHEMAS, min_size=12, max_size=16), regexes=st.lists(REGEXES, min_size=4, max_size=6),
       choices=CHOICES)
def test_every_complete_output_satisfies_its_constraint(llm, closing_bias, schemas, regexes, choices):
    constraints = ([("json", {"json": s}) for s in schemas] + [("regex", {"regex": r}) for r in regexes]
                   + [("choice", {"choice": choices})])
    params = [SamplingParams(temperature=1.0, max_tokens=128, seed=i, logit_bias=closing_bias,
                             structured_outputs=so) for i, (_, so) in enumerate(constraints)]
    outputs = llm.generate(["Fill this in:"] * len(constraints), params)
    complete = 0
    for (kind, so), out in zip(constraints, outputs):
        assert out.error is None, (so, out.error)  # every generated constraint is one nanovllm supports
        assert out.structured_complete or out.finish_reason == "length", (so, out.finish_reason)
        assert out.text == _token_text(llm, out.token_ids), so
        if not out.structured_complete:
            continue
        complete += 1
        if kind == "json":
            jsonschema.validate(json.loads(out.text), so["json"], format_checker=format_checker())
        elif kind == "regex":
            assert re.fullmatch(so["regex"], out.text), (so["regex"], out.text)
        else:
            assert out.text in so["choice"], (so["choice"], out.text)
    assert complete >= len(constraints) // 2, f"only {complete} of {len(constraints)} rows completed"
