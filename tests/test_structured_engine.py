"""Structured outputs through the engine (LLM -> scheduler -> runner -> postprocess), sync and async loops.

The model is a tiny random Llama with SmolLM2's tokenizer (`text_model`): noise, so a row's text is whatever the
mask lets through. The schemas of the main test bound every value (enums, bounded integers, booleans, bounded
arrays), so every row must end on its own with "stop" well inside max_tokens, and each output is checked with
`jsonschema`, against the choices, or with `re.fullmatch`. One test runs the embedded SmolLM2 on the sample
extraction schema."""
import json
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch
from helpers import make_seq

from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import BlockManager
from nanovllm.engine.scheduler import Scheduler
from nanovllm.engine.sequence import SequenceStatus
from nanovllm.structured import StructuredOutputsParams

BOUNDED_SCHEMA = {
    "type": "object",
    "properties": {
        "kind": {"enum": ["cat", "dog", "parrot"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "vaccinated": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["calm", "loud", "old"]}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]},
                                                   "floor": {"type": "integer", "minimum": -2, "maximum": 9}},
                  "required": ["city", "floor"], "additionalProperties": False},
    },
    "required": ["kind", "age", "vaccinated", "tags", "owner"],
    "additionalProperties": False,
}
CHOICES = ["red", "green", "blue light"]
REGEX = r"[a-c]{2,4}-[0-9]{1,3}"
PROMPTS = ["Describe a pet:", "Answer in JSON.", "Colour?", "Code:"]
ENGINE = {"max_model_len": 512, "max_num_seqs": 16}


def job() -> list[tuple[str, SamplingParams]]:
    """(kind, params) per row: every constraint kind, unconstrained rows between them, one invalid schema."""
    rows = []
    for i, prompt in enumerate(PROMPTS):
        def params(so, max_tokens=200, i=i):
            return SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=100 + i, structured_outputs=so)
        rows += [("json", prompt, params({"json": BOUNDED_SCHEMA})),
                 ("choice", prompt, params({"choice": CHOICES})),
                 ("regex", prompt, params({"regex": REGEX}))]
        if i < 2:
            rows += [("free", prompt, params(None, 12)), ("json_object", prompt, params({"json_object": True}, 24))]
    rows.append(("bad", "x", SamplingParams(structured_outputs={"json": {"type": "nope"}})))
    return rows


@pytest.fixture(scope="module")
def llm(text_model):
    with LLM(text_model, **ENGINE) as engine:
        yield engine


def check_row(kind, out):
    if kind == "bad":
        assert out.finish_reason == "error" and out.invalid_request and out.token_ids == []
        assert out.error.startswith("structured_outputs.json: invalid JSON schema") and "nope" in out.error
        return
    if kind == "free":
        assert out.structured_complete is None and out.error is None
        return
    if kind == "json_object":  # free strings: noise may not close them in time
        assert out.structured_complete is (out.finish_reason == "stop") and out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        return
    assert out.finish_reason == "stop" and out.structured_complete is True, (kind, out.text, out.finish_reason)
    if kind == "json":
        jsonschema.validate(json.loads(out.text), BOUNDED_SCHEMA)
    elif kind == "choice":
        assert out.text in CHOICES
    else:
        assert re.fullmatch(REGEX, out.text), out.text


def test_every_constraint_kind_sync_and_async_give_valid_identical_outputs(llm):
    rows = job()
    results = {}
    for overlap in (False, True):
        llm.set_async_scheduling(overlap)
        outputs = llm.generate([prompt for _, prompt, _ in rows], [params for _, _, params in rows])
        for (kind, _, _), out in zip(rows, outputs):
            check_row(kind, out)
        results[overlap] = [(o.token_ids, o.finish_reason) for o in outputs]
    assert results[False] == results[True]  # seeded rows: the loop changes when masks are filled, not what
    texts = [o for (kind, _, _), o in zip(rows, outputs) if kind == "json"]
    assert len({o.text for o in texts}) > 1  # noise, not one fixed answer
    # The unconstrained rows are untouched by their constrained neighbours: the same tokens alone.
    free = [(prompt, params) for kind, prompt, params in rows if kind == "free"]
    alone = llm.generate([p for p, _ in free], [s for _, s in free])
    mixed = [o for (kind, _, _), o in zip(rows, outputs) if kind == "free"]
    assert [o.token_ids for o in alone] == [o.token_ids for o in mixed]
    assert llm.grammar_compile_cache().num_compiles == 5  # json, choice, regex, json_object, bad: once each


