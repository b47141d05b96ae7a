"""Structured outputs through xgrammar on the embedded SmolLM2 tokenizer (no weights loaded).

The end-to-end tests drive the grammar manager (plan, step mask, accepts, release, output) and the device half
(`DeviceMask`) with a noise "model": random logits, plus a fixed bias toward tokens holding closing punctuation
(or "=") and EOS so that rows finish within the step budget (the bias never overrides the mask: a biased token
the grammar forbids is still -inf). Every row that ends with a stop token must be complete and its text must
parse and validate; rows cut by the step budget are not judged."""
import json
import re
import threading
from types import SimpleNamespace

import pytest
import torch

from nanovllm.kernels.token_bitmask import bitmask_width
from nanovllm.structured import (
    ConstraintError,
    DeviceMask,
    GrammarCompileCache,
    GrammarManager,
    RowGrammar,
    StructuredOutputsParams,
    from_response_format,
)
from nanovllm.structured.regex import python_regex

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


class Row:
    """What the grammar manager reads of a sequence (the engine's Sequence has these fields)."""

    def __init__(self, future=None, stop_token_ids=(), max_len=10**6):
        self.grammar_future = future
        self.grammar = None
        self.params = SimpleNamespace(stop_token_ids=list(stop_token_ids))
        self.epoch = 0
        self.max_len = max_len
        self.output_token_ids = []

    @property
    def num_tokens(self):
        return len(self.output_token_ids)


def start_rows(manager, params, count, **row_args):
    rows = [Row(manager.request(params), **row_args) for _ in range(count)]
    for row in rows:
        row.grammar_future.wait()
        manager.start_row(row)
    return rows


def plan(manager, seqs):
    return manager.plan(seqs, [True] * len(seqs), [s.epoch for s in seqs])


def generate(cache, tokenizer, vocab_size, params, rows=12, steps=120, bias=None, seed=0):
    """Decode `rows` constrained rows from noise, in a logits batch with an unconstrained row before and after
    them; the outputs (text, complete) of the rows that ended on EOS, and how many did not end."""
    manager = GrammarManager(cache, {tokenizer.eos_token_id}, rows + 2, pin_memory=False)
    seqs = start_rows(manager, params, rows)
    device = DeviceMask(torch.device("cpu"))
    gen = torch.Generator().manual_seed(seed)
    alive, finished = list(seqs), []
    for _ in range(steps):
        if not alive:
            break
        batch = [Row(), *alive, Row()]
        step = plan(manager, batch)
        logits = torch.randn(len(batch), vocab_size, generator=gen) * 2
        if bias is not None:
            logits += bias
        before = logits[[0, -1]].clone()
        device.apply(manager.step_mask(step), logits)
        assert torch.equal(logits[[0, -1]], before), "an unconstrained row was masked"
        noise = -torch.log(-torch.log(torch.rand(logits.shape, generator=gen)))
        sampled = (logits + noise).argmax(-1).tolist()  # Gumbel-max: a draw from softmax(logits)
        manager.start_accepts(step, sampled)
        still = []
        for seq, token in zip(alive, sampled[1:-1]):
            seq.output_token_ids.append(token)
            if token == tokenizer.eos_token_id:
                manager.release(seq)
                finished.append(seq)
            else:
                still.append(seq)
        alive = still
    outputs = [manager.output(seq) for seq in finished]
    assert all(o.complete and o.error is None for o in outputs), "a row ended on EOS before its grammar was complete"
    manager.shutdown()
    return [o.text for o in outputs], len(alive)


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


def test_choice_outputs_are_one_choice_exactly(cache, tokenizer, vocab_size, one_thread):
    choices = ["yes", "no", "maybe so", 'naïve "quoted"\n', "no way", "  two  spaces "]
    texts, unfinished = generate(cache, tokenizer, vocab_size, StructuredOutputsParams(choice=choices), steps=40)
    assert unfinished == 0
    assert set(texts) <= set(choices) and len(set(texts)) >= 2


def test_regex_outputs_fully_match(cache, tokenizer, vocab_size, one_thread):
    pattern = r"[a-z]{2,5}-\d{3}( ok)?.?"  # `.` as Python reads it: anything but a newline
    texts, unfinished = generate(cache, tokenizer, vocab_size, StructuredOutputsParams(regex=pattern), steps=40)
    assert unfinished == 0
    assert all(re.fullmatch(pattern, text) for text in texts)


