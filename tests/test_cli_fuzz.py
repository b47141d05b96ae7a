"""Arbitrary JSON values in every field of every row form (plain prompt, messages, prompt_token_ids, OpenAI batch
lines): the job exits 0 or 1, every input row gets exactly one record, and nothing prints a traceback. Whole-file
outcomes (repeated ids, no row an object) must be exit 2 with their one message, and only when they hold.

One engine (a tiny random Llama with SmolLM2's tokenizer and chat template) serves every example."""
import copy
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from nanovllm import LLM
from nanovllm_cli import options
from nanovllm_cli.main import app
from nanovllm_cli.rows import OPENAI_OTHER_KEYS, OPENAI_SAMPLING_KEYS, SAMPLING_FIELDS, row_id

# Values at the edges of what the engine holds (int64, float32, Unicode) come first: hypothesis tries them often.
EDGES = st.sampled_from([2**63, -2**63 - 1, 2**63 - 1, float("nan"), float("inf"), -float("inf"), 1e39, 0, -1, "",
                         "\ud800", [], {}]).map(copy.deepcopy)  # a fresh copy: rows() may fill a {} it drew
# Values some field takes (limits of n, logprobs, penalties, logit_bias; constraints), so that fields meet each other.
VALID = st.sampled_from([128, 20, 2, 100, -100, 2.0, -2.0, 0.5, {"5": 100}, {"5": -100}, [5, 6], ["Hi", "there"],
                         {"json_object": True}, {"type": "json_object"}, {"choice": ["yes", "no"]},
                         {"regex": "[a-z]{1,5}"}, {"json": {"type": "integer"}}]).map(copy.deepcopy)
SCALARS = (EDGES | VALID | st.none() | st.booleans() | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=20) | st.integers(min_value=-2**70, max_value=2**70))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                          max_size=4), max_leaves=8)
SAMPLING = list(SAMPLING_FIELDS)
CHAT = [{"role": "user", "content": "Hi"}]
TEMPLATES = {
    "prompt": {"id": "p", "prompt": "Hello there", "max_tokens": 3},
    "messages": {"id": "m", "messages": CHAT, "max_tokens": 3},
    "token_ids": {"id": "t", "prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 3}},
    "openai_chat": {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"messages": CHAT, "max_tokens": 3}},
    "openai_completion": {"custom_id": "o", "method": "POST", "url": "/v1/completions",
                          "body": {"prompt": "Once", "max_tokens": 3}},
}


def openai_fields(endpoint: str) -> list[str]:
    return ["custom_id", "method", "url", "body",
            *(f"body.{key}" for key in sorted({*OPENAI_SAMPLING_KEYS, *OPENAI_OTHER_KEYS[endpoint]}))]


# Every field a row of each form may set, taken from rows.py: a new field is fuzzed as soon as it exists.
FIELDS = {"prompt": ["id", "prompt", "sampling_params", *SAMPLING],
          "messages": ["id", "messages", "chat_template_kwargs", "sampling_params", *SAMPLING],
          "token_ids": ["id", "prompt_token_ids", "sampling_params", *SAMPLING],
          "openai_chat": openai_fields("chat"), "openai_completion": openai_fields("completions")}
# NANOVLLM_FUZZ_EXAMPLES=3000 searches longer, with a random seed; CI runs the same examples every time.
EXAMPLES = int(os.environ.get("NANOVLLM_FUZZ_EXAMPLES", 0))


@st.composite
def rows(draw):
    kind = draw(st.sampled_from(sorted(TEMPLATES)))
    row = json.loads(json.dumps(TEMPLATES[kind]))
    for name in draw(st.lists(st.sampled_from(FIELDS[kind]), min_size=1, max_size=3, unique=True)):
        value = draw(JSON)
        if name == "sampling_params" and isinstance(row.get(name), dict) and draw(st.booleans()):
            row[name][draw(st.sampled_from(SAMPLING))] = value  # a field inside it
        elif name.startswith("body.") and isinstance(row.get("body"), dict):
            row["body"][name[5:]] = value
        else:
            row[name] = value
    return row