def test_constraints_with_n_logprobs_stop_strings_and_the_prefix_cache(llm):
    """n siblings each follow the grammar from the shared prompt (forked matchers), logprobs come with every
    constrained token, a stop string cuts a constrained output (not complete), and a second run served by the
    prefix cache gives the same seeded outputs."""
    llm.set_async_scheduling(True)
    prompt = "Describe one pet as a JSON object with its kind, age, tags and owner. " * 3
    params = [SamplingParams(temperature=1.0, seed=7, n=3, logprobs=2, max_tokens=200,
                             structured_outputs={"json": BOUNDED_SCHEMA}),
              SamplingParams(temperature=0, max_tokens=20, stop=[" light"], structured_outputs={"choice": ["blue light"]})]
    runs = [llm.generate([prompt, prompt], params) for _ in range(2)]
    for schema_out, cut in runs:
        assert len(schema_out.outputs) == 3 and len({c.text for c in schema_out.outputs}) > 1
        for c in schema_out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), BOUNDED_SCHEMA)
            assert len(c.logprobs) == len(c.token_ids)
            chosen = [p[t].logprob for p, t in zip(c.logprobs, c.token_ids)]
            assert all(-1e9 < lp <= 0 for lp in chosen) and c.cumulative_logprob == pytest.approx(sum(chosen), abs=1e-3)
        assert (cut.text, cut.finish_reason, cut.stop_reason, cut.structured_complete) == ("blue", "stop", " light", False)
    first, second = runs
    assert second[0].num_cached_tokens > 0 and second[1].num_cached_tokens > 0
    assert [c.token_ids for c in second[0].outputs] == [c.token_ids for c in first[0].outputs]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_every_constraint_kind_under_cuda_graphs_sync_and_async(text_model):
    """The device path: bf16 logits, the Triton mask kernel after a decode graph's replay, the bitmask's side-stream
    copy, and the async loop's split launch. (Tokens may differ between the loops here: batch shapes differ, and
    so do bf16 results; each output must be valid.)"""
    rows = job()
    with LLM(text_model, device="cuda", **ENGINE) as llm:
        assert llm._runner.graphs is not None
        for overlap in (False, True):
            llm.set_async_scheduling(overlap)
            outputs = llm.generate([prompt for _, prompt, _ in rows], [params for _, _, params in rows])
            for (kind, _, _), out in zip(rows, outputs):
                check_row(kind, out)


def test_cut_by_max_tokens_says_incomplete(llm):
    out = llm.generate("Describe a pet:", SamplingParams(max_tokens=3, seed=1,
                                                          structured_outputs={"json": BOUNDED_SCHEMA}))[0]
    assert out.finish_reason == "length" and out.structured_complete is False
    assert out.text.startswith("{")


@pytest.mark.slow
def test_preempted_constrained_rows_resume_where_their_grammar_was(llm, text_model):
    """A KV cache too small for the batch preempts rows mid-output and recomputes them; a row's matcher holds
    exactly its committed tokens (a step voided by the preemption is never accepted), so each seeded row gives the
    tokens it gives without preemption, in both loops."""
    regex = "([a-c][0-9] ){24}"  # about 55 tokens a row: three rows need 12 blocks of 16
    params = [SamplingParams(temperature=1.0, max_tokens=120, seed=i, structured_outputs={"regex": regex})
              for i in range(3)]
    llm.set_async_scheduling(False)
    reference = llm.generate(PROMPTS[:3], params)
    with LLM(text_model, num_kv_blocks=8, block_size=16, max_model_len=128, max_num_seqs=4) as small:
        for overlap in (False, True):
            small.set_async_scheduling(overlap)
            outputs = small.generate(PROMPTS[:3], params)
            assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
            assert all(o.structured_complete and re.fullmatch(regex, o.text) for o in outputs)
        assert small.get_metrics()["num_preemptions"] > 0