def test_python_regex_reads_dot_as_python_does():
    assert python_regex(r"a.b[.]\.[^.]x.") == r"a[^\n]b[.]\.[^.]x[^\n]"
    assert python_regex(r"[]a.].(.|\\.)") == r"[]a.][^\n]([^\n]|\\[^\n])"


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


def allowed_ids(line: torch.Tensor) -> set[int]:
    bits = ((line.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()
    return set(bits.nonzero().flatten().tolist())


def test_added_tokens_and_control_characters_never_enter_a_json_string(cache, tokenizer):
    """The tokenizer's added tokens (<|im_start|>, ...) are never allowed (only EOS, as a stop token, where the
    grammar is complete): xgrammar would read them as text, which the tokenizer's decode renders otherwise. Nor
    are raw control characters inside a JSON string, also in length-bounded strings (xgrammar's own rule for
    those allows them) short or long."""
    added = set(tokenizer.added_tokens_decoder) - {tokenizer.eos_token_id}
    control = {i for i, b in enumerate(cache.vocabulary().token_bytes) if any(c < 0x20 for c in b)}
    assert len(added) >= 10 and len(control) >= 20
    for string in ({"type": "string"}, {"type": "string", "maxLength": 8}, {"type": "string", "minLength": 2},
                   {"type": "string", "maxLength": 150}, {"type": "string", "pattern": "^[^,]+$"}):
        schema = {"type": "object", "properties": {"s": string}, "required": ["s"]}
        compiled = cache.request(StructuredOutputsParams(json=schema)).result()
        row = RowGrammar(compiled, [tokenizer.eos_token_id])
        for token in tokenizer.encode('{"s": "ab', add_special_tokens=False):
            assert row.accept(token)
        mask = torch.zeros(1, bitmask_width(compiled.vocabulary.mask_vocab_size), dtype=torch.int32)
        row.fill_bitmask(mask, 0)
        allowed = allowed_ids(mask[0])
        assert len(allowed) > 1000, string
        assert not allowed & added, (string, sorted(allowed & added))
        assert not allowed & control, (string, [cache.vocabulary().token_bytes[t] for t in sorted(allowed & control)])


def accepts(cache, schema, text) -> bool:
    """Whether the grammar of `schema` accepts `text` as a complete output."""
    compiled = cache.request(StructuredOutputsParams(json=schema)).result()
    matcher = RowGrammar(compiled, [0]).matcher
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize("pattern, matching, other", [
    # xgrammar's own pattern rule accepts "Scanrocy" and "aaaab" here
    ("^[A-Z][a-z]{0,4}( [A-Z][a-z]{0,4})?$", ["Scan", "Scan Rocy", "A"], ["Scanrocy", "ScanRocy", "scan"]),
    ("^a{0,4}( b{0,4})?$", ["", "aaaa bb", "a "], ["aaaab", "aaaaa"]),
    ('^[^,]{1,3}"x.$', ['ab"x\x11', '\n"x\\', 'é"x"'], ['a,"xy', 'abcd"xy']),  # values that JSON escapes
])
def test_a_pattern_string_matches_exactly_with_its_json_escapes(cache, pattern, matching, other):
    """The values are written into the JSON text by json.dumps: quotes, backslashes and control characters as
    escapes, other characters as they are."""
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    for value in matching:
        assert re.search(pattern, value)
        assert accepts(cache, schema, json.dumps({"s": value}, ensure_ascii=False)), value
    for value in other:
        assert not re.search(pattern, value)
        assert not accepts(cache, schema, json.dumps({"s": value}, ensure_ascii=False)), value
    assert not accepts(cache, schema, '{"s": "a\x11\\"xy"}')  # a raw control character is not JSON


def test_text_is_the_bytes_the_grammar_accepted(cache, tokenizer):
    vocabulary = cache.vocabulary()
    text = ' {"a": "naïve\\u00e9 \\"q\\""}  '
    tokens = tokenizer.encode(text, add_special_tokens=False)
    assert vocabulary.text(tokens) == text
    half_a_character = vocabulary.token_bytes.index("é".encode()[:1])  # an output cut by max_tokens may end so
    assert vocabulary.text([*tokens, half_a_character]) == text + "\ufffd"
    assert vocabulary.token_bytes[tokenizer.convert_tokens_to_ids("<|im_start|>")] == b""


@pytest.mark.parametrize("added_tokens", [0, 5])
def test_ids_past_the_tokenizers_are_never_allowed(smollm_tokenizer_dir, added_tokens):
    """The grammars cover the tokenizer's ids only (xgrammar's fills and accepts cost several times more per
    padded id); the model's ids past them become -inf, also when the tokenizer's last word is partly used
    (xgrammar leaves those bits set); a terminated row masks nothing (its sample is discarded)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm_tokenizer_dir))
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(added_tokens)])
    vocab_size = len(tokenizer) + PAD
    manager = GrammarManager(GrammarCompileCache(tokenizer, vocab_size), {tokenizer.eos_token_id}, 2,
                             pin_memory=False)
    try:
        assert manager.compiles.mask_vocab_size == len(tokenizer) == 49152 + added_tokens
        row, done = start_rows(manager, StructuredOutputsParams(json_object=True), 2)
        for token in tokenizer.encode("{}") + [tokenizer.eos_token_id]:
            assert done.grammar.accept(token)
        device = DeviceMask(torch.device("cpu"))
        for piece in ['{"a', '": "', 'xy', '", "b": [1', ", 2]}"]:
            logits = torch.zeros(2, vocab_size)
            mask = manager.step_mask(plan(manager, [done, row]))
            assert mask.bitmask.shape[1] == bitmask_width(len(tokenizer))
            device.apply(mask, logits)
            assert torch.isfinite(logits[0]).all()
            assert torch.isfinite(logits[1, :len(tokenizer)]).any()
            assert torch.isinf(logits[1, len(tokenizer):]).all()
            for token in tokenizer.encode(piece):
                assert row.grammar.accept(token)
    finally:
        manager.shutdown()
        manager.compiles.shutdown()


def test_row_grammar_accepts_rejects_ends_and_rolls_back(cache, tokenizer, vocab_size):
    compiled = cache.request(StructuredOutputsParams(choice=["alpha", "beta"])).result()
    row = RowGrammar(compiled, [tokenizer.eos_token_id, 7])
    eos = tokenizer.eos_token_id
    assert not row.accept(eos)  # incomplete: EOS is not allowed yet
    assert not row.accept(tokenizer.encode("gamma")[0])
    alpha = tokenizer.encode("alpha")
    for token in alpha:
        assert row.accept(token)
    assert row.is_completed() and not row.is_terminated()
    mask = torch.zeros(1, bitmask_width(cache.mask_vocab_size), dtype=torch.int32)
    row.fill_bitmask(mask, 0)
    assert sorted(allowed_ids(mask[0])) == sorted({eos, 7})  # complete: only the stop tokens
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


def test_step_mask_lines_are_the_rows_own_fills(cache, tokenizer):
    """In the async loop's order (the next step planned before this step's tokens come back, a row finishing in
    between), the worker's lines equal each row's own fill at its slot and name its logits row; the finished
    row's line names none."""
    manager = GrammarManager(cache, {tokenizer.eos_token_id}, 8, pin_memory=False)
    try:
        rows = start_rows(manager, StructuredOutputsParams(json=EXTRACTION_SCHEMA), 5)
        prefixes = ['{"name": "x', '{"name": "ab", "age": 1', '{"', '{"name"', '{']
        last_tokens = []
        for row, prefix in zip(rows, prefixes):
            tokens = tokenizer.encode(prefix)
            for token in tokens[:-1]:
                assert row.grammar.accept(token)
            last_tokens.append(tokens[-1])
        first = plan(manager, [Row(), *rows])
        assert [r.grammar.slot for r in rows] == [0, 1, 2, 3, 4]
        manager.step_mask(first)
        step = plan(manager, [rows[3], Row(), rows[1], rows[0], rows[2], rows[4]])
        manager.start_accepts(first, [0, *last_tokens])
        manager.release(rows[4])  # it finished on its token: its sample in `step` is discarded
        mask = manager.step_mask(step)
        assert mask.logits_rows.tolist() == [3, 2, 4, 0]
        single = torch.zeros(1, mask.bitmask.shape[1], dtype=torch.int32)
        lines = set()
        for row in rows[:4]:
            assert row.grammar.num_accepted == len(tokenizer.encode(prefixes[rows.index(row)]))
            row.grammar.fill_bitmask(single, 0)
            assert torch.equal(mask.bitmask[row.grammar.slot], single[0])
            lines.add(tuple(single[0].tolist()))
        assert len(lines) == 4
    finally:
        manager.shutdown()


def test_a_void_token_is_not_accepted_and_a_rejected_one_surfaces_after_the_worker(cache, tokenizer):
    manager = GrammarManager(cache, {tokenizer.eos_token_id}, 4, pin_memory=False)
    try:
        preempted, bad, good = start_rows(manager, StructuredOutputsParams(choice=["alpha", "beta"]), 3)
        step = plan(manager, [preempted, bad, good])
        manager.step_mask(step)
        preempted.epoch += 1  # preempted after the step was scheduled: its token there is void
        manager.preempt(preempted)
        alpha, gamma = tokenizer.encode("alpha")[0], tokenizer.encode("gamma")[0]
        manager.start_accepts(step, [alpha, gamma, alpha])
        assert bad.grammar.rejected_token is None  # not before the step loop takes the worker's results
        manager.step_mask(plan(manager, [good]))
        assert preempted.grammar.num_accepted == 0 and preempted.grammar.slot is None
        assert good.grammar.num_accepted == 1 and bad.grammar.num_accepted == 0
        assert bad.grammar.rejected_token == gamma
        bad.output_token_ids = [gamma]
        out = manager.output(bad)
        assert not out.complete and "rejected sampled token" in out.error
    finally:
        manager.shutdown()


def test_the_start_mask_is_copied_and_equals_a_fill(cache, tokenizer):
    manager = GrammarManager(cache, {tokenizer.eos_token_id}, 4, pin_memory=False)
    try:
        rows = start_rows(manager, StructuredOutputsParams(json=EXTRACTION_SCHEMA), 3)
        masks = [manager.step_mask(plan(manager, [row])).bitmask[row.grammar.slot].clone() for row in rows]
        # one fill (none when an earlier test's rows of this schema made its start mask), the others copied
        assert manager.times.rows_filled + manager.times.rows_copied == 3 and manager.times.rows_copied >= 2
        single = torch.zeros(1, masks[0].shape[0], dtype=torch.int32)
        rows[0].grammar.fill_bitmask(single, 0)
        assert all(torch.equal(m, single[0]) for m in masks)
    finally:
        manager.shutdown()


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
    (StructuredOutputsParams(json={"type": "nope"}), r'structured_outputs\.json: invalid JSON schema: "type": .nope.'),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}),
     "structured_outputs.json: invalid JSON schema: .*minimum greater than maximum"),
    (StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     r"structured_outputs\.json: invalid JSON schema: unsupported keyword 'uniqueItems' at the top level"),
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


