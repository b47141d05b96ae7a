"""OpenAI batch lines replay with OpenAI's semantics: its default temperature (1), `echo` with `logprobs` as
/v1/completions gives them, a `prompt` given as an array, a response body with OpenAI's keys only (nanovllm's own
figures beside it), and the Batch API's error file (`--error-file`).

Texts, token logprobs and prompt logprobs are checked against the Python API (`LLM.generate`) on the same prompts
with the sampling each line implies.
"""
import json

import pytest
from typer.testing import CliRunner

from nanovllm import LLM, SamplingParams
from nanovllm_cli.main import app
from nanovllm_cli.rows import derive_seed

PROMPT = "The capital of France is"
# OpenAI's keys: a completion or chat.completion body, its choices, a chat message, usage.
BODY_KEYS = {"id", "object", "created", "model", "choices", "usage", "system_fingerprint", "service_tier"}
COMPLETION_CHOICE_KEYS = {"index", "text", "logprobs", "finish_reason"}
CHAT_CHOICE_KEYS = {"index", "message", "logprobs", "finish_reason"}
MESSAGE_KEYS = {"role", "content", "refusal", "tool_calls", "annotations", "audio"}
USAGE_KEYS = {"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details", "completion_tokens_details"}


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def completions(custom_id, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": {"max_tokens": 4, **body}}


def run_lines(model, tmp_path, lines, *options, name="out.jsonl"):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / name
    result = invoke("run", path, "-o", out, "--model", model, "--max-model-len", 256, "-q", *options)
    records = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())} if out.exists() else {}
    return result, records


@pytest.fixture(scope="module")
def llm(text_model):
    return LLM(text_model, max_model_len=256)


def texts(record):
    return [c["text"] for c in record["response"]["body"]["choices"]]


def test_lines_sample_at_openais_default_temperature_unless_the_option_says(llm, text_model, tmp_path):
    lines = [completions("two", prompt=PROMPT, n=2), completions("cold", prompt=PROMPT, n=2, temperature=0)]
    result, records = run_lines(text_model, tmp_path, lines)
    assert result.exit_code == 0, result.stderr
    hot = llm.generate(PROMPT, SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=derive_seed(0, "two")))[0]
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0]
    assert texts(records["two"]) == [c.text for c in hot.outputs]
    assert len(set(texts(records["two"]))) == 2  # n: 2 gives two samples, as OpenAI does
    assert texts(records["cold"]) == [greedy.text] * 2  # a line's own temperature wins
    result, records = run_lines(text_model, tmp_path, lines[:1], "--temperature", 0, name="option.jsonl")
    assert texts(records["two"]) == [greedy.text] * 2  # --temperature given: it applies to OpenAI lines too


def test_echo_with_logprobs_gives_the_prompt_tokens_text_and_offsets(llm, text_model, tmp_path):
    lines = [completions("echo", prompt=PROMPT, echo=True, logprobs=2, temperature=0),
             completions("plain", prompt=PROMPT, logprobs=2, temperature=0)]
    result, records = run_lines(text_model, tmp_path, lines)
    assert result.exit_code == 0, result.stderr
    out = llm.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0, logprobs=2, prompt_logprobs=2))[0]
    tokenizer = llm.prompts.tokenizer
    prompt_texts = [tokenizer.decode([t]) for t in out.prompt_token_ids]
    n_prompt = len(out.prompt_token_ids)

    echo = records["echo"]["response"]["body"]["choices"][0]
    assert echo["text"] == PROMPT + out.text
    logprobs = echo["logprobs"]
    assert logprobs["tokens"][:n_prompt] == prompt_texts  # the first prompt token too (it has no logprob)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:n_prompt] == pytest.approx(
        [out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i > 0])
    assert logprobs["token_logprobs"][n_prompt:] == pytest.approx(
        [p[t].logprob for t, p in zip(out.token_ids, out.outputs[0].logprobs)])
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and offsets[n_prompt] == len(PROMPT)  # offsets into the echoed text
    assert all(offsets[i + 1] == offsets[i] + len(logprobs["tokens"][i]) for i in range(len(offsets) - 1))
    assert "".join(logprobs["tokens"]) == echo["text"]

    plain = records["plain"]["response"]["body"]["choices"][0]
    assert plain["text"] == out.text
    assert plain["logprobs"]["tokens"] == logprobs["tokens"][n_prompt:]
    assert plain["logprobs"]["text_offset"] == offsets[n_prompt:]  # from the prompt's start, echoed or not


