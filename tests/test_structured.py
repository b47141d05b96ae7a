"""Structured outputs through xgrammar on the embedded SmolLM2 tokenizer (no weights loaded).

The end-to-end tests drive matcher + batched bitmask + device-path apply + sampling with a noise "model":
random logits, plus a fixed bias toward tokens holding closing punctuation (or "=") and EOS so that rows finish within
the step budget (the bias never overrides the mask: a biased token the grammar forbids is still -inf). Every
row that ends with a stop token must parse and validate; rows cut by the step budget are not judged."""
import json
import re
import threading

import pytest
import torch

from nanovllm.kernels.token_bitmask import bitmask_width
from nanovllm.structured import (
    BatchBitmask,
    ConstraintError,
    GrammarCompileCache,
    StructuredOutputsParams,
    from_response_format,
)

jsonschema = pytest.importorskip("jsonschema")

PAD = 37  # the model's vocabulary exceeds the tokenizer's (and is not a multiple of 32)


@pytest.fixture(scope="module")
def tokenizer(smollm_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm_tokenizer_dir))


@pytest.fixture(scope="module")
def vocab_size(tokenizer):
    return len(tokenizer) + PAD


@pytest.fixture(scope="module")
def cache(tokenizer, vocab_size):
    cache = GrammarCompileCache(tokenizer, vocab_size)
    yield cache
    cache.shutdown()


@pytest.fixture(scope="module")
def closing_bias(tokenizer, vocab_size):
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    bias = torch.zeros(vocab_size)
    bias[[i for i, text in enumerate(texts) if any(ch in text for ch in '"}]),=')]] = 6.0
    bias[tokenizer.eos_token_id] = 6.0
    return bias


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the CI box is small and shared: torch's pool only contends
    yield
    torch.set_num_threads(threads)


def generate(cache, tokenizer, vocab_size, params, rows=12, steps=120, bias=None, seed=0):
    """Decode `rows` constrained rows from noise, in a logits batch with an unconstrained row before and after
    them; the texts of the rows that ended on EOS, and how many did not end."""
    compiled = cache.request(params).result()
    grammars = [compiled.new_row([tokenizer.eos_token_id]) for _ in range(rows)]
    bitmask = BatchBitmask(rows, cache.mask_vocab_size, "cpu")
    gen = torch.Generator().manual_seed(seed)
    outputs = [[] for _ in range(rows)]
    alive = list(range(rows))
    finished = []
    for _ in range(steps):
        if not alive:
            break
        logits = torch.randn(len(alive) + 2, vocab_size, generator=gen) * 2
        if bias is not None:
            logits += bias
        logits_rows = list(range(1, len(alive) + 1))
        free = [0, len(alive) + 1]
        before = logits[free].clone()
        bitmask.prepare([grammars[i] for i in alive], logits_rows).apply(logits)
        assert torch.equal(logits[free], before), "an unconstrained row was masked"
        noise = -torch.log(-torch.log(torch.rand(logits.shape, generator=gen)))
        sampled = (logits + noise).argmax(-1)[logits_rows].tolist()  # Gumbel-max: a draw from softmax(logits)
        still = []
        for i, token in zip(alive, sampled):
            assert grammars[i].accept(token), f"the mask allowed token {token}, which the grammar rejects"
            if grammars[i].is_terminated():
                assert token == tokenizer.eos_token_id
                finished.append(i)
            else:
                outputs[i].append(token)
                still.append(i)
        alive = still
    return [tokenizer.decode(outputs[i]) for i in finished], len(alive)


EXTRACTION_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 1}, "verified": {"type": "boolean"},
                           "address": {"type": "object", "properties": {"zip": {"type": "string",
                                                                                "pattern": "^[0-9]{5}$"}},
                                       "required": ["zip"]}},
            "required": ["id", "verified"],
        },
    },
    "required": ["name", "age", "kind", "owner"],
}


def test_json_schema_outputs_validate(cache, tokenizer, vocab_size, closing_bias, one_thread):
    texts, unfinished = generate(cache, tokenizer, vocab_size, StructuredOutputsParams(json=EXTRACTION_SCHEMA),
                                 bias=closing_bias)
    assert len(texts) >= 8, f"only {len(texts)} rows finished: the test would judge too little"
    objects = [json.loads(text) for text in texts]
    for o in objects:
        jsonschema.validate(o, EXTRACTION_SCHEMA)
    assert any("tags" in o for o in objects) and any("address" in o["owner"] for o in objects)  # optional parts