def test_the_tokenizer_tables_build_in_the_background(tokenizer, vocab_size, monkeypatch):
    import nanovllm.structured.vocabulary as vocabulary

    release = threading.Event()
    build = vocabulary.build_vocabulary

    def slow_build(*args):
        assert release.wait(30)
        return build(*args)

    monkeypatch.setattr(vocabulary, "build_vocabulary", slow_build)
    cache = GrammarCompileCache(tokenizer, vocab_size)  # returns at once: the build runs on the pool
    try:
        assert not cache.ready()
        future = cache.request(StructuredOutputsParams(regex="[0-9]+"))  # never blocks either
        assert not future.ready()
        release.set()
        assert future.result(timeout=60) is not None and cache.ready()
    finally:
        release.set()
        cache.shutdown()


def test_compiles_run_in_parallel_and_request_never_waits(tokenizer, vocab_size, monkeypatch):
    cache = GrammarCompileCache(tokenizer, vocab_size, max_workers=2)
    cache.vocabulary()
    release = threading.Event()
    compile_kind = cache._compile_kind

    def held(compiler, params, kind, text):
        if kind == "regex":
            assert release.wait(30)
        return compile_kind(compiler, params, kind, text)

    monkeypatch.setattr(cache, "_compile_kind", held)
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
def test_device_mask_matches_the_host_path(cache, tokenizer, vocab_size):
    """The side-stream copy into alternating device slots gives the CPU path's result, from pinned tables."""
    manager = GrammarManager(cache, {tokenizer.eos_token_id}, 4, pin_memory=True)
    try:
        rows = start_rows(manager, StructuredOutputsParams(json=EXTRACTION_SCHEMA), 3)
        for row, prefix in zip(rows, ['{"name": "x', '{"name": "ab", "age": 1', '{']):
            for token in tokenizer.encode(prefix):
                assert row.grammar.accept(token)
        logits = torch.randn(5, vocab_size)
        device = DeviceMask(torch.device("cuda"))
        for _ in range(3):  # both tables and both device slots, reused
            mask = manager.step_mask(plan(manager, [Row(), rows[1], Row(), rows[2], rows[0]]))
            on_host, on_device = logits.clone(), logits.cuda()
            DeviceMask(torch.device("cpu")).apply(mask, on_host)
            device.apply(mask, on_device)
            assert torch.equal(on_device.cpu(), on_host)
            assert not torch.equal(on_host, logits)
    finally:
        manager.shutdown()
