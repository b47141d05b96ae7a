"""The CLI's sampling fields: rows carry logprobs, n, penalties and logit controls; records and
OpenAI batch output carry logprobs in OpenAI's exact shapes and one choice per completion."""
import json

import pytest
from test_cli_run import invoke, read_records, write_jsonl

from nanovllm_cli.rows import RowError, RowParser

CHAT = [{"role": "user", "content": "hi"}]


def parse(row):
    return RowParser({"max_tokens": 5}, 0, "line").parse(7, row)


def test_plain_rows_take_every_new_field():
    fields = {"n": 2, "best_of": 3, "logprobs": 2, "prompt_logprobs": 1, "repetition_penalty": 1.2,
              "presence_penalty": 0.5, "frequency_penalty": -0.5, "min_tokens": 2, "logit_bias": {"17": 3.5},
              "allowed_token_ids": [1, 2, 17], "bad_words": ["no"], "include_stop_str_in_output": True,
              "skip_special_tokens": False}
    for row in ({"id": "a", "prompt": "x", **fields}, {"id": "a", "prompt": "x", "sampling_params": fields}):
        params = parse(row).params
        assert params.logit_bias == {17: 3.5}
        for name, value in fields.items():
            if name != "logit_bias":
                assert getattr(params, name) == value, name


def test_openai_fields_map_to_sampling_params():
    chat = parse({"custom_id": "c", "body": {"messages": CHAT, "logprobs": True, "top_logprobs": 3, "n": 2,
                                             "presence_penalty": 1.0, "max_completion_tokens": 7,
                                             "chat_template_kwargs": {"enable_thinking": False}}})
    assert (chat.params.logprobs, chat.params.n, chat.params.presence_penalty, chat.params.max_tokens) == (3, 2, 1.0, 7)
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    completion = parse({"custom_id": "d", "url": "/v1/completions",
                        "body": {"prompt": "x", "logprobs": 2, "echo": True, "best_of": 3, "n": 2,
                                 "logit_bias": {"5": -100}}})
    assert (completion.params.logprobs, completion.params.prompt_logprobs, completion.echo) == (2, 2, True)
    assert (completion.params.best_of, completion.params.logit_bias) == (3, {5: -100})


@pytest.mark.parametrize("row, problem", [
    ({"custom_id": "a", "body": {"messages": CHAT, "top_logprobs": 2}}, "body.top_logprobs needs body.logprobs"),
    ({"custom_id": "a", "body": {"messages": CHAT, "logprobs": 3}}, "body.logprobs must be true or false"),
    ({"custom_id": "a", "body": {"messages": CHAT, "echo": True}}, "unsupported field 'body.echo' for /v1/chat/completions"),
    ({"custom_id": "a", "body": {"messages": CHAT, "best_of": 2}}, "unsupported field 'body.best_of' for /v1/chat/completions"),
    ({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "logprobs": 21}}, "logprobs="),
    ({"custom_id": "a", "body": {"messages": CHAT, "n": -1}}, "n="),
    ({"id": "a", "prompt": "x", "presence_penalty": 3}, "presence_penalty="),
    ({"id": "a", "prompt": "x", "logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
    ({"id": "a", "prompt": "x", "frequency_penalty": True}, "frequency_penalty=True: must be a finite number"),
])
def test_bad_fields_name_the_field(row, problem):
    error = parse(row)
    assert isinstance(error, RowError) and problem in error.message, error


def test_openai_logprobs_and_choices_round_trip(text_model, tmp_path):  # noqa: F811
    lines = [
        {"custom_id": "chat", "body": {"messages": CHAT, "logprobs": True, "top_logprobs": 3, "n": 2,
                                       "max_tokens": 4, "temperature": 0}},
        {"custom_id": "cmpl", "url": "/v1/completions",
         "body": {"prompt": "The capital of France is", "logprobs": 2, "echo": True, "max_tokens": 3}},
        {"custom_id": "bad", "body": {"messages": CHAT, "tools": []}},
    ]
    out = tmp_path / "out.jsonl"
    result = invoke("run", write_jsonl(tmp_path / "in.jsonl", lines), "-o", out, "--model", text_model,
                    "--max-model-len", 256, "-q")
    assert result.exit_code == 1, result.stderr
    records = read_records(out, "custom_id")
    assert records["bad"]["response"]["status_code"] == 400 and "body.tools" in records["bad"]["error"]["message"]
    chat = records["chat"]["response"]["body"]
    assert [c["index"] for c in chat["choices"]] == [0, 1]
    assert chat["choices"][0]["message"] == chat["choices"][1]["message"]  # greedy
    assert chat["usage"]["completion_tokens"] == 8
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for position in content:
        assert set(position) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(position["top_logprobs"]) == 3 and position["logprob"] <= 0
        assert position["bytes"] == list(position["token"].encode())
        assert position["logprob"] == pytest.approx(position["top_logprobs"][0]["logprob"])  # greedy: the top one
    body = records["cmpl"]["response"]["body"]
    choice = body["choices"][0]
    assert choice["text"].startswith("The capital of France is")
    logprobs = choice["logprobs"]
    n = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert {k: len(v) for k, v in logprobs.items()} == dict.fromkeys(
        ("tokens", "token_logprobs", "top_logprobs", "text_offset"), n)
    assert logprobs["token_logprobs"][0] is None and all(lp <= 0 for lp in logprobs["token_logprobs"][1:])
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])


def test_plain_records_carry_logprobs_with_token_strings(text_model, tmp_path):  # noqa: F811
    rows = [{"id": "a", "prompt": "Hello there", "logprobs": 1, "prompt_logprobs": 1, "n": 2, "temperature": 0}]
    out = tmp_path / "out.jsonl"
    result = invoke("run", write_jsonl(tmp_path / "in.jsonl", rows), "-o", out, "--model", text_model,
                    "--max-model-len", 256, "--max-tokens", 3, "-q")
    assert result.exit_code == 0, result.stderr
    record = read_records(out)["a"]
    assert len(record["logprobs"]) == 3 and record["prompt_logprobs"][0] is None
    for position in record["logprobs"] + record["prompt_logprobs"][1:]:
        assert isinstance(position["token"], str) and position["rank"] >= 1 and len(position["top_logprobs"]) == 1
    assert [c["index"] for c in record["completions"]] == [0, 1]
    json.dumps(record)


def test_chat_template_kwargs_reach_the_template():
    from nanovllm_cli.tokenize import tokenize_row

    class RecordingTokenizer:
        def apply_chat_template(self, messages, template_kwargs):
            self.kwargs = template_kwargs
            return [1, 2]

    tokenizer = RecordingTokenizer()
    row = parse({"custom_id": "c", "body": {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}})
    assert tokenize_row(row, tokenizer).token_ids == [1, 2] and tokenizer.kwargs == {"enable_thinking": False}
