"""`nanovllm run` of pooling jobs: embeddings from JSONL, Parquet and OpenAI /v1/embeddings lines (one record per
row, vectors of the model's size, equal to LLM.embed's; Parquet as fixed-size float32 lists), bad rows as error
records, kill -9 then --resume answering every row exactly once, classify / score / reward records, and data
parallelism giving what one engine gives."""
import json
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_cli_resume import wait_for_records
from test_pooling_models import DECODER, ENCODER, bert_tokenizer, save_checkpoint, save_sentence_transformer
from typer.testing import CliRunner

from nanovllm import LLM, PoolingParams
from nanovllm_cli import writers
from nanovllm_cli.main import app

NANOVLLM = Path(sys.executable).parent / "nanovllm"
WORDS = [f"w{i}" for i in range(90)]
LABELS = {0: "negative", 1: "positive"}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("pooling-cli-models")
    embedder = save_checkpoint(dict(DECODER, model_type="qwen3", is_matryoshka=True), root / "embedder", "AutoModel",
                               bert_tokenizer())
    save_sentence_transformer(embedder, "lasttoken", normalize=True)
    classifier = save_checkpoint(dict(DECODER, model_type="qwen3", num_labels=2, id2label=LABELS,
                                      label2id={v: k for k, v in LABELS.items()}),
                                 root / "classifier", "AutoModelForSequenceClassification", bert_tokenizer())
    hf = save_checkpoint(dict(ENCODER, model_type="bert", num_labels=1), root / "ce-hf",
                         "AutoModelForSequenceClassification", bert_tokenizer())
    CrossEncoder(str(hf)).save(str(root / "cross-encoder"))
    return {"embedder": embedder, "classifier": classifier, "cross-encoder": root / "cross-encoder"}


def text(i: int) -> str:
    return " ".join(WORDS[(i * 7 + j) % 90] for j in range(2 + i % 9))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def invoke(*args):
    result = CliRunner().invoke(app, ["run", *map(str, args), "-q"])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def records(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_embed_jsonl_parquet_and_openai_lines(models, tmp_path):
    rows = [{"id": f"r{i}", "text": text(i)} for i in range(12)]
    rows[3] = {"id": "r3", "prompt_token_ids": [5, 6, 7, 8]}
    rows[4] = {"id": "r4", "text": text(4), "dimensions": 16}
    bad = [{"id": "b1", "text": "w1", "max_tokens": 4}, {"id": "b2", "text_1": "w1", "text_2": "w2"},
           {"id": "b3", "text": "w1", "dimensions": 500}, {"id": "b4", "prompt_token_ids": [5] * 200}]
    jsonl = write_jsonl(tmp_path / "in.jsonl", rows + bad)
    with LLM(str(models["embedder"])) as llm:
        expected = {r["id"]: o.outputs.embedding for r, o in zip(rows, llm.embed(
            [r.get("text") or r["prompt_token_ids"] for r in rows],
            [PoolingParams(dimensions=r.get("dimensions")) for r in rows]))}

    out = tmp_path / "out.jsonl"
    result = invoke(jsonl, "-o", out, "-m", models["embedder"], "--json")
    assert result.exit_code == 1  # the bad rows
    by_id = {r["id"]: r for r in records(out)}
    assert sorted(by_id) == sorted(r["id"] for r in rows + bad)
    for row in rows:
        record = by_id[row["id"]]
        assert record["error"] is None and record["embedding"] == pytest.approx(expected[row["id"]], abs=1e-6)
        assert len(record["embedding"]) == (16 if row["id"] == "r4" else 64)
    assert by_id["r3"]["prompt_tokens"] == 4
    errors = {b["id"]: by_id[b["id"]]["error"] for b in bad}
    assert "max_tokens: generation fields do not apply" in errors["b1"]
    assert "run --task score" in errors["b2"]
    assert "exceeds the model's embedding size" in errors["b3"]
    assert "max_model_len is 128" in errors["b4"]
    assert all(by_id[b["id"]]["embedding"] is None for b in bad)
    assert json.loads(result.stdout)["rows_failed"] == 4

    parquet_in = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": r["id"], "text": text(i)} for i, r in enumerate(rows)]), parquet_in)
    parquet_out = tmp_path / "out.parquet"
    assert invoke(parquet_in, "-o", parquet_out, "-m", models["embedder"]).exit_code == 0
    table = pq.read_table(parquet_out)
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), 64)
    assert table.num_rows == len(rows) and all(r["error"] is None for r in table.to_pylist())
    # A Parquet OUTPUT holds one vector size: a row asking another gets an error record
    write_jsonl(tmp_path / "mixed.jsonl", [{"id": "a", "text": "w1 w2"}, {"id": "b", "text": "w3", "dimensions": 16}])
    assert invoke(tmp_path / "mixed.jsonl", "-o", tmp_path / "mixed.parquet", "-m", models["embedder"]).exit_code == 1
    mixed = {r["id"]: r for r in records(tmp_path / "mixed.parquet")}
    assert mixed["a"]["error"] is None and "holds vectors of one size (64)" in mixed["b"]["error"]

    openai = write_jsonl(tmp_path / "batch.jsonl", [
        {"custom_id": "e1", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "m", "input": text(0), "encoding_format": "float"}},
        {"custom_id": "e2", "method": "POST", "url": "/v1/embeddings", "body": {"input": [5, 6, 7, 8],
                                                                                  "dimensions": 16}},
        {"custom_id": "e3", "method": "POST", "url": "/v1/embeddings", "body": {"input": ["a", "b"]}},
        {"custom_id": "e4", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a",
                                                                                  "encoding_format": "base64"}}])
    assert invoke(openai, "-o", tmp_path / "batch.out.jsonl", "-m", models["embedder"]).exit_code == 1
    lines = {r["custom_id"]: r for r in records(tmp_path / "batch.out.jsonl")}
    body = lines["e1"]["response"]["body"]
    assert body["object"] == "list" and body["data"][0]["embedding"] == pytest.approx(expected["r0"], abs=1e-6)
    assert body["usage"]["prompt_tokens"] == len(bert_tokenizer()(text(0)).input_ids)
    assert len(lines["e2"]["response"]["body"]["data"][0]["embedding"]) == 16
    assert "several inputs" in lines["e3"]["error"]["message"]
    assert "encoding_format 'base64' is not supported" in lines["e4"]["error"]["message"]


