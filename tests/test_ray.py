"""Ray: `LLMProcessor` (one engine per Ray Data actor) and `nanovllm run --ray`, on one local 2-CPU Ray cluster.

Both are checked record by record against `nanovllm run` on the same rows (greedy, so the records match
exactly): the Ray path reuses its row parser, runner and record builder, and these tests hold it to that. A job
killed at any moment (its driver, an engine actor, an engine inside one) ends, rerun with --resume where the driver
died, with every row of its input answered exactly once.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

# Skipped only where Ray is not installed; a Ray without its Data extra fails here, saying what to install.
pytest.importorskip("ray", reason="Ray is not installed: pip install 'nanovllm[ray]' (make install does it)")
import ray  # noqa: E402
import ray.data  # noqa: E402
from test_cli_run import invoke, write_jsonl, write_parquet  # noqa: E402

from nanovllm_cli.ray_inputs import InputPart, file_parts, list_input_files, merge_parts, part_values  # noqa: E402
from nanovllm_cli.ray_processor import LLMProcessor, _batch_rows  # noqa: E402
from nanovllm_cli.readers import iter_rows  # noqa: E402
from nanovllm_cli.records import PLAIN_FIELDS  # noqa: E402
from nanovllm_cli.shards import OutputState  # noqa: E402

NANOVLLM = Path(sys.executable).parent / "nanovllm"

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
    files = sorted(out.glob("part-*"))
    assert files and all(f.suffix == ".parquet" for f in files)
    assert len(list((out / "_manifests").iterdir())) == len(files) == summary["parts"]
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
    files = sorted(out.glob("part-*"))
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
    assert f"model path {missing} does not exist on {node()}" in result.stderr


def node() -> str:
    return f"node {socket.gethostname()} (Ray node id {ray.get_runtime_context().get_node_id()})"


def test_output_the_engines_cannot_write_fails_before_the_model_loads(cluster, tmp_path):
    """As OUTPUT on an object store whose filesystem package or credentials only the driver's machine has: here a
    protocol only this process knows. The engine actor says so before it looks for the model."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    class DriverOnly(MemoryFileSystem):
        protocol = "driveronly"

    fsspec.register_implementation("driveronly", DriverOnly, clobber=True)
    path = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    result = invoke("run", path, "--ray", "-o", "driveronly://job/results.jsonl", "--model", tmp_path / "no-model")
    assert result.exit_code == 3, result.stderr
    assert f"OUTPUT driveronly://job/results.jsonl cannot be written from {node()}: ValueError" in result.stderr
    assert "does not exist on node" not in result.stderr  # the model was not looked for