def test_json_object_outputs_are_objects(cache, tokenizer, vocab_size, closing_bias, one_thread):
    # A weaker bias: at full strength "}" right after "{" wins nearly always.
    texts, _ = generate(cache, tokenizer, vocab_size, StructuredOutputsParams(json_object=True),
                        bias=0.7 * closing_bias, seed=1)
    assert len(texts) >= 6
    objects = [json.loads(text) for text in texts]
    assert all(isinstance(o, dict) for o in objects) and any(objects)


def test_choice_outputs_are_one_choice(cache, tokenizer, vocab_size, one_thread):
    choices = ["yes", "no", "maybe so", 'naïve "quoted"\n', "no way"]
    texts, unfinished = generate(cache, tokenizer, vocab_size, StructuredOutputsParams(choice=choices), steps=40)
    assert unfinished == 0
    assert set(texts) <= set(choices) and len(set(texts)) >= 2


def test_regex_outputs_fully_match(cache, tokenizer, vocab_size, one_thread):
    pattern = r"[a-z]{2,5}-\d{3}( ok)?"
    texts, unfinished = generate(cache, tokenizer, vocab_size, StructuredOutputsParams(regex=pattern), steps=40)
    assert unfinished == 0
    assert all(re.fullmatch(pattern, text) for text in texts)


def test_ebnf_grammar_outputs_match(cache, tokenizer, vocab_size, closing_bias, one_thread):
    grammar = 'root ::= term (" + " term)* " = ?"\nterm ::= [1-9] [0-9]? | "(" term " * " term ")"'
    # Nested parentheses are not a regular language: check by reducing innermost products first.
    texts, _ = generate(cache, tokenizer, vocab_size, StructuredOutputsParams(grammar=grammar), steps=60,
                        bias=closing_bias, seed=2)
    assert len(texts) >= 6
    for text in texts:
        assert text.endswith(" = ?")
        body = text[:-len(" = ?")]
        while re.search(r"\(\d+ \* \d+\)", body):
            body = re.sub(r"\((\d+) \* (\d+)\)", "1", body)
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?)*", body), text