def test_a_constraint_is_validated_where_it_is_given():
    with pytest.raises(ValueError, match="structured_outputs: exactly one of"):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
    with pytest.raises(ValueError, match="unknown field.*schema"):
        SamplingParams(structured_outputs={"schema": {}})
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs="):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs == StructuredOutputsParams(
        choice=["a"])


def test_an_engine_whose_start_fails_stops_its_grammar_threads(text_model):
    """The grammar compile cache starts with the engine (its tokenizer tables build while the model loads); a
    start that fails after it (here an impossible max_model_len) stops its threads at once, not when the failed
    engine is collected (the exception's traceback keeps it alive)."""
    def grammar_threads():
        return {t for t in threading.enumerate() if t.name.startswith("grammar-compile-")}

    before = grammar_threads()
    with pytest.raises(ValueError, match="max_model_len") as failed:
        LLM(text_model, max_model_len=10**6)
    assert failed.value.__traceback__ is not None  # the failed engine is still referenced from here
    deadline = time.monotonic() + 10
    while grammar_threads() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not grammar_threads() - before


def test_a_grammar_vocabulary_that_cannot_be_built_is_the_engines_error_not_the_requests(text_model, monkeypatch):
    """When the engine cannot build its grammar vocabulary from the tokenizer, each constrained request fails with
    that reason as an engine error (HTTP 500), not as an invalid request (400); unconstrained rows run."""
    from nanovllm.structured import vocabulary

    def failing_build(tokenizer, vocab_size):
        raise RuntimeError("an unreadable tokenizer")

    monkeypatch.setattr(vocabulary, "build_vocabulary", failing_build)
    with LLM(text_model, **ENGINE) as engine:
        constrained, free = engine.generate(
            ["Answer:", "Hello"], [SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
                choice=["yes", "no"])), SamplingParams(max_tokens=4, ignore_eos=True)])
    assert constrained.outputs[0].finish_reason == "error" and not constrained.invalid_request
    assert "grammar vocabulary could not be built" in constrained.error and "an unreadable tokenizer" in constrained.error
    assert free.error is None and len(free.outputs[0].token_ids) == 4


def test_a_model_without_tokenizer_rejects_constraints():
    with LLM("tiny-qwen3", max_model_len=64) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(structured_outputs={"choice": ["a"]}))[0]
    assert out.finish_reason == "error" and "structured_outputs" in out.error and "no tokenizer" in out.error


class _Compile:
    """A compile the test finishes by hand."""

    def __init__(self):
        self.done = False
        self.waited = 0

    def ready(self):
        return self.done

    def wait(self, timeout=None):
        self.waited += 1


class _Row(SimpleNamespace):
    """A row grammar as the scheduler reads it: its stop ids, and a token the manager found rejected."""
    rejected_token = None
    dead_end = False  # some token could always follow here

    def rejection(self):
        return f"the grammar rejected sampled token {self.rejected_token}"


class _Grammars:
    """The scheduler's side of a grammar manager: rows start as plain records, released and preempted rows noted."""

    def __init__(self):
        self.released, self.preempted = [], []

    def start_row(self, seq):
        seq.grammar = _Row(stop_token_ids=(2, *seq.params.stop_token_ids))

    def release(self, seq):
        self.released.append(seq)

    def preempt(self, seq):
        self.preempted.append(seq)

    def drain(self):
        pass


def constrained_scheduler(rows: int, num_blocks: int = 64):
    """A scheduler with `rows` constrained sequences (EOS 2, max_tokens 3) whose compiles are done."""
    sched = Scheduler(BlockManager(num_blocks, 4, True), 8, 64, 256, {2}, grammars=_Grammars())
    seqs = [make_seq([5, 6, 7 + i], max_tokens=3) for i in range(rows)]
    for seq in seqs:
        seq.grammar_future = _Compile()
        seq.grammar_future.done = True
        sched.add(seq)
    return sched, seqs


