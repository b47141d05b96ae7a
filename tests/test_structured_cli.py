"""Structured outputs through `nanovllm run`: OpenAI `response_format` lines and plain rows' `structured_outputs`,
end to end on a tiny random Llama with SmolLM2's tokenizer (`text_model`). Bad constraints give their row a 400
error record; every other row runs."""
import json
import re

import jsonschema
from test_structured_engine import BOUNDED_SCHEMA, CHOICES, REGEX
from typer.testing import CliRunner

from nanovllm_cli.main import app


def run(model, rows, tmp_path, *extra):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(app, [str(a) for a in ("run", path, "-o", out, "--model", model, "--max-model-len",
                                                       512, "--max-tokens", 200, "--temperature", 1.0, "-q", *extra)])
    assert "Traceback" not in result.stderr, result.stderr
    return result, [json.loads(line) for line in out.read_text().splitlines()]


def chat_line(custom_id, response_format=None, **body):
    body = {"messages": [{"role": "user", "content": "Describe a pet."}], **body}
    if response_format is not None:
        body["response_format"] = response_format
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_openai_response_format_end_to_end(text_model, tmp_path):
    schema_format = {"type": "json_schema", "json_schema": {"name": "pet", "schema": BOUNDED_SCHEMA, "strict": True}}
    lines = [
        chat_line("schema", schema_format),
        chat_line("cut", schema_format, max_tokens=3),
        chat_line("object", {"type": "json_object"}, max_tokens=24),
        chat_line("text", {"type": "text"}, max_tokens=4),
        chat_line("bad-type", {"type": "xml"}),
        chat_line("bad-schema", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        {"custom_id": "completion", "url": "/v1/completions",
         "body": {"prompt": "A pet:", "response_format": schema_format}},
    ]
    result, records = run(text_model, lines, tmp_path, "--async")
    assert result.exit_code == 1, result.stderr  # two rows failed, the others ran
    by_id = {r["custom_id"]: r for r in records}

    def complete(custom_id):  # nanovllm's verdict, beside OpenAI's body
        return by_id[custom_id]["nanovllm"]["choices"][0]["structured_complete"]

    for custom_id in ("schema", "completion"):
        response = by_id[custom_id]["response"]
        assert response["status_code"] == 200
        choice = response["body"]["choices"][0]
        text = choice["message"]["content"] if custom_id == "schema" else choice["text"]
        assert choice["finish_reason"] == "stop" and complete(custom_id) is True
        jsonschema.validate(json.loads(text), BOUNDED_SCHEMA)
    cut = by_id["cut"]["response"]["body"]["choices"][0]
    assert cut["finish_reason"] == "length" and complete("cut") is False
    anything = by_id["object"]["response"]["body"]["choices"][0]  # any object: noise may not close its strings
    assert anything["message"]["content"].startswith("{") and complete("object") is (
        anything["finish_reason"] == "stop")
    assert "nanovllm" not in by_id["text"]  # unconstrained: nothing to add
    for custom_id, message in (("bad-type", "response_format.type='xml'"),
                               ("bad-schema", "structured_outputs.json: invalid JSON schema")):
        record = by_id[custom_id]
        assert record["response"]["status_code"] == 400, record
        assert message in record["error"]["message"]


def test_plain_rows_take_structured_outputs_at_top_level_or_in_sampling_params(text_model, tmp_path):
    rows = [
        {"id": "choice", "prompt": "Colour?", "structured_outputs": {"choice": CHOICES}},
        {"id": "regex", "prompt": "Code:", "sampling_params": {"structured_outputs": {"regex": REGEX}}},
        {"id": "unknown", "prompt": "x", "structured_outputs": {"json_schema": {}}},
        {"id": "plain", "prompt": "Hello", "max_tokens": 3},
    ]
    result, records = run(text_model, rows, tmp_path)
    assert result.exit_code == 1
    by_id = {r["id"]: r for r in records}
    assert by_id["choice"]["text"] in CHOICES and by_id["choice"]["structured_complete"] is True
    assert re.fullmatch(REGEX, by_id["regex"]["text"]) and by_id["regex"]["finish_reason"] == "stop"
    assert by_id["plain"]["error"] is None and by_id["plain"]["structured_complete"] is None
    assert "structured_outputs: unknown field(s) json_schema" in by_id["unknown"]["error"]


def test_bench_structured_reports_both_runs_and_compile_times(text_model, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(BOUNDED_SCHEMA))
    args = ["bench", "--model", text_model, "--max-model-len", 512, "--num-seqs", 4, "--input-len-range", 5, 20,
            "--output-len-range", 120, 160, "--structured", "json-schema", "--schema", schema, "--compare",
            "--no-warmup", "--json"]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["modes"]) == {"sync", "async"}
    for pair in report["modes"].values():
        constrained, free = pair["structured"], pair["unstructured"]
        # greedy noise may fill gaps with whitespace up to max_tokens; rows that complete end early
        assert constrained["rows_complete"] >= 1 and constrained["rows_failed"] == 0
        assert constrained["output_tokens"] == free["output_tokens"] < 4 * 160  # the same tokens unconstrained
        assert pair["structured_over_unstructured"] == constrained["output_tok_s"] / free["output_tok_s"]
    compile_s = report["structured"]["compile"]
    assert compile_s["cold_s"] > 0 and 0 <= compile_s["cached_s"] < compile_s["cold_s"]
    bad = CliRunner().invoke(app, ["bench", "--model", text_model, "--structured", "json-schema"])
    assert bad.exit_code == 2 and "needs --schema" in bad.output
