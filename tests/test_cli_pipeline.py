"""`run` in a pipeline without Ray: `-` for stdin and stdout, `--limit`, CSV and Hugging Face `datasets` input,
fsspec URLs (`memory://`, `file://`) for INPUT and OUTPUT, `--ordered`, and default OUTPUT names that keep
`prompts.jsonl`'s results apart from `prompts.parquet`'s.

Each path's records are compared with those of the same rows given as a JSONL file (whose records
tests/test_cli_run.py checks against the Python API), and the row texts with `LLM.generate`.
"""
import json

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from nanovllm import LLM, SamplingParams
from nanovllm_cli.main import app
from nanovllm_cli.rows import derive_seed

ROWS = [{"id": "007", "prompt": "The capital of France is", "max_tokens": 3, "topic": "geo"},
        {"id": "sky", "prompt": "Why is the sky blue?", "max_tokens": 5, "topic": "physics"},
        {"id": "tea", "prompt": "Tea or coffee?", "max_tokens": 2, "topic": "taste"}]
FINGERPRINT = "input_fingerprint"  # a hash of the row as read: a CSV cell and a JSON value differ in type


def invoke(*args, stdin=None):
    result = CliRunner().invoke(app, [str(a) for a in args], input=stdin)
    assert "Traceback" not in result.stderr, result.stderr
    return result


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def parse_jsonl(text):
    return [json.loads(line) for line in text.splitlines()]


def without_fingerprint(records):
    return [{k: v for k, v in r.items() if k != FINGERPRINT} for r in records]


def run(model, *args, stdin=None):
    return invoke("run", *args, "--model", model, "--max-model-len", 256, "-q", stdin=stdin)


@pytest.fixture(scope="module")
def expected(text_model, tmp_path_factory):
    """The rows' records from a JSONL file, checked against LLM.generate."""
    root = tmp_path_factory.mktemp("expected")
    result = run(text_model, write_jsonl(root / "in.jsonl", ROWS), "-o", root / "out.jsonl", "--ordered")
    assert result.exit_code == 0, result.stderr
    records = parse_jsonl((root / "out.jsonl").read_text())
    llm = LLM(text_model, max_model_len=256)
    for row, record in zip(ROWS, records):
        params = SamplingParams(max_tokens=row["max_tokens"], temperature=0, seed=derive_seed(0, row["id"]))
        assert record["text"] == llm.generate(row["prompt"], params)[0].text
        assert record["topic"] == row["topic"]  # the row's own column, carried
    return records


def test_stdin_to_stdout_with_limit(text_model, expected, tmp_path):
    lines = "".join(json.dumps(row) + "\n" for row in ROWS)
    result = run(text_model, "-", "-o", "-", "--limit", 2, "--ordered", stdin=lines)
    assert result.exit_code == 0, result.stderr
    assert parse_jsonl(result.stdout) == expected[:2]  # records only on stdout; the first two rows only
    default = run(text_model, "-", "--ordered", stdin=lines)  # stdin's default OUTPUT is stdout
    assert parse_jsonl(default.stdout) == expected
    refused = run(text_model, "-", "-o", "-", "--json", stdin=lines)
    assert refused.exit_code == 2 and "drop --json" in refused.stderr
    refused = run(text_model, "-", "-o", "-", "--resume", stdin=lines)
    assert refused.exit_code == 2 and "need a file, not stdout" in refused.stderr