@pytest.fixture(scope="module")
def shared_engine(text_model):
    llm = LLM(text_model, max_model_len=64, num_kv_blocks=64, max_num_seqs=4)
    release, llm.exit = llm.exit, lambda: None  # each job exits its engine when it ends; this one serves them all
    yield llm
    release()


@settings(max_examples=EXAMPLES or 200, deadline=None, derandomize=not EXAMPLES,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists((rows() | JSON).map(json.dumps) | st.sampled_from(["{not json", "[1, 2", "\x00\xff"]),
                      min_size=1, max_size=6))
def test_no_row_crashes_the_job_or_loses_its_record(lines, shared_engine, tmp_path, monkeypatch):
    monkeypatch.setattr(options, "load_llm", lambda engine, seed=None: shared_engine)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(text + "\n" for text in lines))  # json.dumps writes NaN, Infinity, \ud800 escapes
    result = CliRunner().invoke(app, ["run", str(path), "-o", str(out), "--overwrite", "-q", "--max-tokens", "3"])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.stderr, result.stderr
    parsed = []
    for number, text in enumerate(lines, 1):
        try:
            parsed.append((number, json.loads(text)))
        except ValueError:
            parsed.append((number, None))
    ids = [row_id(n, v) for n, v in parsed]
    if not any(isinstance(v, dict) for _, v in parsed):
        assert result.exit_code == 2 and "is not JSON Lines" in result.stderr
        return
    if len(set(ids)) < len(ids):
        assert result.exit_code == 2 and "repeats ids" in result.stderr
        return
    assert result.exit_code in (0, 1), result.stderr
    records = [json.loads(text) for text in out.read_text().splitlines()]
    got = sorted(str(r["custom_id"] if "custom_id" in r else r["id"]) for r in records)
    assert got == sorted(ids), result.stderr
    assert (result.exit_code == 1) == any(r["error"] is not None for r in records)
    assert not shared_engine.has_unfinished_requests()



# ---- row templates: a row's chat_template_kwargs and messages ------------------------------------------------------

HOSTILE_TEMPLATES = ["{{ 1/0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ '%0999999999d' % 1 }}",
                     "{% for i in range(10**9) %}x{% endfor %}", "{% for m in messages %}{{ m.content }}{% endfor %}",
                     "{{ messages[0]['content'] * 10**9 }}", "{% set x = [] %}{{ x.append }}"]
TEMPLATE_KWARG_NAMES = ["chat_template", "tokenize", "add_generation_prompt", "return_dict", "padding", "max_length",
                        "tools", "documents", "enable_thinking", "messages", "raise_exception", "bos_token"]
TEMPLATE_VALUES = st.sampled_from(HOSTILE_TEMPLATES) | JSON | st.text(max_size=40)
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", ""])
                                           | st.text(max_size=5), "content": st.text(max_size=30) | JSON}),
                    min_size=0, max_size=3) | JSON


@st.composite
def template_rows(draw):
    values = st.dictionaries(st.sampled_from(TEMPLATE_KWARG_NAMES) | st.text(max_size=6), TEMPLATE_VALUES, max_size=3)
    own_template = st.builds(lambda template, others: {**others, "chat_template": template}, TEMPLATE_VALUES, values)
    kwargs = draw(own_template | values | JSON)
    messages = draw(st.just(CHAT) | MESSAGES)
    if draw(st.booleans()):
        return {"custom_id": draw(st.text(min_size=1, max_size=4)), "body": {
            "messages": messages, "max_tokens": 2, "chat_template_kwargs": kwargs}}
    return {"id": draw(st.text(min_size=1, max_size=4)), "messages": messages, "max_tokens": 2,
            "chat_template_kwargs": kwargs}


def run_lines(lines, engine, tmp_path, monkeypatch, *flags):
    """The job's result and its records (None when OUTPUT was never written)."""
    monkeypatch.setattr(options, "load_llm", lambda engine_options, seed=None: engine)
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(app, ["run", str(path), "-o", str(out), "--overwrite", "-q", "--max-tokens", "2",
                                      *flags])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
    assert "Traceback" not in result.stderr, result.stderr
    return result, [json.loads(text) for text in out.read_text().splitlines()] if out.exists() else None


