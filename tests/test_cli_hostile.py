"""No row can stop a job: `nanovllm run` against rows, constraints, model files and outputs that fight back.

Rows bring no code (a chat template is the model's or `--chat-template`'s) and every per-row step is bounded and
caught; fields nanovllm does not read are refused by name when they are mistakes and carried to the record when
they are the user's own; OUTPUT and the model's files are checked before any row runs; a write that fails mid-job
is one line that never claims the records were written; signals always end the job with 130.

References: the tokenizer's own chat-template rendering (HF transformers) and a plain Jinja rendering of a
`--chat-template` file for the prompts; the input rows themselves for carried fields; the file system for what
OUTPUT holds."""
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import jinja2
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from nanovllm_cli import writers
from nanovllm_cli.main import app

CHAT = [{"role": "user", "content": "Why is the sky blue?"}]
ENGINE = ["--max-model-len", "256", "--max-tokens", "3"]
UNLOADABLE = ["--model", "no-such-model"]  # a job that gets as far as loading the model exits 2 naming it
HOSTILE_TEMPLATES = ["{{ 1/0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
                     "{% for i in range(10**9) %}x{% endfor %}", "{{ '%0999999999d' % 1 }}"]


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_jsonl(path, key="id"):
    records = [json.loads(line) for line in path.read_text().splitlines()]
    by_id = {r[key]: r for r in records}
    assert len(by_id) == len(records)
    return by_id


def run_rows(model, rows, tmp_path, *flags, out_name="out.jsonl"):
    path, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / out_name
    return invoke("run", path, "-o", out, "--model", model, *ENGINE, "-q", *flags), out


# ---- rows bring no code; every per-row step is caught (cases 1, 13) ------------------------------------------------

