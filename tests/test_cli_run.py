"""`nanovllm run` end to end through Typer's runner: row forms, formats, errors, exit codes, summary.

Generated text is checked against the Python API (`LLM.generate` / `LLM.chat`) on the same rows. Most tests use
a tiny random Llama with SmolLM2's tokenizer and chat template (fast, and its wide init keeps greedy choices
clear of near-ties); one runs the embedded default model as `make run` does.
"""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from nanovllm import LLM, SamplingParams
from nanovllm_cli.main import app
from nanovllm_cli.rows import derive_seed

SYSTEM = ("You are a meticulous assistant for a small engineering team. Answer briefly and precisely, prefer "
          "concrete numbers, and say when you are unsure.")
ROWS = [
    {"id": "plain", "prompt": "The capital of France is"},
    {"id": "chat-sky", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Why blue?"}]},
    {"id": "ids", "prompt_token_ids": [504, 3458, 282, 4649, 314]},
    {"prompt": "Once upon a time", "max_tokens": 3},
    {"id": "chat-tea", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tea?"}],
     "sampling_params": {"max_tokens": 6}},
    {"id": "hot", "prompt": "Roses are red,", "temperature": 0.8},
]
MAX_TOKENS = 5
ENGINE = {"max_model_len": 256}


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def write_jsonl(path, rows):
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def write_parquet(path, rows):
    columns = dict.fromkeys(k for row in rows for k in row)
    pq.write_table(pa.Table.from_pydict({k: [row.get(k) for row in rows] for k in columns}), path)
    return path


def read_records(path, id_key="id"):
    rows = pq.read_table(path).to_pylist() if path.suffix == ".parquet" else [
        json.loads(line) for line in path.read_text().splitlines()]
    by_id = {row[id_key]: row for row in rows}
    assert len(by_id) == len(rows), "an id appears twice"
    return by_id


def reference(model, rows, engine=None, max_tokens=MAX_TOKENS, seed=0):
    """Each row through LLM.generate / LLM.chat with the sampling the CLI gives it."""
    llm = LLM(model, **(ENGINE if engine is None else engine))
    outputs = {}
    for number, row in enumerate(rows, 1):
        row_id = str(row.get("id", number))
        settings = {"temperature": 0.0, "max_tokens": max_tokens, "seed": derive_seed(seed, row_id)}
        settings.update({k: v for k, v in row.items() if k in ("max_tokens", "temperature")})
        settings.update(row.get("sampling_params", {}))
        params = SamplingParams(**settings)
        if "messages" in row:
            outputs[row_id] = llm.chat(row["messages"], params)[0]
        else:
            outputs[row_id] = llm.generate(row.get("prompt", row.get("prompt_token_ids")), params)[0]
    return outputs


def assert_matches(records, expected):
    assert set(records) == set(expected)
    for row_id, out in expected.items():
        record = records[row_id]
        assert record["error"] is None, record
        assert record["text"] == out.text, row_id
        assert record["token_ids"] == out.token_ids and record["prompt_token_ids"] == out.prompt_token_ids
        assert (record["finish_reason"], record["prompt_tokens"], record["completion_tokens"]) == (
            out.finish_reason, out.num_prompt_tokens, len(out.token_ids))


@pytest.fixture(scope="module")
def expected(text_model):
    return reference(text_model, ROWS)


def run_rows(text_model, path, out, *extra):
    return invoke("run", path, "-o", out, "--model", text_model, "--max-model-len", 256, "--max-tokens", MAX_TOKENS,
                  "--include-token-ids", "-q", *extra)


def test_help_and_version():
    top = invoke("--help")
    assert top.exit_code == 0 and "run" in top.stdout and "inspect-cache" in top.stdout
    run_help = invoke("run", "--help")
    for option in ("--output", "--resume", "--input-format", "--no-reorder", "--async", "--max-num-seqs",
                   "--gpu-memory-utilization", "--json", "Exit codes"):
        assert option in run_help.stdout, option
    assert "--num-blocks" in invoke("inspect-cache", "--help").stdout
    version = invoke("--version")
    assert version.exit_code == 0 and version.stdout.strip().startswith("nanovllm 0.")


def test_help_has_no_type_on_flags_and_completion_completes_commands_and_options():
    for command in ([], ["run"], ["bench"], ["inspect-cache"]):
        text = invoke(*command, "--help").stdout
        assert "<bool>" not in text and "--help" in text, command  # a flag takes no value
    assert "--install-completion" in invoke("--help").stdout
    for words, word, expected in (("nanovllm ru", 1, "run"), ("nanovllm run in.jsonl --orde", 3, "--ordered"),
                                  ("nanovllm run in.jsonl --no-enable", 3, "--no-enable-prefix-caching")):
        completed = CliRunner().invoke(app, [], prog_name="nanovllm", env={
            "_NANOVLLM_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": str(word)})
        assert completed.stdout.split() == [expected], words


def test_python_dash_m_nanovllm_runs_the_command_line_and_import_does_not():
    import subprocess
    import sys

    version = subprocess.run([sys.executable, "-m", "nanovllm", "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("nanovllm 0."), version.stderr
    probe = "import sys, nanovllm; print('nanovllm_cli' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "False"


def test_every_row_form_matches_the_python_api(text_model, expected, tmp_path):
    out = tmp_path / "out.jsonl"
    result = run_rows(text_model, write_jsonl(tmp_path / "in.jsonl", ROWS), out)
    assert result.exit_code == 0, result.stderr
    records = read_records(out)
    assert_matches(records, expected)
    assert list(records["4"]) == ["id", "text", "finish_reason", "prompt_tokens", "completion_tokens",
                                  "cached_tokens", "error", "structured_complete", "input_fingerprint",
                                  "prompt_token_ids", "token_ids"]
    assert records["4"]["completion_tokens"] <= 3 and records["chat-tea"]["completion_tokens"] <= 6
    assert records["chat-tea"]["cached_tokens"] >= 16  # shares the system prompt with chat-sky


def test_default_output_name_and_async(text_model, expected, tmp_path):
    path = write_jsonl(tmp_path / "batch.jsonl", ROWS)
    result = invoke("run", path, "--model", text_model, "--max-model-len", 256, "--max-tokens", MAX_TOKENS,
                    "--include-token-ids", "--async")
    assert result.exit_code == 0, result.stderr
    assert "nanovllm run" in result.stderr and result.stdout == ""  # the summary table goes to stderr
    assert_matches(read_records(tmp_path / "batch.results.jsonl"), expected)


def test_parquet_in_and_out(text_model, expected, tmp_path):
    path = write_parquet(tmp_path / "rows.data", ROWS)  # no suffix to tell the format
    out = tmp_path / "out.parquet"
    assert run_rows(text_model, path, out, "--input-format", "parquet").exit_code == 0
    assert_matches(read_records(out), expected)
    assert not (tmp_path / "out.parquet.journal.jsonl").exists()


def openai_lines():
    lines = []
    for number, row in enumerate(ROWS, 1):
        body = {"max_tokens": row.get("max_tokens", MAX_TOKENS), "temperature": row.get("temperature", 0.0),
                **row.get("sampling_params", {})}
        if "messages" in row:
            url, body["messages"] = "/v1/chat/completions", row["messages"]
        else:
            url, body["prompt"] = "/v1/completions", row.get("prompt", row.get("prompt_token_ids"))
        lines.append({"custom_id": str(row.get("id", number)), "method": "POST", "url": url, "body": body})
    return lines


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_openai_batch_round_trip(text_model, expected, tmp_path, suffix):
    bad = {"custom_id": "bad", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    path = write_jsonl(tmp_path / "batch.jsonl", [*openai_lines(), bad])
    out = tmp_path / f"out{suffix}"
    result = run_rows(text_model, path, out)
    assert result.exit_code == 1, result.stderr
    records = read_records(out, "custom_id")
    if suffix == ".parquet":  # nested objects are JSON text in Parquet
        records = {k: {**r, "response": json.loads(r["response"]), "error": r["error"] and json.loads(r["error"]),
                       "nanovllm": r["nanovllm"] and json.loads(r["nanovllm"])} for k, r in records.items()}
    assert set(records) == {*expected, "bad"}
    for custom_id, out in expected.items():
        record = records[custom_id]
        assert record["id"].startswith("batch_req_") and record["error"] is None
        assert record["response"]["status_code"] == 200
        body = record["response"]["body"]
        choice = body["choices"][0]
        chat = custom_id.startswith("chat-")
        assert body["object"] == ("chat.completion" if chat else "text_completion")
        assert (choice["message"]["content"] if chat else choice["text"]) == out.text
        assert choice["finish_reason"] == out.finish_reason and "token_ids" not in choice  # OpenAI's keys only
        assert record["nanovllm"]["choices"] == [{"index": 0, "token_ids": out.token_ids}]
        usage = body["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (out.num_prompt_tokens, len(out.token_ids))
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert "cached_tokens" in usage["prompt_tokens_details"]
    failed = records["bad"]
    assert failed["response"]["status_code"] == 400
    assert failed["error"]["message"].startswith("line 7: unsupported url")
    assert failed["response"]["body"]["error"]["message"] == failed["error"]["message"]


BAD_ROWS = [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "must be a JSON object"),
    ({"id": "no-prompt"}, "none of 'prompt'"),
    ({"id": "int-prompt", "prompt": 5}, "'prompt' must be a non-empty string"),
    ({"id": "bad-messages", "messages": "hi"}, "'messages' must be a non-empty array"),
    ({"id": "bad-ids", "prompt_token_ids": [1, "x"]}, "array of integer token ids"),
    ({"id": "bad-temperature", "prompt_token_ids": [1, 2], "temperature": -1}, "invalid sampling parameters"),
    ({"id": "too-long", "prompt_token_ids": [7] * 40}, "max_model_len is 32"),
    ({"id": "vocab", "prompt_token_ids": [1, 10**6]}, "outside the vocabulary"),
    ({"id": "several", "custom_id": "several", "url": "/v1/completions", "body": {"prompt": [[1], [2]]}},
     "holds 2 prompts"),
    ({"id": "nan", "prompt_token_ids": [1, 2], "temperature": float("nan")}, "temperature=nan: must be a finite"),
    ({"id": "seed", "prompt_token_ids": [1, 2], "seed": 2**63}, "seed=9223372036854775808: must be an integer in"),
    ({"id": "top-k", "prompt_token_ids": [1, 2], "top_k": 2**63}, "top_k=9223372036854775808"),
    ({"id": "top-p", "prompt_token_ids": [1, 2], "sampling_params": {"top_p": float("inf")}}, "top_p=inf"),
    ({"id": "stop", "prompt_token_ids": [1, 2], "stop": 5}, "stop=5: must be a list"),
    ({"id": "empty", "prompt": ""}, "'prompt' is an empty string"),
    ('{"id": "surrogate", "prompt": "\\ud800"}', "not valid Unicode"),
    ({"id": 1.5, "prompt_token_ids": [3]}, "the id must be a string or an integer"),
    ({"custom_id": "oa", "url": "/v1/edits", "body": {}}, "unsupported url"),
]


def test_bad_rows_get_error_records_and_every_good_row_runs(text_model, tmp_path):
    good = [{"id": f"good-{i}", "prompt_token_ids": [i + 1] * (i + 2)} for i in range(4)]
    lines = [good[0], good[1], *(row for row, _ in BAD_ROWS[:6]), "", good[2], *(row for row, _ in BAD_ROWS[6:]),
             good[3]]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    result = invoke("run", path, "-o", out, "--model", text_model, "--max-model-len", 32, "--max-tokens", 4,
                    "--ignore-eos")
    assert result.exit_code == 1
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == len(lines) - 1  # one record per non-blank line
    answered = [r for r in records if r["error"] is None]
    assert sorted(r["id"] for r in answered) == [row["id"] for row in good]
    assert all(r["completion_tokens"] == 4 and r["finish_reason"] == "length" for r in answered)
    errors = {r["error"].split(":", 1)[0]: r for r in records if r["error"] is not None}
    bad_lines = [n for n, line in enumerate(lines, 1) if line not in good and line != ""]
    assert sorted(errors, key=lambda w: int(w.split()[1])) == [f"line {n}" for n in bad_lines]
    for n, (row, problem) in zip(bad_lines, BAD_ROWS):
        record = errors[f"line {n}"]
        assert problem in record["error"] and record["finish_reason"] == "error" and record["text"] is None
        if isinstance(row, dict) and isinstance(row.get("id"), str):
            assert record["id"] == row["id"]
    assert errors["line 3"]["id"] == "3"  # a row without a usable id is known by its line number


@pytest.mark.parametrize("args, message", [
    (["{tmp}/missing.jsonl"], "does not exist"),
    (["{tmp}"], "a directory or a glob needs --ray"),
    (["{input}", "--input-format", "xml"], "input-format"),
    (["{input}", "-o", "{tmp}/out.txt"], "must end in .jsonl or .parquet"),
    (["{input}", "-o", "{input}"], "must not be INPUT"),
    (["{input}", "--temperature", "-1"], "invalid sampling option"),
    (["{input}", "--model", "no-such-model"], "cannot load the model"),
    (["{input}", "--max-num-seqs", "0"], "max_num_seqs"),
    (["{input}", "--block-size", "24"], "power of two"),
    (["{input}", "--max-tokens", "x"], "Invalid value"),
])
def test_usage_errors_exit_2_without_traceback(tmp_path, args, message):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [1, 2]}])
    args = [a.format(tmp=tmp_path, input=path) for a in args]
    result = invoke("run", *args, *([] if "--model" in args else ["--model", "tiny-qwen3", "--load-format", "dummy"]))
    assert result.exit_code == 2
    assert message in result.stderr


def test_json_summary_is_one_object_on_stdout(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt_token_ids": [1, 2, 3]}, {"prompt": 5}])
    result = invoke("run", path, "--model", "tiny-qwen3", "--load-format", "dummy", "--max-tokens", 2, "--ignore-eos", "--json")
    assert result.exit_code == 1
    summary = json.loads(result.stdout)  # the whole of stdout
    assert result.stdout.strip().count("\n") == 0
    types = {"input": str, "output": str, "output_format": str, "model": str, "rows_total": int, "rows_ok": int,
             "rows_failed": int, "rows_failed_before": int, "rows_skipped": int, "prompt_tokens": int, "cached_tokens": int,
             "completion_tokens": int, "prefix_hit_rate": float, "elapsed_s": float, "rows_per_s": float,
             "output_tok_s": float, "prefill_tok_s": float, "exit_code": int, "kv_cache": dict, "engine": dict,
             "records_written": int}
    assert set(summary) == set(types)
    assert all(isinstance(summary[k], t) for k, t in types.items())
    assert (summary["rows_total"], summary["rows_ok"], summary["rows_failed"], summary["exit_code"]) == (2, 1, 1, 1)
    assert (summary["prompt_tokens"], summary["completion_tokens"]) == (3, 2)
    assert summary["output"] == str(tmp_path / "in.results.jsonl") and summary["output_format"] == "plain"
    engine = summary["engine"]
    assert engine["device"] == "cpu" and engine["requests"] == 1 and engine["output_tokens"] == 2
    assert engine["gpu_busy_s"] is None and engine["gpu_busy_frac"] is None  # no GPU figures on the CPU
    assert {"ttft_p50_s", "tpot_p50_s", "wall_s", "prefill_tok_s", "output_tok_s"} <= set(engine)
    assert {"num_kv_blocks", "kv_cache_usage", "prefix_cache"} <= set(summary["kv_cache"])


def shared_prefix_rows(groups, per_group, prefix_len=32):
    """Rows in file order p0 q0 r0 ... p1 q1 r1 ...: each group shares a 2-block prefix, then a unique tail."""
    rows = []
    for member in range(per_group):
        for group in range(groups):
            prefix = [100 * (group + 1) + t for t in range(prefix_len)]
            rows.append({"id": f"g{group}-{member}", "prompt_token_ids": prefix + [5000 + member] * 5})
    return rows


def test_prefix_aware_admission_hits_more_than_file_order(text_model, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", shared_prefix_rows(groups=4, per_group=4))
    summaries, records = {}, {}
    for flag in ("--reorder", "--no-reorder"):
        out = tmp_path / f"{flag}.jsonl"
        result = run_rows(text_model, path, out, "--json", "--max-tokens", 2, flag)
        assert result.exit_code == 0
        summaries[flag], records[flag] = json.loads(result.stdout), read_records(out)
    # Every follower hits its group's whole 32-token prefix; in file order all rows enter in the same step.
    assert summaries["--reorder"]["cached_tokens"] == 4 * 3 * 32
    assert summaries["--reorder"]["cached_tokens"] >= summaries["--no-reorder"]["cached_tokens"]
    strip = {k: {f: v for f, v in r.items() if f != "cached_tokens"} for k, r in records["--reorder"].items()}
    assert strip == {k: {f: v for f, v in r.items() if f != "cached_tokens"}
                     for k, r in records["--no-reorder"].items()}


def test_inspect_cache_predicts_what_run_does(text_model, tmp_path):
    rows = [*ROWS, *shared_prefix_rows(groups=3, per_group=3)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    report = json.loads(invoke("inspect-cache", path, "--model", text_model, "--json").stdout)
    for order, flag in (("file_order", "--no-reorder"), ("prefix_aware", "--reorder")):
        result = run_rows(text_model, path, tmp_path / f"{order}.jsonl", "--json", "--max-tokens", 2,
                          "--max-num-seqs", 1, flag)
        summary = json.loads(result.stdout)
        assert summary["prompt_tokens"] == report["prompt_tokens"]  # chat templates included
        assert summary["cached_tokens"] == report[order]["hit_tokens"], order  # one row at a time, as replayed


def test_embedded_default_model_runs_the_sample_file(tmp_path):
    """`make run`: the sample file on the embedded SmolLM2, checked against the Python API."""
    from pathlib import Path

    sample = Path(__file__).resolve().parent.parent / "samples" / "prompts.jsonl"
    rows = [json.loads(line) for line in sample.read_text().splitlines()]
    out = tmp_path / "out.jsonl"
    result = invoke("run", sample, "-o", out, "--max-tokens", 3, "--include-token-ids")
    assert result.exit_code == 0, result.stderr
    assert_matches(read_records(out), reference(None, rows, engine={}, max_tokens=3))


def test_engine_flags_map_to_engine_arguments():
    from nanovllm_cli.options import EngineOptions

    assert EngineOptions().args() == {}
    assert EngineOptions(no_fused_ops=True, enforce_eager=True, no_prefix_caching=True).args() == {
        "fused_ops": False, "enforce_eager": True, "enable_prefix_caching": False}