def check_one_record_each(lines, result, records):
    ids = [row_id(n, v) for n, v in enumerate(lines, 1)]
    if len(set(ids)) < len(ids):
        assert result.exit_code == 2 and "repeats ids" in result.stderr
        return None
    assert result.exit_code in (0, 1), result.stderr
    by_id = {str(r["custom_id"] if "custom_id" in r else r["id"]): r for r in records}
    assert sorted(by_id) == sorted(ids), result.stderr
    return by_id


@settings(max_examples=EXAMPLES or 60, deadline=None, derandomize=not EXAMPLES,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(template_rows(), min_size=1, max_size=4))
def test_no_row_template_can_stop_the_job(lines, shared_engine, tmp_path, monkeypatch):
    """Whatever a row puts in chat_template_kwargs and messages, the job answers every row; a row that names a
    template of its own is refused (by name, unless something else in it was wrong first), never rendered."""
    result, records = run_lines(lines, shared_engine, tmp_path, monkeypatch)
    by_id = check_one_record_each(lines, result, records)
    if by_id is None:
        return
    for number, line in enumerate(lines, 1):
        kwargs = line.get("chat_template_kwargs", line.get("body", {}).get("chat_template_kwargs"))
        if isinstance(kwargs, dict) and "chat_template" in kwargs:
            record = by_id[row_id(number, line)]
            message = record["error"]["message"] if isinstance(record["error"], dict) else record["error"]
            assert message and "the chat template failed" not in message, record
    assert not shared_engine.has_unfinished_requests()


# ---- structured constraints ----------------------------------------------------------------------------------------

REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/missing", "file:///etc/passwd", "http://example.com/s.json",
                        "other.json#/a", "#/properties/x"])


@st.composite
def schemas(draw):
    depth, width = draw(st.integers(0, 40)), draw(st.sampled_from([0, 1, 3, 1000, 1100]))
    schema = draw(st.sampled_from([{"type": "integer"}, {"type": "boolean"}, {"enum": ["a", 1]}, {}]))
    if draw(st.booleans()):
        schema = {"$ref": draw(REFS)}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}, "required": draw(st.sampled_from([[], ["x"]]))}
    if width:
        schema = {"type": "object", "properties": {**{f"p{i}": {"type": "integer"} for i in range(width)}, "x": schema}}
    if draw(st.booleans()):
        schema["$defs"] = {"a": draw(st.sampled_from([{"$ref": "#/$defs/a"}, {"type": "string"}, {"$ref": "#"}]))}
    return schema


CONSTRAINTS = st.one_of(
    schemas().map(lambda s: {"json": s}),
    st.integers(0, 1100).map(lambda n: {"choice": [f"option {i}" for i in range(n)]}),
    st.text(max_size=30).map(lambda r: {"regex": r}),
    st.integers(1, 20_000).map(lambda n: {"regex": "a" * n}),
    st.sampled_from(['root ::= "a" b\nb ::= b "x"', 'root ::= root', 'root ::= "yes" | "no"', "root ::= [",
                     'root ::= "' + "x" * 70_000 + '"']).map(lambda g: {"grammar": g}),
    JSON.map(lambda value: {"json": value}),
    JSON,
)