def test_a_row_cannot_bring_a_chat_template_and_every_other_row_runs(text_model, tmp_path):
    from transformers import AutoTokenizer

    rows = [{"id": "before", "messages": CHAT},
            *({"id": f"t{i}", "messages": CHAT, "chat_template_kwargs": {"chat_template": t}}
              for i, t in enumerate(HOSTILE_TEMPLATES)),
            {"id": "option", "messages": CHAT, "chat_template_kwargs": {"tokenize": True}},
            '{"id": "deep", "prompt": "x", "tags": ' + "[" * 5000 + "]" * 5000 + "}",
            {"id": "after", "messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}}]
    result, out = run_rows(text_model, rows, tmp_path, "--include-token-ids")
    assert result.exit_code == 1, result.stderr
    records = read_jsonl(out)
    assert set(records) == {"before", "t0", "t1", "t2", "t3", "option", "after", "7"}  # the deep line: its number
    for i in range(len(HOSTILE_TEMPLATES)):
        assert "chat_template_kwargs.chat_template': a row cannot bring a chat template" in records[f"t{i}"]["error"]
        assert "--chat-template" in records[f"t{i}"]["error"]
    assert "may not set 'tokenize'" in records["option"]["error"]
    assert "nested deeper than 128 levels" in records["7"]["error"]
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    expected = tokenizer(tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False).input_ids
    for row_id in ("before", "after"):
        assert records[row_id]["error"] is None and records[row_id]["prompt_token_ids"] == expected
    rerun = invoke("run", tmp_path / "in.jsonl", "-o", out, "--model", text_model, *ENGINE, "-q", "--resume",
                   "--include-token-ids")
    assert rerun.exit_code == 1 and len(read_jsonl(out)) == 8  # --resume keeps them, nothing crashes


def test_inspect_cache_counts_a_hostile_row_as_failed(text_model, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "a", "messages": CHAT}, {"id": "b", "messages": CHAT, "chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}}])
    result = invoke("inspect-cache", path, "--model", text_model, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["rows"], report["rows_failed"]) == (2, 1) and "a row cannot bring a chat template" in report["errors"][0]


TEMPLATE = ("{% for m in messages %}{% if m.content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}"
            "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")


def test_chat_template_option_renders_messages_and_its_errors_stay_per_row(text_model, tmp_path):
    from transformers import AutoTokenizer

    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    rows = [{"id": "a", "messages": CHAT}, {"id": "boom", "messages": [{"role": "user", "content": "boom"}]}]
    result, out = run_rows(text_model, rows, tmp_path, "--chat-template", template, "--include-token-ids")
    assert result.exit_code == 1, result.stderr
    records = read_jsonl(out)
    rendered = jinja2.Template(TEMPLATE).render(messages=CHAT, add_generation_prompt=True, raise_exception=None)
    assert rendered.startswith("<user>Why is the sky blue?</user><assistant>")
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    assert records["a"]["prompt_token_ids"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert "the chat template failed on this conversation" in records["boom"]["error"] and "no boom" in records["boom"]["error"]


def test_chat_template_option_that_cannot_be_used_is_a_usage_error(text_model, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"messages": CHAT}])
    missing = invoke("run", path, "-o", tmp_path / "o.jsonl", "--chat-template", tmp_path / "none.jinja", *UNLOADABLE)
    assert missing.exit_code == 2 and "--chat-template" in missing.stderr and "no such file" in missing.stderr
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }")
    result = invoke("run", path, "-o", tmp_path / "o.jsonl", "--chat-template", bad, "--model", text_model, *ENGINE)
    assert result.exit_code == 2 and f"--chat-template {bad}: the chat template is not valid Jinja" in result.stderr
    assert not (tmp_path / "o.jsonl").exists() or not (tmp_path / "o.jsonl").read_text()


def test_prompt_size_bound_refuses_only_what_cannot_fit_the_context(text_model):
    """The bound on characters is sound: whatever it refuses has more tokens than the context (checked with the
    tokenizer itself), and it refuses a text of more characters than the bound without tokenizing it."""
    from transformers import AutoTokenizer

    from nanovllm import PromptTokenizer

    tokenizer = AutoTokenizer.from_pretrained(text_model)
    prompts = PromptTokenizer("tiny", 49152, tokenizer, max_context=8)
    bound = prompts.max_prompt_chars
    longest = max(map(len, tokenizer.get_vocab()))
    assert bound == 8 * longest * 4
    text = "the sky is blue " * (bound // 16 + 1)
    assert len(text) > bound and len(tokenizer(text).input_ids) > 8
    with pytest.raises(ValueError, match=f"more than the {bound:,} that the model's context of 8 tokens could hold"):
        prompts.tokenize(text)
    with pytest.raises(ValueError, match="the conversation with its template values"):
        prompts.apply_chat_template([{"role": "user", "content": "x"}], {"tools": ["y" * bound]})
    assert prompts.tokenize(text[:bound])  # at the bound: tokenized (the engine then says it is too long)


# ---- fields: refused by name, or carried (case 6) ------------------------------------------------------------------

REFUSED = [
    ({"temprature": 0.5}, "unknown field 'temprature' (did you mean 'temperature'?)"),
    ({"max_token": 3}, "unknown field 'max_token' (did you mean 'max_tokens'?)"),
    ({"max_new_tokens": 3}, "unsupported field 'max_new_tokens': use 'max_tokens'"),
    ({"guided_json": {"type": "object"}}, "unsupported field 'guided_json': use 'structured_outputs.json'"),
    ({"response_format": {"type": "json_object"}}, "unsupported field 'response_format': use 'structured_outputs'"),
    ({"use_beam_search": True}, "unsupported field 'use_beam_search': beam search is not implemented"),
    ({"lora_request": {"lora_name": "x"}}, "unsupported field 'lora_request': use 'lora'"),
]


def test_misspelled_and_foreign_fields_are_errors_and_the_users_own_are_carried(text_model, tmp_path):
    rows = [{"id": f"r{i}", "prompt": "Hi", **field} for i, (field, _) in enumerate(REFUSED)]
    rows += [{"id": "own", "prompt": "Hi", "topic": "sky", "meta": {"source": "web", "n": [1, 2]}, "score": 7,
              "text": "the input's text"}]
    result, out = run_rows(text_model, rows, tmp_path)
    assert result.exit_code == 1, result.stderr
    records = read_jsonl(out)
    for i, (_, problem) in enumerate(REFUSED):
        assert records[f"r{i}"]["error"] == f"line {i + 1}: {problem}"
    own = records["own"]
    assert own["error"] is None and own["completion_tokens"] == 3
    assert (own["topic"], own["meta"], own["score"]) == ("sky", rows[-1]["meta"], 7)  # the row's own values
    assert own["text"] != "the input's text"  # the record's own field wins the clash, and the job says so
    assert "the rows' field(s) 'text' share a name with the records' own" in result.stderr

    parquet = tmp_path / "out.parquet"
    result = invoke("run", tmp_path / "in.jsonl", "-o", parquet, "--model", text_model, *ENGINE, "-q")
    table = pq.read_table(parquet)
    assert table.schema.field("topic").type == pa.string() and table.schema.field("score").type == pa.int64()
    assert table.schema.field("meta").type == pa.string()  # objects as JSON text
    row = next(r for r in table.to_pylist() if r["id"] == "own")
    assert (row["topic"], json.loads(row["meta"]), row["score"]) == ("sky", rows[-1]["meta"], 7)
    assert row["text"] == own["text"]

    dropped = tmp_path / "dropped.jsonl"
    invoke("run", tmp_path / "in.jsonl", "-o", dropped, "--model", text_model, *ENGINE, "-q", "--drop-columns")
    assert not {"topic", "meta", "score"} & set(read_jsonl(dropped)["own"])


def test_a_parquet_inputs_own_columns_keep_their_type_or_become_text(text_model, tmp_path):
    from datetime import datetime
    from decimal import Decimal

    path, out = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "prompt_token_ids": [[1, 2], [3]], "label": [1, None],
                             "created": [datetime(2024, 1, 2, 3, 4), datetime(2024, 5, 6)],
                             "price": pa.array([Decimal("1.50"), Decimal("2")], pa.decimal128(5, 2)),
                             "tags": [["x", "y"], []]}), path)
    result = invoke("run", path, "-o", out, "--model", "tiny-qwen3", "--load-format", "dummy", "--max-tokens", 2, "-q")
    assert result.exit_code == 0, result.stderr
    table = pq.read_table(out)
    assert (table.schema.field("label").type, table.schema.field("tags").type) == (pa.int64(), pa.list_(pa.string()))
    assert table.schema.field("created").type == pa.string() == table.schema.field("price").type
    by_id = {r["id"]: r for r in table.to_pylist()}
    assert (by_id["a"]["label"], by_id["b"]["label"]) == (1, None)
    assert (by_id["a"]["created"], by_id["a"]["price"], by_id["a"]["tags"]) == ("2024-01-02T03:04:00", "1.50", ["x", "y"])


