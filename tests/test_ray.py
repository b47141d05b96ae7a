"""Ray Data: `LLMProcessor` (one engine per actor) and `nanovllm run --ray`, on one local 2-CPU Ray cluster.

Both are checked record by record against `nanovllm run` on the same rows (greedy, so the records match
exactly): the Ray path reuses its row parser, runner and record builder, and these tests hold it to that.
"""
import json
import os
import socket
import sys
import time
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# Skipped only where Ray is not installed; a Ray without its Data extra fails here, saying what to install.
pytest.importorskip("ray", reason="Ray is not installed: pip install 'nanovllm[ray]' (make install does it)")
import ray  # noqa: E402
import ray.data  # noqa: E402
from test_cli_run import invoke, write_jsonl, write_parquet  # noqa: E402

from nanovllm_cli import ray_job  # noqa: E402
from nanovllm_cli.ray_job import InputPart, file_parts, list_input_files, merge_parts, part_values  # noqa: E402
from nanovllm_cli.ray_processor import LLMProcessor, _batch_rows  # noqa: E402
from nanovllm_cli.readers import iter_rows  # noqa: E402
from nanovllm_cli.records import PLAIN_FIELDS  # noqa: E402

ENGINE = {"max_model_len": 256, "cpu_kv_cache_bytes": 32 << 20}
BARRIER_S = 60.0  # longest wait of an actor for the other one to start
ENGINE_FLAGS = ["--max-model-len", 256, "--kv-cache-gib", 32 / 1024, "--max-tokens", 4]
ROWS = [
    {"id": "plain", "prompt": "The capital of France is"},
    {"id": "chat", "messages": [{"role": "user", "content": "Why is the sky blue?"}], "max_tokens": 6},
    {"id": "ids", "prompt_token_ids": [504, 3458, 282, 4649, 314]},
    {"id": "shared-a", "prompt": "Once upon a time in a land far away, a king"},
    {"id": "shared-b", "prompt": "Once upon a time in a land far away, a queen", "stop": [","]},
    {"id": "bad-sampling", "prompt": "Hello", "temperature": -1.0},
]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


def cli_records(text_model, path, tmp_path, *flags):
    """`nanovllm run`'s records for the rows of `path`, by id."""
    out = tmp_path / f"{path.stem}.reference.jsonl"
    result = invoke("run", path, "-o", out, "--model", text_model, *ENGINE_FLAGS, *flags, "-q")
    assert result.exit_code in (0, 1), result.stderr
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


def test_processor_on_a_dataset_matches_nanovllm_run(cluster, text_model, tmp_path, monkeypatch):
    rows = [*ROWS, {"prompt": "a row without an id"}]
    by_id = cli_records(text_model, write_jsonl(tmp_path / "rows.jsonl", rows), tmp_path)
    expected = [by_id[row.get("id", "7")] for row in rows]
    # The processor returns a batch's records in its rows' order (prefix-aware admission reorders them inside);
    # across batches, run by two actors, Ray keeps the order only when asked (the dataset copies the setting).
    monkeypatch.setattr(ray.data.DataContext.get_current().execution_options, "preserve_order", True)
    records = (ray.data.from_items(rows)
               .map_batches(LLMProcessor, batch_size=3, batch_format="pyarrow",
                            compute=ray.data.ActorPoolStrategy(size=2),
                            fn_constructor_kwargs={"model": text_model, "engine_args": ENGINE,
                                                   "sampling": {"max_tokens": 4}})
               .take_all())
    assert [r["id"] for r in records] == [*(row["id"] for row in ROWS), None]
    assert expected[-1]["id"] == "7" and expected[-1]["completion_tokens"] > 0
    expected[-1]["id"] = None  # `nanovllm run` names a row without an id by its line; a dataset row has none
    assert expected[5]["error"].startswith("line 6: invalid sampling parameters: temperature")
    assert records[5]["error"] == expected[5]["error"].replace("line 6", "row with id 'bad-sampling'")
    expected[5]["error"] = records[5]["error"]
    assert all(records[i][name] is None for i in range(len(rows)) for name in set(records[i]) - set(PLAIN_FIELDS))
    assert [{k: r[k] for k in PLAIN_FIELDS} for r in records] == expected  # text, finish reason, counts: all
    assert all(r["error"] is None and r["completion_tokens"] > 0 for r in expected[:5])


