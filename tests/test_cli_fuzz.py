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