def test_openai_lines_take_the_body_fields_that_leave_the_output_as_is(text_model, tmp_path):
    def line(custom_id, **body):
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "batch": "b1",
                "body": {"messages": CHAT, **body}}

    rows = [line("neutral", stream=False, metadata={"k": "v"}, store=True, service_tier="auto", user="u",
                 stream_options=None),
            line("stream", stream=True), line("tools", tools=[]), line("typo", max_token=3),
            line("template", chat_template="{{ 1/0 }}")]
    result, out = run_rows(text_model, rows, tmp_path)
    assert result.exit_code == 1, result.stderr
    records = read_jsonl(out, "custom_id")
    assert records["neutral"]["response"]["status_code"] == 200 and records["neutral"]["batch"] == "b1"
    for custom_id, problem in (("stream", "body.stream=True: a batch line is answered whole"),
                               ("tools", "'body.tools': tool calling is not implemented"),
                               ("typo", "unknown field 'body.max_token' (did you mean 'body.max_tokens'?)"),
                               ("template", "'body.chat_template': a chat template comes from the model")):
        record = records[custom_id]
        assert record["response"]["status_code"] == 400 and problem in record["error"]["message"], record


# ---- structured constraints (cases 3, 7) ---------------------------------------------------------------------------

def test_constraint_limits_and_refs_are_per_row_errors(text_model, tmp_path):
    def chat(custom_id, schema):
        return {"custom_id": custom_id, "body": {"messages": CHAT, "max_tokens": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}}

    rows = [chat("self", {"$ref": "#"}), chat("file", {"$ref": "file:///etc/passwd"}),
            chat("url", {"type": "object", "properties": {"a": {"$ref": "http://example.com/a.json"}}}),
            {"custom_id": "many", "body": {"messages": CHAT, "max_tokens": 4, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {
                    "type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(2000)}}}}}},
            chat("ok", {"type": "boolean"})]
    result, out = run_rows(text_model, rows, tmp_path)
    assert result.exit_code == 1, result.stderr
    records = read_jsonl(out, "custom_id")
    for custom_id, problem in (("self", "accepts no output at all"), ("file", "points outside the schema"),
                               ("url", "points outside the schema"), ("many", "more than the limit of 1,024")):
        record = records[custom_id]
        assert record["response"]["status_code"] == 400, record
        assert problem in record["error"]["message"] and len(record["error"]["message"]) < 500, record
    assert records["ok"]["response"]["status_code"] == 200


# ---- model files (case 5) ------------------------------------------------------------------------------------------

def test_a_truncated_safetensors_file_is_a_usage_error_naming_it(text_model, tmp_path):
    model = Path(shutil.copytree(text_model, tmp_path / "model"))
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2])
    path, out = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}]), tmp_path / "out.jsonl"
    result = invoke("run", path, "-o", out, "--model", model, *ENGINE)
    assert result.exit_code == 2, result.stderr
    assert f"{weights} is truncated: its tensors need {len(data):,} bytes" in result.stderr
    assert not out.exists() or out.read_text() == ""