def test_prompt_arrays_follow_v1_completions(llm, text_model, tmp_path):
    ids = llm.prompts.tokenizer.encode(PROMPT)
    lines = [completions("string", prompt=PROMPT, temperature=0), completions("one", prompt=[PROMPT], temperature=0),
             completions("ids", prompt=[ids], temperature=0), completions("two", prompt=[PROMPT, "Hello"]),
             completions("mixed", prompt=[PROMPT, [1, 2]])]
    result, records = run_lines(text_model, tmp_path, lines)
    assert result.exit_code == 1  # the two refused lines
    assert texts(records["one"]) == texts(records["ids"]) == texts(records["string"])
    assert records["two"]["response"]["status_code"] == 400
    assert "holds 2 prompts" in records["two"]["error"]["message"]
    assert "put each prompt on a line of its own" in records["two"]["error"]["message"]
    assert "must be a string, an array of token ids" in records["mixed"]["error"]["message"]


def test_response_bodies_have_openais_keys_only(text_model, tmp_path):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    lines = [completions("text", prompt=PROMPT, logprobs=1),
             {"custom_id": "chat", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "logprobs": True}},
             {"custom_id": "json", "url": "/v1/chat/completions",
              "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                       "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}}}]
    result, records = run_lines(text_model, tmp_path, lines, "--include-token-ids")
    assert result.exit_code == 0, result.stderr
    for custom_id, record in records.items():
        body = record["response"]["body"]
        assert set(body) <= BODY_KEYS and set(body["usage"]) <= USAGE_KEYS, custom_id
        for choice in body["choices"]:
            assert set(choice) == (COMPLETION_CHOICE_KEYS if custom_id == "text" else CHAT_CHOICE_KEYS), custom_id
            assert "message" not in choice or set(choice["message"]) <= MESSAGE_KEYS
        # nanovllm's own figures sit beside the response, by choice index
        added = record["nanovllm"]["choices"]
        assert [a["index"] for a in added] == [c["index"] for c in body["choices"]]
        assert all(len(a["token_ids"]) == body["usage"]["completion_tokens"] for a in added)
    assert records["json"]["nanovllm"]["choices"][0]["structured_complete"] is True
    assert "structured_complete" not in records["text"]["nanovllm"]["choices"][0]


def test_error_file_takes_the_failed_lines_and_resume_reads_both(text_model, tmp_path):
    lines = [completions("good", prompt=PROMPT), completions("bad", prompt=PROMPT, temperature=-1),
             completions("good-2", prompt="Hello")]
    errors = tmp_path / "errors.jsonl"
    result, records = run_lines(text_model, tmp_path, lines, "--error-file", errors)
    assert result.exit_code == 1
    assert set(records) == {"good", "good-2"} and all(r["error"] is None for r in records.values())
    failed = [json.loads(line) for line in errors.read_text().splitlines()]
    assert [r["custom_id"] for r in failed] == ["bad"]
    assert failed[0]["response"]["status_code"] == 400 and "temperature" in failed[0]["error"]["message"]
    again, _ = run_lines(text_model, tmp_path, lines, "--error-file", errors, "--resume", "--json")
    assert again.exit_code == 1 and json.loads(again.stdout)["records_written"] == 0  # all three answered before
    retried, records = run_lines(text_model, tmp_path, lines, "--error-file", errors, "--retry-failed", "--json")
    assert json.loads(retried.stdout)["records_written"] == 1 and len(errors.read_text().splitlines()) == 1
    same, _ = run_lines(text_model, tmp_path, lines, "--error-file", tmp_path / "out.jsonl", "--overwrite")
    assert same.exit_code == 2 and "is OUTPUT" in same.stderr
    parquet, _ = run_lines(text_model, tmp_path, lines, "--error-file", tmp_path / "errors.parquet", "--overwrite")
    assert parquet.exit_code == 2 and "--error-file must be a local .jsonl file" in parquet.stderr