@pytest.mark.parametrize("added_tokens", [0, 5])
def test_ids_past_the_tokenizers_are_never_allowed(smollm_tokenizer_dir, added_tokens):
    """The grammars cover the tokenizer's ids only (xgrammar's fills and accepts cost several times more per
    padded id); the model's ids past them become -inf, also when the tokenizer's last word is partly used
    (xgrammar leaves those bits set) and for a terminated row, which allows every token of the grammar."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_tokenizer_dir))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(added_tokens)])
    vocab_size = len(tokenizer) + PAD
    cache = GrammarCompileCache(tokenizer, vocab_size)
    try:
        assert cache.mask_vocab_size == len(tokenizer) == 49152 + added_tokens
        compiled = cache.request(StructuredOutputsParams(json_object=True)).result()
        row, done = compiled.new_row([tokenizer.eos_token_id]), compiled.new_row([tokenizer.eos_token_id])
        for token in tokenizer.encode("{}") + [tokenizer.eos_token_id]:
            assert done.accept(token)
        bitmask = BatchBitmask(2, cache.mask_vocab_size, "cpu")
        for piece in ['{"a', '": "', 'xy', '", "b": [1', ", 2]}"]:
            step = bitmask.prepare([row, done], [1, 0])
            assert step.bitmask.shape == (2, bitmask_width(len(tokenizer)))
            logits = torch.zeros(2, vocab_size)
            step.apply(logits)
            assert not torch.isinf(logits[0, :len(tokenizer)]).any()  # terminated: its whole grammar vocabulary
            assert torch.isfinite(logits[1, :len(tokenizer)]).any()
            assert torch.isinf(logits[:, len(tokenizer):]).all()
            for token in tokenizer.encode(piece):
                assert row.accept(token)
    finally:
        cache.shutdown()


def test_row_grammar_accepts_rejects_ends_and_rolls_back(cache, tokenizer, vocab_size):
    compiled = cache.request(StructuredOutputsParams(choice=["alpha", "beta"])).result()
    row = compiled.new_row([tokenizer.eos_token_id, 7])
    eos = tokenizer.eos_token_id
    assert not row.accept(eos)  # incomplete: EOS is not allowed yet
    assert not row.accept(tokenizer.encode("gamma")[0])
    alpha = tokenizer.encode("alpha")
    for token in alpha:
        assert row.accept(token)
    assert row.is_completed() and not row.is_terminated()
    mask = torch.zeros(1, bitmask_width(cache.mask_vocab_size), dtype=torch.int32)
    row.fill_bitmask(mask, 0)
    bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    assert bits.nonzero().flatten().tolist() == sorted({eos, 7})  # complete: only the stop tokens
    twin = row.fork()
    row.rollback(len(alpha))
    assert not row.is_completed() and row.num_accepted == 0
    assert twin.is_completed() and twin.num_accepted == len(alpha)  # the fork kept its place
    assert twin.accept(eos) and twin.is_terminated() and not row.is_terminated()
    for token in tokenizer.encode("beta"):
        assert row.accept(token)
    assert row.accept(7) and row.is_terminated()
    row.fill_bitmask(mask, 0)  # a terminated row (its in-flight sample is discarded) allows everything
    assert (mask == -1).all()
    with pytest.raises(ValueError, match="cannot roll back"):
        row.rollback(99)


def test_batched_fill_equals_row_fill(cache, tokenizer, vocab_size):
    compiled = cache.request(StructuredOutputsParams(json=EXTRACTION_SCHEMA)).result()
    rows = [compiled.new_row([tokenizer.eos_token_id]) for _ in range(4)]
    for row, prefix in zip(rows, ['{"name": "x', '{"name": "ab", "age": 1', '{', '']):
        for token in tokenizer.encode(prefix):
            assert row.accept(token)
    batched = BatchBitmask(8, cache.mask_vocab_size, "cpu").prepare(rows, [5, 0, 2, 7])
    assert batched.row_indices.tolist() == [5, 0, 2, 7]
    single = torch.zeros_like(batched.bitmask)
    for i, row in enumerate(rows):
        row.fill_bitmask(single, i)
    assert torch.equal(batched.bitmask, single)
    assert len({tuple(r.tolist()) for r in single}) == 4  # four states, four masks


def test_compiles_once_per_distinct_constraint(tokenizer, vocab_size):
    cache = GrammarCompileCache(tokenizer, vocab_size)
    try:
        schema_text = json.dumps(EXTRACTION_SCHEMA, indent=2)
        requests = [StructuredOutputsParams(json=EXTRACTION_SCHEMA if i % 2 else schema_text) for i in range(100)]
        futures = [cache.request(p) for p in requests]
        results = {id(f.result()) for f in futures}
        assert cache.num_compiles == 1 and len(results) == 1
        reordered = dict(reversed(list(EXTRACTION_SCHEMA.items())))  # another property order: another output
        cache.request(StructuredOutputsParams(json=reordered)).result()
        cache.request(StructuredOutputsParams(regex="a+")).result()
        cache.request(StructuredOutputsParams(regex="a+")).result()
        assert cache.num_compiles == 3
    finally:
        cache.shutdown()


def test_cache_evicts_least_recently_requested_finished_keys(tokenizer, vocab_size):
    cache = GrammarCompileCache(tokenizer, vocab_size, max_entries=2)
    try:
        first, second, third = (StructuredOutputsParams(regex=r) for r in ("a+", "b+", "c+"))
        kept = cache.request(first).result()
        cache.request(second).result()
        cache.request(first)  # now the most recent: "b+" is the one to go
        cache.request(third).result()
        assert cache.num_compiles == 3
        assert cache.request(first).result() is kept  # still cached
        cache.request(second).result()  # evicted: compiled again
        assert cache.num_compiles == 4
    finally:
        cache.shutdown()


@pytest.mark.parametrize("params, message", [
    (StructuredOutputsParams(json={"type": "nope"}), r'structured_outputs\.json: invalid JSON schema: Unsupported type "nope"'),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}),
     "structured_outputs.json: invalid JSON schema: .*minimum greater than maximum"),
    (StructuredOutputsParams(regex="a(b"), r"structured_outputs\.regex: invalid regex: .*parenthesis is not closed"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"),
     r'structured_outputs\.grammar: invalid EBNF grammar: .*Rule "undefined_rule" is not defined'),
])
def test_invalid_constraint_is_a_clear_error_for_its_key_only(tokenizer, vocab_size, params, message):
    cache = GrammarCompileCache(tokenizer, vocab_size)
    try:
        bad = cache.request(params)
        with pytest.raises(ConstraintError, match=message):
            bad.result()
        assert isinstance(bad.error(), ConstraintError)
        good = cache.request(StructuredOutputsParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
        assert good.result() is not None and good.error() is None
        again = cache.request(params)  # the same invalid constraint: the same error, no second compile
        assert again.error() is not None and str(again.error()) == str(bad.error())
        assert cache.num_compiles == 2
    finally:
        cache.shutdown()


def test_request_does_not_wait_for_the_compile(tokenizer, vocab_size, monkeypatch):
    cache = GrammarCompileCache(tokenizer, vocab_size)
    release = threading.Event()
    compile_regex = cache._compiler.compile_regex

    def held_compile(regex):
        assert release.wait(30)
        return compile_regex(regex)

    monkeypatch.setattr(cache._compiler, "compile_regex", held_compile)
    try:
        future = cache.request(StructuredOutputsParams(regex="[0-9]+"))
        assert not future.ready() and future.error() is None
        other = cache.request(StructuredOutputsParams(choice=["a", "b"]))  # another key compiles meanwhile
        assert other.result(timeout=30) is not None
        assert not future.ready()
        release.set()
        assert future.result(timeout=30) is not None and future.ready()
    finally:
        release.set()
        cache.shutdown()


# ---- parameters and the OpenAI response_format ----

@pytest.mark.parametrize("kwargs, message", [
    ({}, "exactly one of json, json_object, regex, choice, grammar must be set, got none"),
    ({"regex": "a", "choice": ["a"]}, "exactly one .* got regex, choice"),
    ({"json": "{not json"}, r"structured_outputs\.json=.*not valid JSON text"),
    ({"json": "[1, 2]"}, r"structured_outputs\.json=.*must be a JSON schema object"),
    ({"json_object": "yes"}, r"structured_outputs\.json_object=.*must be a boolean"),
    ({"regex": 5}, r"structured_outputs\.regex=.*non-empty string"),
    ({"choice": []}, r"structured_outputs\.choice=.*non-empty list"),
    ({"choice": ["a", ""]}, r"structured_outputs\.choice=.*every choice must be a non-empty string"),
    ({"grammar": "  "}, r"structured_outputs\.grammar=.*non-empty EBNF"),
])
def test_params_validation_names_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**kwargs)


def test_params_from_dict_and_canonical_keys():
    with pytest.raises(ValueError, match="unknown field.*json_schema"):
        StructuredOutputsParams.from_dict({"json_schema": {}})
    params = StructuredOutputsParams.from_dict({"choice": ("a", "b")})
    assert params.kind == "choice" and params.choice == ["a", "b"]
    as_dict = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
    as_text = StructuredOutputsParams(json='{ "type" : "object",\n "properties": {"a": {"type": "string"}} }')
    assert as_dict.canonical_key() == as_text.canonical_key()
    reordered = StructuredOutputsParams(json={"properties": {"a": {"type": "string"}}, "type": "object"})
    assert reordered.canonical_key() != as_dict.canonical_key()
    assert StructuredOutputsParams(json_object=True).canonical_key() == ("json_object", "")


def test_response_format_conversion():
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputsParams(json_object=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = from_response_format({"type": "json_schema",
                                   "json_schema": {"name": "thing", "schema": schema, "strict": True}})
    assert params == StructuredOutputsParams(json=schema)


@pytest.mark.parametrize("response_format, message", [
    ("json", "response_format must be an object"),
    ({"type": "xml"}, r"response_format\.type='xml': must be one of text, json_object, json_schema"),
    ({"type": "json_object", "schema": {}}, r"response_format: unknown field\(s\) schema for type 'json_object'"),
    ({"type": "json_schema"}, r"response_format\.json_schema: must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strictness": 1}},
     r"response_format\.json_schema: unknown field\(s\) strictness"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, r"response_format\.json_schema\.name: required"),
    ({"type": "json_schema", "json_schema": {"name": "a"}}, r"response_format\.json_schema\.schema: required"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}},
     r"response_format\.json_schema\.strict='yes': must be a boolean"),
])
def test_response_format_rejects_bad_input_by_name(response_format, message):
    with pytest.raises(ValueError, match=message):
        from_response_format(response_format)


@pytest.mark.gpu
def test_device_bitmask_matches_the_host_path(cache, tokenizer, vocab_size):
    compiled = cache.request(StructuredOutputsParams(json=EXTRACTION_SCHEMA)).result()
    rows = [compiled.new_row([tokenizer.eos_token_id]) for _ in range(3)]
    for row, prefix in zip(rows, ['{"name": "x', '{"name": "ab", "age": 1', '{']):
        for token in tokenizer.encode(prefix):
            assert row.accept(token)
    logits = torch.randn(5, vocab_size)
    on_host = logits.clone()
    BatchBitmask(4, cache.mask_vocab_size, "cpu").prepare(rows, [4, 0, 2]).apply(on_host)
    on_device = logits.cuda()
    device_bitmask = BatchBitmask(4, cache.mask_vocab_size, "cuda")
    for _ in range(3):  # both host slots, reused
        step = device_bitmask.prepare(rows, [4, 0, 2])
    step.apply(on_device)
    assert torch.equal(on_device.cpu(), on_host)