def test_a_missing_shard_is_named_and_a_stale_index_beside_whole_weights_is_not(text_model, tmp_path):
    model = Path(shutil.copytree(text_model, tmp_path / "model"))
    index = model / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    leftover = model / "model-00002-of-00002.safetensors"
    leftover.write_bytes(b"not a shard")
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    result = invoke("run", path, "-o", tmp_path / "whole.jsonl", "--model", model, *ENGINE)
    assert result.exit_code == 0, result.stderr  # the whole file is what loads; the index and its shard are left over
    leftover.unlink()
    (model / "model.safetensors").rename(model / "model-00001-of-00002.safetensors")
    result = invoke("run", path, "-o", tmp_path / "sharded.jsonl", "--model", model, *ENGINE)
    assert result.exit_code == 2, result.stderr
    assert f"{index} names shards that are not in {model}: model-00002-of-00002.safetensors" in result.stderr


def test_a_truncated_gguf_file_is_a_usage_error_naming_it(tmp_path, monkeypatch):
    from nanovllm.loaders.default_model import default_model_path

    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    source = default_model_path()
    truncated = tmp_path / "model.gguf"
    with open(source, "rb") as f:
        truncated.write_bytes(f.read(source.stat().st_size // 2))
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    result = invoke("run", path, "-o", tmp_path / "out.jsonl", "--model", truncated, *ENGINE)
    assert result.exit_code == 2, result.stderr
    assert f"{truncated} is truncated: its tensors need {source.stat().st_size:,} bytes" in result.stderr


# ---- OUTPUT (cases 8, 9) -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["fifo", "/dev/null", "/dev/full"])
def test_output_must_be_a_regular_file(tmp_path, kind):
    path, out = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}]), tmp_path / "out.jsonl"
    if kind == "fifo":
        os.mkfifo(out)
    else:
        out.symlink_to(kind)
    result = invoke("run", path, "-o", out, *UNLOADABLE)
    assert result.exit_code == 2 and result.stderr.count("error:") == 1, result.stderr
    assert ("is a FIFO" if kind == "fifo" else f"(a link to {kind}) is a character device") in result.stderr
    assert "OUTPUT must be a regular file" in result.stderr


def test_output_removed_mid_job_is_one_line_and_no_claim_of_records(text_model, tmp_path, monkeypatch):
    folder = tmp_path / "results"
    write = writers.JsonlWriter.write
    writes = []

    def write_then_lose_the_folder(self, record):
        write(self, record)
        writes.append(record)
        if len(writes) == 2:
            shutil.rmtree(folder)

    monkeypatch.setattr(writers.JsonlWriter, "write", write_then_lose_the_folder)
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": [i + 1]} for i in range(6)])
    result = invoke("run", path, "-o", folder / "out.jsonl", "--model", text_model, *ENGINE, "--json")
    assert result.exit_code == 3, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"cannot write {folder / 'out.jsonl'}: it was removed or replaced" in errors[0]
    assert (f"stopped after 6 rows, none of their records in {folder / 'out.jsonl'} (writing failed); run again with "
            "--resume to finish") in result.stderr
    assert json.loads(result.stdout)["records_written"] == 0