def test_limit_then_resume_answers_the_rest(text_model, expected, tmp_path):
    path, out = write_jsonl(tmp_path / "in.jsonl", ROWS), tmp_path / "out.jsonl"
    assert run(text_model, path, "-o", out, "--limit", 1).exit_code == 0
    assert parse_jsonl(out.read_text()) == expected[:1]
    result = run(text_model, path, "-o", out, "--resume", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["records_written"] == 2
    assert sorted(parse_jsonl(out.read_text()), key=lambda r: r["id"]) == sorted(expected, key=lambda r: r["id"])


def test_csv_input(text_model, expected, tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("id,prompt,max_tokens,topic,empty\n" + "".join(
        f'{row["id"]},"{row["prompt"]}",{row["max_tokens"]},{row["topic"]},\n' for row in ROWS))
    result = run(text_model, path, "--ordered")
    assert result.exit_code == 0, result.stderr
    records = parse_jsonl((tmp_path / "rows.csv.results.jsonl").read_text())
    assert without_fingerprint(records) == without_fingerprint(expected)  # "007" stays an id, 3 is a number
    assert "empty" not in records[0]  # an empty cell is an absent field
    bad = tmp_path / "bad.csv"
    bad.write_text("id,question\n1,what?\n")
    result = run(text_model, bad)
    assert result.exit_code == 2 and "has no 'prompt', 'messages'" in result.stderr


def test_datasets_folder_input(text_model, expected, tmp_path):
    datasets = pytest.importorskip("datasets")  # the dev extra installs it
    folder = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    result = run(text_model, folder, "-o", tmp_path / "out.jsonl", "--ordered")
    assert result.exit_code == 0, result.stderr
    assert without_fingerprint(parse_jsonl((tmp_path / "out.jsonl").read_text())) == without_fingerprint(expected)
    splits = tmp_path / "splits"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                          "test": datasets.Dataset.from_list(ROWS[1:])}).save_to_disk(str(splits))
    result = run(text_model, splits, "-o", tmp_path / "split.jsonl")
    assert result.exit_code == 2 and "pick one with --hf-split" in result.stderr
    result = run(text_model, splits, "-o", tmp_path / "split.jsonl", "--hf-split", "test", "--ordered")
    assert result.exit_code == 0, result.stderr
    assert without_fingerprint(parse_jsonl((tmp_path / "split.jsonl").read_text())) == without_fingerprint(expected[1:])


def test_fsspec_urls_for_input_and_output(text_model, expected, tmp_path):
    memory = fsspec.filesystem("memory")
    memory.pipe("/jobs/in.jsonl", "".join(json.dumps(row) + "\n" for row in ROWS).encode())
    result = run(text_model, "memory://jobs/in.jsonl", "-o", "memory://jobs/out.jsonl", "--ordered")
    assert result.exit_code == 0, result.stderr
    assert parse_jsonl(memory.cat("/jobs/out.jsonl").decode()) == expected
    result = run(text_model, "memory://jobs/in.jsonl", "-o", "memory://jobs/out.jsonl")
    assert result.exit_code == 2 and "add --overwrite" in result.stderr
    result = run(text_model, "memory://jobs/in.jsonl", "-o", "memory://jobs/out.jsonl", "--resume")
    assert result.exit_code == 2 and "an object store has no append" in result.stderr
    result = run(text_model, "memory://jobs/missing.jsonl", "-o", tmp_path / "x.jsonl")
    assert result.exit_code == 2 and "memory://jobs/missing.jsonl does not exist" in result.stderr
    local = write_jsonl(tmp_path / "in.jsonl", ROWS)
    result = run(text_model, f"file://{local}", "--ordered")  # a file:// URL is the local file: OUTPUT beside it
    assert result.exit_code == 0, result.stderr
    assert parse_jsonl((tmp_path / "in.results.jsonl").read_text()) == expected


def test_ordered_writes_records_in_input_order(tmp_path):
    # The first row runs 12 steps, the others one: they finish first.
    rows = [{"id": "long", "prompt_token_ids": [1, 2, 3], "max_tokens": 12}] + [
        {"id": f"short-{i}", "prompt_token_ids": [4 + i], "max_tokens": 1} for i in range(4)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    shape = ["--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", 64, "--ignore-eos", "-q"]
    orders = {}
    for name, flags in (("free", []), ("ordered", ["--ordered"]), ("window", ["--ordered", "--window", 2])):
        out = tmp_path / f"{name}.jsonl"
        result = invoke("run", path, "-o", out, *shape, *flags)
        assert result.exit_code == 0, result.stderr
        orders[name] = [r["id"] for r in parse_jsonl(out.read_text())]
    ids = [row["id"] for row in rows]
    assert orders["free"] != ids and sorted(orders["free"]) == sorted(ids)  # rows finish out of order
    assert orders["ordered"] == ids and orders["window"] == ids


def test_jsonl_and_parquet_inputs_get_distinct_default_outputs(tmp_path):
    rows = [{"id": "a", "prompt_token_ids": [1, 2]}]
    write_jsonl(tmp_path / "prompts.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "prompts.parquet")
    shape = ["--model", "tiny-qwen3", "--load-format", "dummy", "--max-model-len", 64, "--max-tokens", 2, "-q"]
    for name in ("prompts.jsonl", "prompts.parquet"):
        assert invoke("run", tmp_path / name, *shape).exit_code == 0
    assert len(parse_jsonl((tmp_path / "prompts.results.jsonl").read_text())) == 1
    assert pq.read_table(tmp_path / "prompts.results.parquet").num_rows == 1