def test_an_address_without_a_cluster_fails_within_seconds_naming_it(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    started = time.monotonic()
    result = invoke("run", path, "--ray", "--ray-address", "127.0.0.1:1", "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "no Ray cluster at 127.0.0.1:1: cannot reach 127.0.0.1:1" in result.stderr
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("args, message", [
    (["--ray-replicas", 2, "-o", "{tmp}/out.jsonl"], "--ray-address/--ray-replicas without --ray"),
    (["--ray", "-o", "{tmp}/out.csv"], "named *.parquet or *.jsonl"),
    (["--ray"], "--ray needs -o OUTPUT"),
    (["--ray", "-o", "{tmp}/in.jsonl"], "is a file; with --ray OUTPUT is a directory"),
    # a bad engine option: before Ray starts (not as the actors' failure, exit 3)
    (["--ray", "-o", "{tmp}/out.jsonl", "--model", "tiny-qwen3", "--load-format", "dummy", "--block-size", 3],
     "engine argument block_size=3: must be a power of two"),
])
def test_run_ray_rejects_what_it_does_not_support(tmp_path, args, message):
    path = write_jsonl(tmp_path / "in.jsonl", ROWS[:1])
    result = invoke("run", path, *[str(a).format(tmp=tmp_path) for a in args])
    assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_run_ray_without_ray_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    result = invoke("run", write_jsonl(tmp_path / "in.jsonl", ROWS[:1]), "--ray", "-o", tmp_path / "out.jsonl")
    assert result.exit_code == 2 and "--ray needs Ray: pip install 'nanovllm[ray]'" in result.stderr


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




def test_parts_leave_out_the_rows_committed_shards_answer(tmp_path):
    """A resumed job's parts: only the lines (rows) no committed shard answers, cut at --window, byte offsets right."""
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt": "é" * i} for i in range(12)])
    (item,) = [vars(f) for f in list_input_files(str(path), None)]
    parts = [InputPart(**p) for p in file_parts(item, 3, [(4, 2), (9, 1)])]
    assert [(p.first, p.count) for p in parts] == [(1, 3), (6, 3), (10, 3)]
    assert [n for n, _ in values_of(path, parts)] == [1, 2, 3, 6, 7, 8, 10, 11, 12]
    assert values_of(path, parts) == [v for v in iter_rows(path, "jsonl") if v[0] not in (4, 5, 9)]
    path = write_parquet(tmp_path / "in.parquet", [{"id": f"r{i}", "prompt": "x"} for i in range(12)])
    (item,) = [vars(f) for f in list_input_files(str(path), None)]
    assert [(p["first"], p["count"]) for p in file_parts(item, 3, [(4, 2), (9, 1)])] == [(1, 3), (6, 3), (10, 3)]
    assert [(p["first"], p["count"]) for p in file_parts(item, 5, [(1, 12)])] == []
    merged = merge_parts([InputPart(**p) for p in file_parts(item, 2, [(5, 1)])], 3)  # 6 parts; touching ones merge
    assert [(p.first, p.count) for p in merged] == [(1, 4), (6, 4), (10, 3)]


def manifest(key, first, count, committed, url="file:///in.jsonl", replaces=None):
    return {"key": key, "shard": f"part-{key}.jsonl", "part": {"url": url, "first": first, "count": count},
            "committed": committed, "replaces": replaces}


def test_resume_cuts_what_no_manifest_commits_and_keeps_one_manifest_per_row():
    state = OutputState(
        manifests={m["key"]: m for m in (
            manifest("a", 1, 3, 1.0), manifest("b", 4, 3, 2.0),
            manifest("b2", 4, 3, 5.0, replaces="b"),  # --retry-failed rewrote b: b goes
            manifest("late", 1, 3, 4.0),  # an actor given up for dead that committed anyway: the older stays
            manifest("other", 1, 3, 3.0, url="file:///other.jsonl"))},
        shards={"part-a.jsonl", "part-b.jsonl", "part-b2.jsonl", "part-late.jsonl", "part-other.jsonl",
                "part-cut.jsonl"},  # renamed into place by a killed job before its manifest was
        leftovers=["_tmp/part-x.jsonl.1234"])
    dropped, cut = state.superfluous()
    assert sorted(m["key"] for m in dropped) == ["b", "late"]
    assert cut == ["part-b.jsonl", "part-cut.jsonl", "part-late.jsonl", "_tmp/part-x.jsonl.1234"]


# ---- jobs that survive ---------------------------------------------------------------------------------------------

TOKEN_ROWS = [{"id": f"t{i}", "prompt_token_ids": [i % 400 + 1] * (3 + i % 5)} for i in range(24)]
TINY = ["--model", "tiny-qwen3", "--load-format", "dummy", "--max-tokens", 6, "--ignore-eos"]


def shard_records(out):
    """Every record in OUTPUT's shards (Parquet: as rows, nested fields as JSON text)."""
    return [record for f in sorted(out.glob("part-*")) for record in (
        pq.read_table(f).to_pylist() if f.suffix == ".parquet" else map(json.loads, f.read_text().splitlines()))]


def manifests(out):
    return sorted((out / "_manifests").glob("*.json")) if (out / "_manifests").exists() else []


def start_driver(path, out, *flags):
    """`nanovllm run --ray` in a process of its own, joining this test's cluster (as a driver on a head node)."""
    address = ray.get_runtime_context().gcs_address
    command = [NANOVLLM, "run", path, "--ray", "--ray-address", address, "-o", out, *TINY, "-q", *flags]
    return subprocess.Popen([str(a) for a in command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def kill_when(proc, condition, timeout=300):
    """SIGKILL the driver once `condition()` holds (it must not finish first)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    proc.kill()
    proc.communicate()


def check_once(out, expected, fields=None):
    """OUTPUT has one record per row, each the record `nanovllm run` gives it."""
    records = shard_records(out)
    assert sorted(r["id"] for r in records) == sorted(expected)
    fields = fields or records[0].keys()
    assert {r["id"]: {k: r[k] for k in fields} for r in records} == {
        i: {k: r[k] for k in fields} for i, r in expected.items()}


@pytest.mark.slow  # three drivers, each starting its engine actors
def test_run_ray_killed_driver_resumes_with_every_row_once_jsonl(cluster, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", TOKEN_ROWS)
    expected = {r["id"]: r for r in map(json.loads, invoke_run(path, tmp_path / "ref.jsonl").read_text().splitlines())}
    out = tmp_path / "results.jsonl"
    # Kill point 1: mid-job, as its first part commits.
    kill_when(start_driver(path, out, "--window", 3, "--ray-replicas", 2), lambda: manifests(out))
    committed = len(manifests(out))
    assert 0 < committed < 8
    # What a kill leaves between a shard's rename and its manifest's, and a file half written under _tmp.
    shutil.copy(next(out.glob("part-*")), out / "part-00000000-0000000001-00000000.jsonl")
    (out / "_tmp").mkdir(exist_ok=True)
    (out / "_tmp" / "part-x.jsonl.1234").write_text('{"id": "t1", "te')
    assert invoke("run", path, "--ray", "-o", out, *TINY).exit_code == 2  # holds files: --resume or --overwrite
    # Kill point 2: the resumed run, as it commits a part of its own.
    kill_when(start_driver(path, out, "--window", 3, "--ray-replicas", 2, "--resume"),
              lambda: len(manifests(out)) > committed)
    result = invoke("run", path, "--ray", "-o", out, *TINY, "--window", 3, "--resume", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["rows_total"] == 24 and summary["rows_skipped"] + summary["rows_ok"] == 24
    assert summary["rows_skipped"] >= 3 * (committed + 1)
    check_once(out, expected)
    assert not (out / "_tmp").exists() and len(manifests(out)) == len(list(out.glob("part-*")))


def invoke_run(path, out, *flags):
    """`nanovllm run`'s own records for the rows of `path`: the reference."""
    result = invoke("run", path, "-o", out, *TINY, "-q", *flags)
    assert result.exit_code in (0, 1), result.stderr
    return out


@pytest.mark.slow  # three drivers, each starting its engine actor
def test_run_ray_killed_driver_resumes_parquet_and_retry_failed_and_sync_rewrite_shards(cluster, tmp_path):
    rows = [*TOKEN_ROWS[:10], {"id": "bad", "prompt_token_ids": "not ids"}, *TOKEN_ROWS[10:14]]
    folder = tmp_path / "in"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", rows[:8])
    write_jsonl(folder / "b.jsonl", rows[8:])
    out = tmp_path / "results.parquet"
    # Kill point: early, before (most likely) any part is committed.
    proc = start_driver(folder, out, "--window", 2)
    time.sleep(3)
    kill_when(proc, lambda: True)
    result = invoke("run", folder, "--ray", "-o", out, *TINY, "--window", 2, "--resume", "--json", "-q")
    assert result.exit_code == 1, result.stderr  # the bad row's error record
    first = {r["id"]: r for r in shard_records(out)}
    assert len(first) == len(rows) and len(shard_records(out)) == len(rows)
    assert first["bad"]["error"].startswith("b.jsonl line 3: 'prompt_token_ids' must be")
    fields = [f for f in PLAIN_FIELDS if f != "error"]
    reference = {r["id"]: r for r in pq.read_table(invoke_run(write_jsonl(tmp_path / "all.jsonl", rows),
                                                              tmp_path / "ref.parquet")).to_pylist()}
    check_once(out, {**reference, "bad": first["bad"]}, fields)
    # --retry-failed: the failed row runs again (and fails again); its shard is rewritten, the others stay.
    before = {m.name for m in manifests(out)}
    result = invoke("run", folder, "--ray", "-o", out, *TINY, "--window", 2, "--retry-failed", "--json", "-q")
    assert result.exit_code == 1, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["rows_ok"], summary["rows_failed"], summary["rows_skipped"]) == (0, 1, len(rows) - 1)
    after = {m.name for m in manifests(out)}
    assert len(before - after) == len(after - before) == 1
    check_once(out, {**reference, "bad": first["bad"]}, fields)
    # A changed input file: --resume refuses; --sync reruns that file alone.
    write_jsonl(folder / "b.jsonl", [*rows[8:10], {"id": "bad", "prompt_token_ids": [7, 7]}, *rows[11:]])
    result = invoke("run", folder, "--ray", "-o", out, *TINY, "--window", 2, "--resume")
    assert result.exit_code == 2 and "shards answer input files changed since" in result.stderr
    result = invoke("run", folder, "--ray", "-o", out, *TINY, "--window", 2, "--sync", "--json", "-q")
    assert result.exit_code == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["rows_ok"], summary["rows_skipped"]) == (len(rows) - 8, 8)
    records = {r["id"]: r for r in shard_records(out)}
    assert len(records) == len(shard_records(out)) == len(rows) and records["bad"]["completion_tokens"] == 6


def engine_children(pid):
    """The engine process an actor spawned (its replica of one), from whichever of its threads."""
    children = [c for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]
    return [int(c) for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]


def test_a_killed_engine_actor_and_a_killed_engine_cost_no_row(cluster, tmp_path):
    """Mid-job, an actor holding a part is killed (the driver replaces it; its part goes to the next free actor),
    then another actor loses its engine process (the actor restarts it and reruns its rows): every row answered
    once, fully, and the summary says what was retried. Each kill waits for an actor ready with rows left, so it
    does not matter which actor starts first or how late the other is."""
    rows = [{"id": f"t{i}", "prompt_token_ids": [i % 400 + 1] * (3 + i % 5)} for i in range(40)]
    path, out, metrics = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl", tmp_path / "m.jsonl"
    killed = {}

    def ready_actor(most_done, exclude=None):
        """The first line of the metrics file showing a ready actor holding rows (not `exclude`), with at most
        `most_done` rows done in all."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            lines = metrics.read_text().splitlines() if metrics.exists() else []
            last = json.loads(lines[-1]) if lines else {"replicas": [], "rows_done": 0}
            for replica in last["replicas"]:
                if (replica["state"] == "ready" and replica["outstanding"] and replica["pid"] != exclude
                        and last["rows_done"] <= most_done):
                    return replica
            time.sleep(0.05)
        return None

    def kill_two():
        actor = ready_actor(20)
        if actor is None:
            return
        os.kill(actor["pid"], signal.SIGKILL)
        killed["actor"] = actor
        other = ready_actor(35, exclude=actor["pid"])
        engines = engine_children(other["pid"]) if other else []
        if engines:
            os.kill(engines[0], signal.SIGKILL)
            killed["engine"] = engines[0]

    killer = threading.Thread(target=kill_two)
    killer.start()
    result = invoke("run", path, "--ray", "--ray-replicas", 2, "-o", out, "--model", "tiny-qwen3", "--load-format", "dummy",
                    "--max-tokens", 16, "--ignore-eos", "--max-num-seqs", 2, "--window", 4, "--metrics-file", metrics,
                    "--metrics-interval", 0.2, "--json", "-q")
    killer.join()
    assert result.exit_code == 0 and len(killed) == 2, (killed, result.stderr)
    summary = json.loads(result.stdout)
    retries = summary["retries"]
    assert retries["replica_deaths"] == 2 and retries["replica_restarts"] == 2, retries["events"]
    assert retries["parts_rerun"] == 1 and retries["rows_rerun"] >= 4
    events = "\n".join(retries["events"])
    assert f"pid {killed['actor']['pid']}) died" in events and "goes to the next free actor" in events
    assert f"(pid {killed['engine']}, CPU) died: killed by SIGKILL" in events
    records = shard_records(out)
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in rows)  # once each
    assert all(r["error"] is None and r["completion_tokens"] == 16 for r in records)
    assert sum(r["rows"] for r in summary["replicas"]) == summary["rows_ok"] == len(rows)


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
    records = {r["id"]: r for shard in sorted(out.glob("part-*")) for r in map(json.loads, shard.read_text().splitlines())}
    assert set(records) == {"a1", "bad", "a2", "b1"}
    assert "a row cannot bring a chat template" in records["bad"]["error"]
    assert all(records[i]["error"] is None and records[i]["completion_tokens"] > 0 for i in ("a1", "a2", "b1"))