@pytest.mark.filterwarnings("error::DeprecationWarning:nanovllm_cli.ray_job")  # Ray APIs on their way out
def test_run_ray_on_a_directory_of_jsonl_writes_parquet_shards(cluster, text_model, tmp_path):
    shards = tmp_path / "in"
    shards.mkdir()
    write_jsonl(shards / "a.jsonl", ROWS[:3] + ["{not json", {"prompt": "no id, line 5"}])
    write_jsonl(shards / "b.jsonl", ROWS[3:] + [{"id": "typed", "prompt": 5}])  # a type Arrow could not unify
    expected = cli_records(text_model, write_jsonl(tmp_path / "all.jsonl", ROWS + [{"id": "typed", "prompt": 5}]),
                           tmp_path)
    out = tmp_path / "results.parquet"
    result = invoke("run", shards, "--ray", "--ray-replicas", 2, "--window", 2, "-o", out, "--model", text_model,
                    *ENGINE_FLAGS, "-q", "--json")
    assert result.exit_code == 1, result.stderr  # the bad rows
    summary = json.loads(result.stdout)
    files = sorted(out.iterdir())
    assert files and all(f.suffix == ".parquet" for f in files)
    records = {r["id"]: {k: r[k] for k in PLAIN_FIELDS} for f in files for r in pq.read_table(f).to_pylist()}
    assert len(records) == 9
    assert (summary["rows_total"], summary["rows_failed"], summary["input_files"]) == (9, 3, 2)
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in records.values())
    assert "a.jsonl line 4: invalid JSON" in records.pop("a.jsonl:4")["error"]
    assert records.pop("a.jsonl:5")["completion_tokens"] > 0  # a row without an id: its file and line
    assert records["typed"]["error"].startswith("b.jsonl line 4: 'prompt' must be")
    assert expected["typed"]["error"].startswith("line 7: 'prompt' must be")
    for row_id in ("typed", "bad-sampling"):
        assert records[row_id].pop("error").split(": ", 1)[1] == expected[row_id].pop("error").split(": ", 1)[1]
    assert records == expected


def test_run_ray_on_a_glob_of_parquet_writes_jsonl_shards(cluster, text_model, tmp_path):
    rows = [*ROWS[:5], {"id": "logprobs", "prompt": "Hello", "logprobs": 2}]
    expected = cli_records(text_model, write_parquet(tmp_path / "all.parquet", rows), tmp_path)
    write_parquet(tmp_path / "part-0.parquet", rows[:3])
    write_parquet(tmp_path / "part-1.parquet", rows[3:])
    out = tmp_path / "results.jsonl"
    result = invoke("run", tmp_path / "part-*.parquet", "--ray", "-o", out, "--model", text_model, *ENGINE_FLAGS,
                    "-q")
    assert result.exit_code == 0, result.stderr
    files = sorted(out.iterdir())
    assert files and all(f.suffix == ".jsonl" for f in files)
    records = {r["id"]: r for f in files for r in map(json.loads, f.read_text().splitlines())}
    positions, expected_positions = records["logprobs"].pop("logprobs"), expected["logprobs"].pop("logprobs")
    assert [p["token_id"] for p in positions] == [p["token_id"] for p in expected_positions]  # nested JSON
    assert logprobs(positions) == pytest.approx(logprobs(expected_positions), abs=1e-4)  # float32 sums' order
    assert records == expected  # every other field of every line as `nanovllm run` writes it


def logprobs(positions):
    """A plain record's logprobs flattened: token id, rank and logprob of each position, then of its top."""
    return [value for p in positions for value in (p["token_id"], p["rank"], p["logprob"], *(
        v for top in p["top_logprobs"] for v in (top["token_id"], top["logprob"])))]