def test_classify_score_and_reward_records(models, tmp_path):
    rows = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": text(i)} for i in range(5)])
    assert invoke(rows, "-o", tmp_path / "c.jsonl", "-m", models["classifier"]).exit_code == 0
    with LLM(str(models["classifier"])) as llm:
        expected = llm.classify([text(i) for i in range(5)])
        rewards = llm.reward([text(i) for i in range(5)])
    for record, output in zip(records(tmp_path / "c.jsonl"), expected):
        assert record["probs"] == pytest.approx(output.outputs.probs, abs=1e-6)
        assert record["label"] == output.outputs.label in LABELS.values()
    assert invoke(rows, "-o", tmp_path / "r.parquet", "-m", models["classifier"], "--task", "reward").exit_code == 0
    for record, output in zip(records(tmp_path / "r.parquet"), rewards):
        assert record["reward"] == pytest.approx(output.outputs.data.tolist(), abs=1e-5)

    pairs = write_jsonl(tmp_path / "pairs.jsonl", [
        {"id": "p", "text_1": "w1 w2", "text_2": "w3 w4 w5"},
        {"id": "q", "query": "w1 w2", "documents": ["w3 w4 w5", "w6", "w1 w2"]},
        {"id": "bad", "query": "w1", "documents": []}])
    assert invoke(pairs, "-o", tmp_path / "s.jsonl", "-m", models["cross-encoder"]).exit_code == 1
    scored = {r["id"]: r for r in records(tmp_path / "s.jsonl")}
    with LLM(str(models["cross-encoder"])) as llm:
        expected = [o.outputs.score for o in llm.score("w1 w2", ["w3 w4 w5", "w6", "w1 w2"])]
    assert scored["p"]["score"] == pytest.approx(expected[0], abs=1e-6) and scored["p"]["scores"] is None
    assert scored["q"]["scores"] == pytest.approx(expected, abs=1e-6) and scored["q"]["score"] is None
    assert "non-empty array" in scored["bad"]["error"]