def test_admission_skips_rows_still_compiling_and_keeps_their_place():
    sched = Scheduler(BlockManager(64, 4, True), 8, 64, 256, {2}, grammars=_Grammars())
    compiling, plain = make_seq([5, 6, 7], max_tokens=2), make_seq([8, 9], max_tokens=2)
    compiling.grammar_future = _Compile()
    sched.add(compiling)
    sched.add(plain)
    batch = sched.schedule()
    assert batch.seqs == [plain] and list(sched.waiting) == [compiling] and compiling.grammar is None
    compiling.grammar_future.done = True
    batch = sched.schedule()
    assert compiling in batch.seqs and compiling.status is SequenceStatus.RUNNING
    assert compiling.grammar.stop_token_ids == (2,)


def test_nothing_to_run_but_a_compile_waits_on_it():
    sched = Scheduler(BlockManager(64, 4, True), 8, 64, 256, {2}, grammars=_Grammars())
    seq = make_seq([5, 6, 7], max_tokens=2)
    seq.grammar_future = _Compile()
    sched.add(seq)
    assert not sched.schedule()
    sched.wait_for_compile()
    assert seq.grammar_future.waited == 1


def test_a_stop_token_ends_a_constrained_row_and_the_manager_hears_of_every_end():
    sched, (ending, going_on) = constrained_scheduler(2)
    sched.postprocess(sched.schedule(), [2, 11])
    assert ending.finish_reason == "stop" and going_on.status is SequenceStatus.RUNNING
    assert sched.grammars.released == [ending]
    sched.postprocess(sched.schedule(), [12])
    sched.postprocess(sched.schedule(), [13])  # its length limit
    assert going_on.finish_reason == "length" and sched.grammars.released == [ending, going_on]


def test_a_rejected_token_fails_that_row_at_its_next_postprocess():
    sched, (bad, good) = constrained_scheduler(2)
    sched.postprocess(sched.schedule(), [11, 12])
    bad.grammar.rejected_token = 11  # what the manager reports once its worker is done with the step
    sched.postprocess(sched.schedule(), [13, 14])
    assert bad.finish_reason == "error" and "rejected sampled token 11" in bad.error
    assert good.status is SequenceStatus.RUNNING


EXTRACTION_PROMPTS = [
    "Maria Lopez, 34, a senior data engineer at Finch Analytics (finance, remote) with 9 years of experience in "
    "Python, Spark and SQL. Email: maria.lopez@finch.io",
    "Tom Becker is 22 and an intern at Greenfield Labs, a healthcare startup (on site). Skills: Excel. "
    "Contact tom.b@greenfield.org",
    "Aiko Tanaka (41), principal architect, 18 years in the field, works remotely for Kumo Retail. Skills: Go, "
    "Kubernetes, Terraform. aiko@kumo.jp",
]


def test_embedded_smollm2_extraction_gives_valid_json_for_every_row():
    schema = json.loads((Path(__file__).parent.parent / "samples" / "extraction_schema.json").read_text())
    # A 135M model decoding greedily can repeat itself inside a free string ("john-john-…") until max_tokens;
    # bounding the one list of free strings (and its length) keeps every row well inside max_tokens.
    schema["properties"]["skills"]["items"]["maxLength"] = 24
    schema["properties"]["skills"]["maxItems"] = 4
    with LLM(max_model_len=512) as llm:
        conversations = [[{"role": "user", "content": f"Extract the person as JSON.\n\n{p}"}]
                         for p in EXTRACTION_PROMPTS]
        outputs = llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=320,
                                                         structured_outputs={"json": schema}))
    for out in outputs:
        assert out.finish_reason == "stop" and out.structured_complete, out.text
        jsonschema.validate(json.loads(out.text), schema)