def test_a_node_without_the_model_path_is_named(cluster, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    missing = tmp_path / "not-on-this-node"
    result = invoke("run", path, "--ray", "-o", tmp_path / "out.jsonl", "--model", missing, "-q")
    assert result.exit_code == 3, result.stderr
    node = f"does not exist on node {socket.gethostname()} (Ray node id {ray.get_runtime_context().get_node_id()})"
    assert f"model path {missing} {node}" in result.stderr


@pytest.mark.parametrize("args, message", [
    (["--ray", "--resume"], "not supported with --ray: --resume"),
    (["--ray", "--retry-failed", "--sync"], "--retry-failed, --sync"),
    (["--ray-replicas", 2, "-o", "{tmp}/out.jsonl"], "--ray-address/--ray-replicas without --ray"),
    (["--ray", "-o", "{tmp}/out.csv"], "named *.parquet or *.jsonl"),
    (["--ray"], "--ray needs -o OUTPUT"),
    (["--ray", "-o", "{tmp}/in.jsonl"], "is a file; with --ray OUTPUT is a directory"),
])
def test_run_ray_rejects_what_it_does_not_support(tmp_path, args, message):
    path = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    result = invoke("run", path, *[str(a).format(tmp=tmp_path) for a in args])
    assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_run_ray_without_ray_data_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.data", None)  # as where Ray is not installed
    result = invoke("run", write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), "--ray", "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "--ray needs Ray Data: pip install 'nanovllm[ray]'" in result.stderr


def test_run_ray_refuses_an_output_inside_a_directory_input(tmp_path):
    write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    result = invoke("run", tmp_path, "--ray", "-o", tmp_path / "results.jsonl")
    assert result.exit_code == 2 and "lies inside INPUT" in result.stderr, result.stderr


@pytest.mark.parametrize("batch_format", ["numpy", "pandas"])
def test_processor_refuses_batches_that_lose_integer_types(cluster, batch_format):
    rows = [{"id": "a", "prompt": "x", "max_tokens": 3}, {"id": "b", "prompt": "y"}]  # max_tokens: 3.0 in numpy
    batch = next(iter(ray.data.from_items(rows).iter_batches(batch_size=2, batch_format=batch_format)))
    with pytest.raises(TypeError, match='pass batch_format="pyarrow" to map_batches'):
        _batch_rows(batch)


def parts_of(path, fmt, size):
    (item,) = [vars(f) for f in list_input_files(str(path), fmt)]
    return [InputPart(**part) for part in file_parts(item, size)]


def values_of(path, parts):
    values = []
    for part in parts:
        with open(path, "rb") as f:
            values += part_values(f, vars(part))
    return values


def test_parts_of_a_file_give_its_rows_numbered_as_run_reads_them(tmp_path):
    lines = [{"id": "a", "prompt": "x"}, "", "{not json", *({"id": f"r{i}", "prompt": "é" * i} for i in range(7))]
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # the last line without its newline
    parts = parts_of(path, None, 3)
    assert [(p.first, p.count) for p in parts] == [(1, 3), (4, 3), (7, 3), (10, 1)]
    assert values_of(path, parts) == list(iter_rows(path, "jsonl"))  # blank and bad lines, numbers, last line
    rows = [{"id": f"r{i}", "prompt": "x" * i, "max_tokens": i if i % 2 else None} for i in range(10)]
    path = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4)  # parts cut across row groups
    parts = parts_of(path, None, 3)
    assert [(p.first, p.count) for p in parts] == [(1, 3), (4, 3), (7, 3), (10, 1)]
    assert values_of(path, parts) == list(iter_rows(path, "parquet"))
    merged = merge_parts(parts + parts_of(tmp_path / "in.jsonl", None, 3), 3)  # 8 parts, at most 3: by 3
    assert [(p.format, p.first, p.count) for p in merged] == [
        ("parquet", 1, 9), ("parquet", 10, 1), ("jsonl", 1, 9), ("jsonl", 10, 1)]
    assert values_of(path, merged[:2]) == list(iter_rows(path, "parquet"))


def test_one_input_file_feeds_every_engine(cluster, tmp_path):
    """Ray hands a whole block to one actor: a file read as one block would run on one engine alone."""
    arrived = tmp_path / "arrived"
    arrived.mkdir()

    class ActorPid:  # each row's actor (local: pickled whole, `arrived` with it)
        def __init__(self):
            self.deadline = None

        def __call__(self, batch):
            # An actor holds its batches until the other actor has one too, however late that one starts: with
            # parts of their own, one actor cannot take them all. Given one block, one actor gets every row, stops
            # waiting after BARRIER_S, and the test fails.
            (arrived / str(os.getpid())).touch()
            self.deadline = self.deadline or time.monotonic() + BARRIER_S
            while len(list(arrived.iterdir())) < 2 and time.monotonic() < self.deadline:
                time.sleep(0.01)
            return pa.table({"pid": [os.getpid()] * batch.num_rows})

    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "x"} for i in range(24)])
    rows = ray_job.read_rows(list_input_files(str(path), None), 2)
    pids = Counter(r["pid"] for r in rows.map_batches(ActorPid, batch_size=2, batch_format="pyarrow",
                                                        compute=ray.data.ActorPoolStrategy(size=2)).take_all())
    assert len(pids) == 2 and sum(pids.values()) == 24, pids


def test_run_ray_gives_a_hostile_row_an_error_record_and_runs_the_others(cluster, text_model, tmp_path):
    """The row that ended a whole Ray job (its own chat template, raising) is one error record; the other rows, in
    this file and in another, run."""
    chat = [{"role": "user", "content": "Hi"}]
    (tmp_path / "in").mkdir()
    write_jsonl(tmp_path / "in" / "a.jsonl", [{"id": "a1", "prompt": "Once upon a time"},
                                              {"id": "bad", "messages": chat,
                                               "chat_template_kwargs": {"chat_template": "{{ 1/0 }}"}},
                                              {"id": "a2", "messages": chat}])
    write_jsonl(tmp_path / "in" / "b.jsonl", [{"id": "b1", "prompt_token_ids": [5, 6, 7]}])
    out = tmp_path / "results.jsonl"
    result = invoke("run", tmp_path / "in", "--ray", "-o", out, "--model", text_model, *ENGINE_FLAGS, "-q")
    assert result.exit_code == 1, result.stderr
    records = {r["id"]: r for shard in sorted(out.iterdir()) for r in map(json.loads, shard.read_text().splitlines())}
    assert set(records) == {"a1", "bad", "a2", "b1"}
    assert "a row cannot bring a chat template" in records["bad"]["error"]
    assert all(records[i]["error"] is None and records[i]["completion_tokens"] > 0 for i in ("a1", "a2", "b1"))