def test_causal_lm_preset_embeds_under_task_embed(tmp_path):
    rows = write_jsonl(tmp_path / "in.jsonl", [{"id": str(i), "prompt_token_ids": [i + 1] * 5} for i in range(4)])
    result = invoke(rows, "-o", tmp_path / "out.jsonl", "-m", "tiny-qwen3", "--load-format", "dummy", "--task",
                    "embed", "--max-model-len", "64")
    assert result.exit_code == 0, result.stderr
    assert all(len(r["embedding"]) == 128 for r in records(tmp_path / "out.jsonl"))


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sigkill_mid_embed_job_then_resume_gives_every_id_once(models, tmp_path, suffix):
    n = 300
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": text(i)} for i in range(n)])
    out = tmp_path / f"out{suffix}"
    proc = subprocess.Popen([str(NANOVLLM), "run", str(path), "-o", str(out), "-m", str(models["embedder"]),
                             "--max-num-seqs", "1", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    written = writers.journal_path(out) if suffix == ".parquet" else out
    wait_for_records(proc, written, 8)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert written.read_bytes().count(b"\n") < n  # really cut short
    result = invoke(path, "-o", out, "--resume", "-m", models["embedder"], "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["rows_skipped"] >= 8
    final = records(out)
    assert sorted(r["id"] for r in final) == sorted(f"r{i}" for i in range(n))
    assert all(r["error"] is None and len(r["embedding"]) == 64 for r in final)


@pytest.mark.slow
def test_data_parallel_scores_equal_one_engine(models, tmp_path):
    """Two replicas of a BERT cross-encoder (the parent tokenizes for an encoder it never loads) score pairs and
    query/documents rows as one engine does."""
    rows = [{"id": f"p{i}", "text_1": text(i), "text_2": text(i + 1)} for i in range(10)]
    rows += [{"id": f"q{i}", "query": text(i), "documents": [text(i + 2), text(i + 3)]} for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    model = models["cross-encoder"]
    assert invoke(path, "-o", tmp_path / "one.jsonl", "-m", model).exit_code == 0
    result = invoke(path, "-o", tmp_path / "two.jsonl", "-m", model, "--data-parallel-size", "2", "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["data_parallel_size"] == 2
    one = {r["id"]: r for r in records(tmp_path / "one.jsonl")}
    two = {r["id"]: r for r in records(tmp_path / "two.jsonl")}
    assert one.keys() == two.keys() == {r["id"] for r in rows}
    for key, record in one.items():
        field = "score" if key.startswith("p") else "scores"
        assert two[key][field] == pytest.approx(record[field], abs=1e-5)


@pytest.mark.slow
def test_run_ray_embeds_as_run_does(models, tmp_path):
    """`run --ray` (one local Ray cluster, two engines): the same records as `run`, in Parquet shards."""
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'nanovllm[ray]'")
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "text": text(i)} for i in range(8)]
                       + [{"id": "bad", "text": "w1", "temperature": 0.5}])
    assert invoke(path, "-o", tmp_path / "one.jsonl", "-m", models["embedder"]).exit_code == 1
    expected = {r["id"]: r for r in records(tmp_path / "one.jsonl")}
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        out = tmp_path / "shards.parquet"
        result = invoke(path, "--ray", "--ray-replicas", 2, "--window", 3, "-o", out, "-m", models["embedder"], "--json")
    finally:
        ray.shutdown()
    assert result.exit_code == 1, result.stderr
    assert json.loads(result.stdout)["rows_failed"] == 1
    shards = {r["id"]: r for f in sorted(out.glob("part-*")) for r in pq.read_table(f).to_pylist()}
    assert shards.keys() == expected.keys()
    assert "temperature: generation fields do not apply" in shards["bad"]["error"]
    for key, record in expected.items():
        if record["error"] is None:
            assert shards[key]["embedding"] == pytest.approx(record["embedding"], abs=1e-5)


def test_bench_task_embed_counts_rows_and_tokens():
    result = CliRunner().invoke(app, ["bench", "--task", "embed", "-m", "tiny-qwen3", "--load-format", "dummy",
                                      "--num-seqs", "12", "--input-len-range", "4", "24", "--max-num-seqs", "4",
                                      "--async", "--json"])
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    figures = report["results"]
    assert (report["task"], figures["rows"], figures["rows_failed"]) == ("embed", 12, 0)
    assert 12 * 4 <= figures["prompt_tokens"] <= 12 * 24 and figures["steps"] >= 3
    assert figures["rows_per_s"] == pytest.approx(12 / figures["wall_s"])
    assert figures["roofline_frac"] is None  # no GPU: no ceilings


def test_prefill_roofline_counts_weight_and_attention_matmuls():
    from nanovllm import pooling_spec
    from nanovllm_cli.bench_pooling import prefill_roofline_seconds

    class Costs:
        flops_per_token, attention_flops_per_pair = 1000, 10

    assert prefill_roofline_seconds(Costs, [3, 4], bidirectional=False, matmul_flops_per_s=1e3) == (
        7 * 1000 + (6 + 10) * 10) / 1e3
    assert prefill_roofline_seconds(Costs, [3, 4], bidirectional=True, matmul_flops_per_s=1e3) == (
        7 * 1000 + (9 + 16) * 10) / 1e3
    spec = pooling_spec("bert-base")  # the preset of the BERT-base benchmark: an encoder, CLS-pooled
    assert (spec.task, spec.encoder, spec.pooling.value, spec.output_size, spec.max_input_len) == (
        "embed", True, "cls", 768, 512)
