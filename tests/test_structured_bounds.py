"""Structured-output constraints that fight back: size limits checked before a compile (each error naming its
limit), `$ref`s that point outside the schema or nowhere, constraints that accept no output at all (a schema whose
`$ref` refers only to itself), the compile time limit (a slow compile fails its constraint alone and frees its
slot for the others) and a shutdown in the middle of a compile (it returns at once).

The "accepts no output" verdicts are checked against an independent oracle: a brute-force search for a matching
string over a small alphabet of the grammar's own tokens, with xgrammar's matcher as the judge."""
import json
import threading
import time
from pathlib import Path

import pytest
import xgrammar as xgr

from nanovllm import StructuredOutputsParams
from nanovllm.structured import bounds
from nanovllm.structured.compile_cache import ConstraintError, GrammarCompileCache
from nanovllm.structured.grammar_check import accepts_some_output, parse_rules


def nested(depth: int) -> dict:
    schema = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize("constraint, limit", [
    ({"choice": [f"option {i}" for i in range(bounds.MAX_CHOICES + 1)]}, f"{bounds.MAX_CHOICES + 1:,} choices, more "
     f"than the limit of {bounds.MAX_CHOICES:,}"),
    ({"choice": ["x" * (bounds.MAX_CHOICE_CHARS // 2 + 1)] * 2}, f"the limit of {bounds.MAX_CHOICE_CHARS:,}"),
    ({"regex": "a" * (bounds.MAX_REGEX_CHARS + 1)}, f"more than the limit of {bounds.MAX_REGEX_CHARS:,}"),
    ({"grammar": 'root ::= "' + "a" * bounds.MAX_GRAMMAR_CHARS + '"'}, f"the limit of {bounds.MAX_GRAMMAR_CHARS:,}"),
    ({"json": {"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                for i in range(bounds.MAX_SCHEMA_PROPERTIES + 1)}}},
     f"{bounds.MAX_SCHEMA_PROPERTIES + 1:,} properties, more than the limit of {bounds.MAX_SCHEMA_PROPERTIES:,}"),
    ({"json": nested(bounds.MAX_SCHEMA_DEPTH + 1)}, f"nested more than {bounds.MAX_SCHEMA_DEPTH} deep"),
    ({"json": {"enum": list(range(bounds.MAX_SCHEMA_ENUM_VALUES + 1))}}, "enum values, more than the limit"),
    ({"json": {"description": "x" * bounds.MAX_SCHEMA_CHARS}}, f"the limit of {bounds.MAX_SCHEMA_CHARS:,}"),
])
def test_a_constraint_past_a_size_limit_is_an_error_naming_it_and_quoting_a_prefix(constraint, limit):
    with pytest.raises(ValueError) as error:
        StructuredOutputsParams.from_dict(constraint)
    message = str(error.value)
    assert message.startswith(f"structured_outputs.{next(iter(constraint))}=") and limit in message
    assert len(message) < 400  # the value is quoted by a bounded prefix, never whole


def test_constraints_at_the_limits_are_accepted():
    StructuredOutputsParams(choice=[f"option {i}" for i in range(bounds.MAX_CHOICES)])
    StructuredOutputsParams(json=nested(bounds.MAX_SCHEMA_DEPTH))
    StructuredOutputsParams(json={"type": "object", "properties": {f"p{i}": {"type": "integer"}
                                                                   for i in range(bounds.MAX_SCHEMA_PROPERTIES)}})


@pytest.mark.parametrize("ref, problem", [
    ("file:///etc/passwd", "points outside the schema"),
    ("http://example.com/schema.json", "points outside the schema"),
    ("other.json#/a", "points outside the schema"),
    ("#/$defs/missing", "resolves to nothing in the schema"),
    ("#/properties/a/items/7", "resolves to nothing in the schema"),
])
def test_a_ref_outside_the_schema_or_to_nothing_is_an_error(ref, problem):
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": [{"type": "integer"}]},
                                               "b": {"$ref": ref}}}
    with pytest.raises(ValueError, match=problem):
        StructuredOutputsParams(json=schema)
    inside = {**schema, "properties": {**schema["properties"], "b": {"$ref": "#/properties/a"}}}
    StructuredOutputsParams(json=inside)  # a pointer into the schema itself is fine


# ---- constraints that accept no output -----------------------------------------------------------------------------

def brute_force_accepts(grammar: xgr.CompiledGrammar, alphabet: list[int], depth: int) -> bool:
    """Oracle: some sequence of at most `depth` tokens of `alphabet` is a complete match (the matcher judges)."""
    matcher = xgr.GrammarMatcher(grammar)

    def search(level: int) -> bool:
        if matcher.is_completed():
            return True
        if level == depth:
            return False
        for token in alphabet:
            if matcher.accept_token(token):
                found = search(level + 1)
                matcher.rollback(1)
                if found:
                    return True
        return False

    return search(0)


SCHEMAS = [
    ({"$ref": "#"}, False),
    ({"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, False),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, False),
    ({"type": "array", "items": {"$ref": "#"}, "minItems": 1}, False),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}}, True),
    ({"type": "array", "items": {"$ref": "#"}}, True),
    ({"anyOf": [{"$ref": "#"}, {"type": "boolean"}]}, True),
    ({"type": "object", "properties": {"b": {"type": "boolean"}}, "required": ["b"]}, True),
]


@pytest.fixture(scope="module")
def char_tokenizer(smollm_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_tokenizer_dir))


@pytest.mark.parametrize("schema, accepts", SCHEMAS)
def test_accepts_no_output_agrees_with_a_brute_force_search(schema, accepts, char_tokenizer):
    text = json.dumps(schema)
    assert accepts_some_output(str(xgr.Grammar.from_json_schema(text))) == accepts
    info = xgr.TokenizerInfo.from_huggingface(char_tokenizer)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(text, any_whitespace=False)
    pieces = ("{", "}", "[", "]", '"', "a", "b", ":", ",", " ", "true", " true")
    alphabet = sorted({t for piece in pieces for t in char_tokenizer.encode(piece, add_special_tokens=False)})
    assert brute_force_accepts(grammar, alphabet, depth=9) == accepts


def test_the_grammar_check_reads_every_line_of_real_grammars():
    """The check says "productive" for a form it cannot read: it must read the forms xgrammar prints."""
    sample = json.loads((Path(__file__).parent.parent / "samples" / "extraction_schema.json").read_text())
    for grammar in (xgr.Grammar.from_json_schema(json.dumps(sample)), xgr.Grammar.from_regex(r"[a-z]+@(x|y)\.com"),
                    xgr.Grammar.builtin_json_grammar(),
                    xgr.Grammar.from_ebnf('root ::= "a" b{0, 3} | [0-9]+ c?\nb ::= "x" | b "y"\nc ::= ("q")*')):
        rules = parse_rules(str(grammar))
        assert "root" in rules and len(rules) == len(str(grammar).splitlines())


@pytest.fixture(scope="module")
def tokenizer_and_vocab(smollm_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_tokenizer_dir)), 49152


def compile_error(future) -> Exception | None:
    future.wait(60)
    return future.error()


def test_a_constraint_that_accepts_no_output_fails_at_compile_naming_why(tokenizer_and_vocab):
    cache = GrammarCompileCache(*tokenizer_and_vocab)
    try:
        for schema in ({"$ref": "#"}, {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}):
            error = compile_error(cache.request(StructuredOutputsParams(json=schema)))
            assert isinstance(error, ConstraintError) and "accepts no output at all" in str(error)
        assert compile_error(cache.request(StructuredOutputsParams(grammar='root ::= "a" b\nb ::= b "x"')))
        assert compile_error(cache.request(StructuredOutputsParams(json={"type": "boolean"}))) is None
    finally:
        cache.shutdown()


# ---- compile time limit and shutdown -------------------------------------------------------------------------------

def slow_compiles(monkeypatch, seconds: float, marker: str = "slow") -> threading.Event:
    """Compiles of regexes containing `marker` take `seconds` (a sleep releases the GIL as xgrammar does)."""
    started = threading.Event()
    compile_regex = xgr.GrammarCompiler.compile_regex

    def slow(self, regex, *args, **kwargs):
        if marker in regex:
            started.set()
            time.sleep(seconds)
        return compile_regex(self, regex, *args, **kwargs)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_regex", slow)
    return started


def test_a_compile_past_the_time_limit_fails_alone_and_frees_its_slot(tokenizer_and_vocab, monkeypatch):
    slow_compiles(monkeypatch, 5.0)
    cache = GrammarCompileCache(*tokenizer_and_vocab, max_workers=1, compile_time_limit_s=0.5)
    try:
        started = time.monotonic()
        slow = cache.request(StructuredOutputsParams(regex="slow[a-z]"))
        quick = cache.request(StructuredOutputsParams(regex="[0-9]{2}"))  # queued behind it in the one slot
        assert quick.result(timeout=4) is not None  # the slow one was given up at its limit
        error = slow.error()
        assert isinstance(error, ConstraintError)
        assert "took longer than the compile time limit of 0.5 s" in str(error) and "structured_outputs.regex" in str(error)
        assert time.monotonic() - started < 4
    finally:
        cache.shutdown()


def test_compiles_given_up_at_the_limit_never_pile_up(tokenizer_and_vocab, monkeypatch):
    """Each slow constraint fails at the limit, and at most `max_overdue` of them run on after it."""
    running, most = [0], [0]
    lock = threading.Lock()
    compile_regex = xgr.GrammarCompiler.compile_regex

    def slow(self, regex, *args, **kwargs):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        time.sleep(1.0)
        with lock:
            running[0] -= 1
        return compile_regex(self, regex, *args, **kwargs)

    monkeypatch.setattr(xgr.GrammarCompiler, "compile_regex", slow)
    cache = GrammarCompileCache(*tokenizer_and_vocab, max_workers=1, compile_time_limit_s=0.2)
    try:
        futures = [cache.request(StructuredOutputsParams(regex=f"slow{i}")) for i in range(4)]
        errors = [compile_error(f) for f in futures]
        assert all(isinstance(e, ConstraintError) and "compile time limit of 0.2 s" in str(e) for e in errors)
        assert most[0] == 2  # never more than max_overdue (2 for one slot) at once
    finally:
        cache.shutdown()


def test_shutdown_returns_at_once_in_the_middle_of_a_compile(tokenizer_and_vocab, monkeypatch):
    started = slow_compiles(monkeypatch, 30.0)
    cache = GrammarCompileCache(*tokenizer_and_vocab, max_workers=1)
    running = cache.request(StructuredOutputsParams(regex="slow[a-z]"))
    queued = cache.request(StructuredOutputsParams(regex="[0-9]"))
    assert started.wait(10)
    began = time.monotonic()
    cache.shutdown()
    assert time.monotonic() - began < 1
    assert queued.ready() and not running.ready()
    with pytest.raises(RuntimeError, match="shut down"):
        cache.request(StructuredOutputsParams(regex="[a-z]"))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_lone_request_whose_constraint_fails_its_compile_gets_its_error(text_model, async_scheduling):
    """The request finishes while it is being scheduled, with nothing else to run: it still leaves the engine
    with its error (a 400: the request's fault), and the engine is empty after."""
    from nanovllm import LLM, SamplingParams

    llm = LLM(text_model, max_model_len=64, num_kv_blocks=64, async_scheduling=async_scheduling)
    for constraint, problem in (({"regex": "("}, "invalid regex"), ({"json": {"$ref": "#"}}, "accepts no output")):
        [output] = llm.generate([[1, 2]], SamplingParams(max_tokens=2, structured_outputs=constraint))
        assert output.finish_reason == "error" and problem in output.error and output.invalid_request
        assert not llm.has_unfinished_requests()
    [output] = llm.generate([[1, 2]], SamplingParams(max_tokens=2, structured_outputs={"choice": ["yes", "no"]}))
    assert output.error is None and output.text in ("yes", "no")


def test_a_constraint_the_tokenizer_cannot_spell_is_the_requests_error(text_model):
    """xgrammar's mask allows no token after "0" for this regex (a plane-4 character): whatever is sampled there
    is refused, and the row fails as the request's fault, saying why, not as a sampler bug."""
    from nanovllm import LLM, SamplingParams

    llm = LLM(text_model, max_model_len=64, num_kv_blocks=64)
    [output] = llm.generate([[1, 2]], SamplingParams(max_tokens=4, structured_outputs={"regex": "0\U00040000"}))
    assert output.finish_reason == "error" and output.invalid_request
    assert "no token can continue the output at this point of the constraint" in output.error