def test_a_full_disk_mid_job_is_one_line_and_resume_finishes_the_job(text_model, tmp_path):
    """A file-size limit stands in for a full disk: the OS refuses the write past it (EFBIG, as ENOSPC would)."""
    rows = [{"id": f"r{i}", "prompt_token_ids": [i + 1, i + 2]} for i in range(40)]
    path, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    command = [sys.executable, "-c", "from nanovllm_cli.main import app; app(prog_name='nanovllm')", "run", str(path),
               "-o", str(out), "--model", text_model, *ENGINE, "-q", "--no-reorder"]

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    done = subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=limit_file_size,
                          env={**os.environ, "TRITON_INTERPRET": "1"})
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0] == f"error: cannot write {out}: File too large", done.stderr
    complete = out.read_bytes().count(b"\n")  # whole records; a torn last line is cut by --resume
    assert f"stopped after {complete} rows, their records in {out}; run again with --resume" in done.stderr
    resumed = invoke("run", path, "-o", out, "--model", text_model, *ENGINE, "-q", "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert sorted(read_jsonl(out)) == sorted(r["id"] for r in rows)


# ---- signals (cases 4, 10) -----------------------------------------------------------------------------------------

def start_cli(tmp_path, patch: str, *args) -> subprocess.Popen:
    """`nanovllm run` in a process of its own, after `patch` (Python source) ran there."""
    script = textwrap.dedent(patch) + "\nfrom nanovllm_cli.main import app\napp(prog_name='nanovllm')\n"
    return subprocess.Popen([sys.executable, "-c", script, "run", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})


def wait_for(path: Path, process: subprocess.Popen, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the marker never came"
        time.sleep(0.05)


def test_sigterm_during_model_load_exits_130(tmp_path):
    marker = tmp_path / "loading"
    patch = f"""
        import time, nanovllm
        class SlowLoad:
            def __init__(self, *args, **kwargs):
                open({str(marker)!r}, "w").close()
                time.sleep(60)
        nanovllm.LLM = SlowLoad
    """
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "Hi"}])
    process = start_cli(tmp_path, patch, path, "-o", tmp_path / "out.jsonl")
    wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr


def test_two_sigterms_at_once_mid_job_exit_130_with_the_records_kept(text_model, tmp_path):
    marker = tmp_path / "stepping"
    patch = f"""
        import time
        from nanovllm.engine import llm_engine
        step = llm_engine.LLM.step
        def slow_step(self):
            open({str(marker)!r}, "w").close()
            time.sleep(0.05)
            return step(self)
        llm_engine.LLM.step = slow_step
    """
    rows = [{"id": f"r{i}", "prompt_token_ids": [i + 1]} for i in range(200)]
    path, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    process = start_cli(tmp_path, patch, path, "-o", out, "--model", text_model, *ENGINE, "-q", "--max-num-seqs", 2)
    wait_for(marker, process)
    process.send_signal(signal.SIGTERM)
    time.sleep(0.01)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    kept = len(out.read_text().splitlines())
    assert f"their records in {out}" in stderr and "Traceback" not in stderr and kept < len(rows)


def test_sigterm_while_a_constraint_compiles_exits_at_once(text_model, tmp_path):
    marker = tmp_path / "compiling"
    patch = f"""
        import time, xgrammar
        def endless_compile(self, regex, *args, **kwargs):
            open({str(marker)!r}, "w").close()
            time.sleep(120)
        xgrammar.GrammarCompiler.compile_regex = endless_compile
    """
    rows = [{"id": "plain", "prompt_token_ids": [5, 6]},
            {"id": "constrained", "prompt_token_ids": [5, 6], "structured_outputs": {"regex": "[a-z]+"}}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    process = start_cli(tmp_path, patch, path, "-o", tmp_path / "out.jsonl", "--model", text_model, *ENGINE, "-q")
    wait_for(marker, process)
    sent = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert time.monotonic() - sent < 15, "the process waited for the compile"


# ---- rejected values are quoted, not echoed (case 12) --------------------------------------------------------------

def test_a_rejected_huge_value_is_quoted_by_a_bounded_prefix(text_model, tmp_path):
    rows = [{"id": "bias", "prompt": "Hi", "logit_bias": {str(i): 1000 for i in range(100_000)}},
            {"id": "words", "prompt": "Hi", "bad_words": ["x" * 1_000_000]},
            {"id": "many-words", "prompt": "Hi", "bad_words": ["w"] * 1000}]
    path, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    result = invoke("run", path, "-o", out, "--model", text_model, *ENGINE)
    assert result.exit_code == 1, result.stderr
    records = read_jsonl(out)
    for row_id in ("bias", "words", "many-words"):
        assert len(json.dumps(records[row_id])) < 1000 and "characters)" in records[row_id]["error"], records[row_id]
    assert len(result.stderr) < 5000