@settings(max_examples=EXAMPLES or 40, deadline=None, derandomize=not EXAMPLES,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(constraints=st.lists(CONSTRAINTS, min_size=1, max_size=3), openai=st.booleans())
def test_no_constraint_can_stop_the_job_or_pass_as_an_engine_failure(constraints, openai, shared_engine, tmp_path,
                                                                    monkeypatch):
    """Any constraint is a result or its row's 400 error naming why (a size past a limit names the limit): never a
    failure inside the engine, whatever its size or its references."""
    if openai:
        lines = [{"custom_id": f"c{i}", "body": {"messages": CHAT, "max_tokens": 2, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": c.get("json") if isinstance(c, dict) else c}}}}
            for i, c in enumerate(constraints)]
    else:
        lines = [{"id": f"c{i}", "prompt": "Hello", "max_tokens": 2, "structured_outputs": c}
                 for i, c in enumerate(constraints)]
    result, records = run_lines(lines, shared_engine, tmp_path, monkeypatch)
    by_id = check_one_record_each(lines, result, records)
    for record in by_id.values():
        if openai:
            status = record["response"]["status_code"]
            assert status in (200, 400), record
            message = record["error"]["message"] if status == 400 else None
        else:
            message = record["error"]
        if message is not None:
            assert "rejected sampled token" not in message and "the engine failed" not in message, message
            assert len(message) < 1000, message
            if "limit" in message:
                assert "more than the limit" in message or "deep (the limit)" in message, message
    assert not shared_engine.has_unfinished_requests()


# ---- output paths --------------------------------------------------------------------------------------------------

OUTPUT_KINDS = ["absent", "empty", "results", "fifo", "link-dev-null", "link-dev-full", "dangling-link", "link-file",
                "folder", "link-folder", "missing-folders", "under-a-file"]


def make_output(kind: str, root, suffix: str):
    """An OUTPUT path of `kind` under `root`; whether the job may write it (a regular file, or none yet)."""
    out = root / f"out{suffix}"
    if kind == "empty":
        out.write_text("")
    elif kind == "results":
        out.write_text(json.dumps({"id": "old", "error": None}) + "\n") if suffix == ".jsonl" else out.write_text("x")
    elif kind == "fifo":
        os.mkfifo(out)
    elif kind in ("link-dev-null", "link-dev-full"):
        out.symlink_to("/dev/null" if kind == "link-dev-null" else "/dev/full")
    elif kind == "dangling-link":
        out.symlink_to(root / f"target{suffix}")
    elif kind == "link-file":
        (root / f"target{suffix}").write_text("")
        out.symlink_to(root / f"target{suffix}")
    elif kind == "folder":
        out.mkdir()
    elif kind == "link-folder":
        (root / "folder").mkdir()
        out.symlink_to(root / "folder")
    elif kind == "missing-folders":
        out = root / "a" / "b" / f"out{suffix}"
    elif kind == "under-a-file":
        (root / "file").write_text("x")
        out = root / "file" / f"out{suffix}"
    return out, kind in ("absent", "empty", "results", "dangling-link", "link-file", "missing-folders")


@settings(max_examples=EXAMPLES or 30, deadline=None, derandomize=not EXAMPLES,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(kind=st.sampled_from(OUTPUT_KINDS), suffix=st.sampled_from([".jsonl", ".parquet"]), overwrite=st.booleans(),
       resume=st.booleans())
def test_every_output_path_is_written_whole_or_refused_in_one_line(kind, suffix, overwrite, resume, shared_engine,
                                                                   tmp_path_factory, monkeypatch):
    """OUTPUT is a regular file (or none yet) after links: then the job writes every record there; anything else
    (a FIFO, a device, a folder) is exit 2 with one line before anything runs, and never blocks."""
    monkeypatch.setattr(options, "load_llm", lambda engine_options, seed=None: shared_engine)
    root = tmp_path_factory.mktemp("out")
    out, writable = make_output(kind, root, suffix)
    path = root / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [i + 1]}) + "\n" for i in range(3)))
    flags = ["--overwrite"] * overwrite + ["--resume"] * resume
    result = CliRunner().invoke(app, ["run", str(path), "-o", str(out), "-q", "--max-tokens", "2", *flags])
    assert "Traceback" not in result.stderr, result.stderr
    # OUTPUT holding results of other rows: --resume finds them foreign (a record of no row of INPUT, or not
    # Parquet), and without --resume only --overwrite may replace them.
    refused = not writable or (kind == "results" and (resume or not overwrite))
    if refused:
        assert result.exit_code == 2 and result.stderr.count("error:") == 1, (kind, result.stderr)
        assert not out.exists() or kind != "absent"
        return
    assert result.exit_code == 0, (kind, result.stderr)
    if suffix == ".jsonl":
        ids = [json.loads(line)["id"] for line in out.read_text().splitlines()]
    else:
        import pyarrow.parquet as pq

        ids = pq.read_table(out).column("id").to_pylist()
    assert sorted(ids) == ["r0", "r1", "r2"]
