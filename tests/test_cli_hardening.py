"""`nanovllm run` against hostile input and concurrent use: whole-file mistakes caught before the model
loads, OUTPUT protected (lock, not INPUT, no silent replacement), rows that fail inside the engine failing with
records, --retry-failed and the exit code, row errors under --quiet, progress from tokens per step."""
import json
import os
from datetime import datetime
from decimal import Decimal

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from nanovllm import LLM, SamplingParams, StepFailedError
from nanovllm_cli.main import app
from nanovllm_cli.preflight import OutputLock

ENGINE = ["--model", "tiny-qwen3", "--load-format", "dummy", "--max-tokens", "3", "--ignore-eos"]
UNLOADABLE = ["--model", "no-such-model"]  # a job that gets as far as loading the model exits 2 naming it


def invoke(*args, engine=ENGINE):
    result = CliRunner().invoke(app, ["run", *map(str, args), *engine])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def rows(n, start=0):
    return [{"id": f"r{i}", "prompt_token_ids": [i + 1, i + 2]} for i in range(start, start + n)]


# ---- pre-flight: INPUT ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lines, message", [
    ([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": "y"}, {"id": "a", "prompt": "z"}], "'a' at lines 1 and 3"),
    ([{"prompt_token_ids": [1]}, {"id": "1", "prompt_token_ids": [2]}], "'1' at lines 1 and 2"),  # line number
])
def test_duplicate_ids_stop_the_job_before_anything_is_written(tmp_path, lines, message):
    path, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = invoke(path, "-o", out, engine=UNLOADABLE)
    assert result.exit_code == 2 and message in result.stderr and "repeats ids" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("make", ["empty", "blank", "parquet"])
def test_empty_input_says_so_and_exits_0_without_loading_the_model(tmp_path, make):
    if make == "parquet":
        path = tmp_path / "in.parquet"
        pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), path)
    else:
        path = tmp_path / "in.jsonl"
        path.write_text("" if make == "empty" else "\n  \n\n")
    result = invoke(path, engine=UNLOADABLE)
    assert result.exit_code == 0 and "has no rows: nothing to do" in result.stderr
    assert not (tmp_path / "in.results.jsonl").exists()


def test_whole_file_mistakes_are_one_message_before_the_model_loads(tmp_path):
    array = tmp_path / "array.jsonl"
    array.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b"}], indent=2))
    one_line_array = write_jsonl(tmp_path / "one.jsonl", [json.dumps([{"prompt": "a"}])])
    no_prompt = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"id": ["a"], "text": ["b"]}), no_prompt)
    parquet_as_jsonl = tmp_path / "p.jsonl"
    parquet_as_jsonl.write_bytes(no_prompt.read_bytes())
    jsonl_as_parquet = write_jsonl(tmp_path / "j.parquet", rows(2))
    for path, message in ((array, "is not JSON Lines"), (one_line_array, "a JSON list, not an object"),
                          (no_prompt, "has no 'prompt', 'messages', 'prompt_token_ids' or 'body' column"),
                          (parquet_as_jsonl, "is not JSON Lines"), (jsonl_as_parquet, "is not a readable Parquet")):
        result = invoke(path, "-o", tmp_path / "out.jsonl", engine=UNLOADABLE)
        assert result.exit_code == 2, (path, result.stderr)
        assert message in result.stderr and result.stderr.count("error:") == 1, result.stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_parquet_columns_json_has_no_type_for_are_fingerprinted_too(tmp_path):
    """Columns beside the row's fields may be timestamps, bytes or decimals: the job ignores them, and --resume
    still tells when one changed."""
    path, out = tmp_path / "in.parquet", tmp_path / "out.jsonl"

    def write(created_b):
        pq.write_table(pa.table({"id": ["a", "b"], "prompt_token_ids": [[1, 2], [3]],
                                 "created": [datetime(2024, 1, 1), created_b], "blob": [b"\x00\xff", b"x"],
                                 "price": pa.array([Decimal("1.5"), Decimal("2")], pa.decimal128(5, 2))}), path)

    write(datetime(2024, 1, 2))
    assert invoke(path, "-o", out).exit_code == 0
    assert sorted(r["id"] for r in records(out)) == ["a", "b"]
    assert invoke(path, "-o", out, "--resume").exit_code == 0
    write(datetime(2024, 1, 3))
    result = invoke(path, "-o", out, "--resume", engine=UNLOADABLE)
    assert result.exit_code == 2 and "1 rows changed since they were answered (e.g. 'b')" in result.stderr


def test_inspect_cache_reports_a_file_of_another_format_as_a_usage_error(tmp_path):
    parquet_as_jsonl = tmp_path / "p.jsonl"
    pq.write_table(pa.table({"prompt": ["a"]}), parquet_as_jsonl)
    jsonl_as_parquet = write_jsonl(tmp_path / "j.parquet", rows(2))
    for path, message in ((parquet_as_jsonl, "is not JSON Lines"), (jsonl_as_parquet, "is not a readable Parquet")):
        result = CliRunner().invoke(app, ["inspect-cache", str(path), "--model", "tiny-qwen3"])
        assert result.exit_code == 2 and message in result.stderr and "Traceback" not in result.stderr


# ---- pre-flight: OUTPUT --------------------------------------------------------------------------------------------

def test_output_under_a_file_names_the_file(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", rows(1))
    (tmp_path / "file").write_text("x")
    result = invoke(path, "-o", tmp_path / "file" / "out.jsonl", engine=UNLOADABLE)
    assert result.exit_code == 2 and f"{tmp_path / 'file'} is a file, not a folder" in result.stderr


def test_output_that_is_the_input_under_another_name_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", rows(3))
    before = path.read_bytes()
    os.link(path, tmp_path / "link.jsonl")
    result = invoke(path, "-o", tmp_path / "link.jsonl", "--overwrite")
    assert result.exit_code == 2 and "must not be INPUT" in result.stderr
    assert path.read_bytes() == before


@pytest.mark.parametrize("input_name, output_name, extra", [
    ("out.parquet.journal.jsonl", "out.parquet", []),  # the journal a Parquet OUTPUT is written through
    ("out.jsonl.lock", "out.jsonl", ["--input-format", "jsonl"]),  # the lock file, which holds the pid
])
def test_a_file_the_job_writes_beside_output_must_not_be_input(tmp_path, input_name, output_name, extra):
    path = write_jsonl(tmp_path / input_name, rows(3))
    before = path.read_bytes()
    result = invoke(path, "-o", tmp_path / output_name, "--overwrite", *extra)
    assert result.exit_code == 2 and "must not be INPUT" in result.stderr
    assert f"the job writes {path} beside OUTPUT" in result.stderr
    assert path.read_bytes() == before


def test_a_finished_output_is_not_replaced_without_overwrite(tmp_path):
    path, out = write_jsonl(tmp_path / "in.jsonl", rows(3)), tmp_path / "out.jsonl"
    assert invoke(path, "-o", out).exit_code == 0
    before = out.read_bytes()
    result = invoke(path, "-o", out, engine=UNLOADABLE)
    assert result.exit_code == 2 and "--resume" in result.stderr and "--overwrite" in result.stderr
    assert out.read_bytes() == before
    assert invoke(path, "-o", out, "--overwrite").exit_code == 0
    assert sorted(r["id"] for r in records(out)) == ["r0", "r1", "r2"]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_a_second_run_on_a_locked_output_exits_2_naming_the_holder(tmp_path, suffix):
    path, out = write_jsonl(tmp_path / "in.jsonl", rows(2)), tmp_path / f"out{suffix}"
    with OutputLock(out):  # a real flock: another open file description conflicts, even in this process
        result = invoke(path, "-o", out, engine=UNLOADABLE)
        assert result.exit_code == 2 and f"being written by another run (pid {os.getpid()})" in result.stderr
        assert not out.exists()
    assert invoke(path, "-o", out).exit_code == 0  # released: the next run goes ahead
    assert not (tmp_path / f"out{suffix}.lock").exists()


def test_two_names_of_one_output_share_its_lock(tmp_path):
    path, out = write_jsonl(tmp_path / "in.jsonl", rows(2)), tmp_path / "out.jsonl"
    (tmp_path / "link.jsonl").symlink_to(out)
    (tmp_path / "folder").symlink_to(tmp_path, target_is_directory=True)
    with OutputLock(out):
        for name in (tmp_path / "link.jsonl", tmp_path / "folder" / "out.jsonl"):
            result = invoke(path, "-o", name, engine=UNLOADABLE)
            assert result.exit_code == 2 and f"OUTPUT {name} is being written by another run" in result.stderr


def test_the_lock_is_held_while_the_job_runs(tmp_path, monkeypatch):
    from nanovllm_cli import job

    path, out = write_jsonl(tmp_path / "in.jsonl", rows(2)), tmp_path / "out.jsonl"
    seen = []

    def try_lock():
        try:
            OutputLock(out).acquire()
        except Exception as exc:  # noqa: BLE001
            seen.append(str(exc))

    monkeypatch.setattr(job.EngineFeeder, "_admit", lambda self, _admit=job.EngineFeeder._admit: (
        try_lock(), _admit(self))[1])
    assert invoke(path, "-o", out).exit_code == 0
    assert seen and all("being written by another run" in s for s in seen)


def test_clear_usage_messages(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", rows(1))
    result = invoke(path, "--kv-cache-gib", "-1")
    assert result.exit_code == 2 and "--kv-cache-gib must be a positive number of GiB, not -1.0" in result.stderr
    for seed in (2**64, -2**63 - 1):  # the engine seeds its generators with int64s
        result = invoke(path, "--seed", seed)
        assert result.exit_code == 2 and f"--seed must be an integer in [-2**63, 2**63 - 1], not {seed}" in result.stderr
    for interval in ("-1", "nan", "0"):
        result = invoke(path, "--log-interval", interval)
        assert result.exit_code == 2 and "--log-interval must be a positive number of seconds" in result.stderr


# ---- rows that fail, --retry-failed, exit codes --------------------------------------------------------------------

def test_a_row_the_engine_cannot_hold_fails_alone_and_resume_is_clean(tmp_path):
    lines = [*rows(2), {"id": "big-seed", "prompt_token_ids": [1], "seed": 2**63}, *rows(2, start=2)]
    path, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    result = invoke(path, "-o", out)
    assert result.exit_code == 1
    by_id = {r["id"]: r for r in records(out)}
    assert len(by_id) == 5 and "seed=9223372036854775808" in by_id["big-seed"]["error"]
    assert all(by_id[f"r{i}"]["error"] is None for i in range(4))


def test_python_api_rejects_out_of_range_fields_and_the_engine_stays_usable():
    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=64, num_kv_blocks=16)
    for bad in ({"seed": 2**63}, {"top_k": 2**63}, {"temperature": float("nan")}, {"min_p": float("inf")}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    params = SamplingParams(max_tokens=2)
    params.seed = 2**64  # changed after construction: add_request checks again
    with pytest.raises(ValueError, match="seed"):
        llm.add_request([1, 2], params)
    assert not llm.has_unfinished_requests()
    assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_failed_step_aborts_its_requests_and_leaves_the_engine_clean(monkeypatch, async_scheduling):
    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=64, num_kv_blocks=16,
              async_scheduling=async_scheduling)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], params)]
    poison_steps(monkeypatch)
    for prompt in ([1, 2, 3], [4, 5], POISON):
        llm.add_request(prompt, params, request_id=str(prompt))
    with pytest.raises(StepFailedError, match="OverflowError") as failed:
        while llm.has_unfinished_requests():
            llm.step()
    assert sorted(failed.value.request_ids) == sorted(map(str, ([1, 2, 3], [4, 5], POISON)))
    assert failed.value.engine_usable and not llm.has_unfinished_requests()
    assert llm.get_metrics()["kv_cache_usage"] == 0  # every block of the aborted requests is free again
    assert [o.token_ids for o in llm.generate([[1, 2, 3], [4, 5]], params)] == expected


def test_a_failed_step_on_a_broken_device_leaves_an_engine_that_refuses_work(tmp_path, monkeypatch):
    from nanovllm.runner.model_runner import ModelRunner

    poison_steps(monkeypatch)
    monkeypatch.setattr(ModelRunner, "device_error", lambda self: "CUDA error: an illegal memory access")
    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=64, num_kv_blocks=16)
    llm.add_request(POISON, SamplingParams(max_tokens=2))
    with pytest.raises(StepFailedError) as failed:
        llm.step()
    assert not failed.value.engine_usable
    with pytest.raises(RuntimeError, match="illegal memory access.*make a new one"):
        llm.add_request([1, 2], SamplingParams(max_tokens=2))
    path, out = write_jsonl(tmp_path / "in.jsonl", [*rows(2), {"id": "poison", "prompt_token_ids": POISON}]), \
        tmp_path / "out.jsonl"
    result = invoke(path, "-o", out)  # the CLI ends the job rather than rerun rows on a broken engine
    assert result.exit_code == 3 and "OverflowError" in result.stderr
    assert sorted(r["id"] for r in records(out)) == ["poison", "r0", "r1"]


def test_an_engine_failure_in_a_step_gives_its_rows_error_records_and_names_them(tmp_path, monkeypatch):
    path, out = write_jsonl(tmp_path / "in.jsonl", rows(4)), tmp_path / "out.jsonl"

    def broken_step(self):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(LLM, "step", broken_step)
    result = invoke(path, "-o", out, "--max-num-seqs", 2)
    assert result.exit_code == 3
    assert "device on fire" in result.stderr and "line 1 (id 'r0')" in result.stderr
    failed = records(out)
    assert sorted(r["id"] for r in failed) == ["r0", "r1"] and all("device on fire" in r["error"] for r in failed)
    monkeypatch.undo()
    result = invoke(path, "-o", out, "--resume", "--json")
    assert result.exit_code == 1  # the two error records remain
    assert json.loads(result.stdout)["rows_failed_before"] == 2
    result = invoke(path, "-o", out, "--retry-failed")
    assert result.exit_code == 0
    final = records(out)
    assert sorted(r["id"] for r in final) == ["r0", "r1", "r2", "r3"] and all(r["error"] is None for r in final)


POISON = [9, 9, 9, 9]  # a prompt whose steps the patched runner fails, standing in for any engine-side fault


def poison_steps(monkeypatch):
    """Make every step that holds a sequence with the POISON prompt raise inside the runner."""
    from nanovllm.runner.model_runner import ModelRunner

    prepare = ModelRunner.prepare

    def failing_prepare(self, batch):
        if any(seq.token_ids[:len(POISON)] == POISON for seq in batch.seqs):
            raise OverflowError("int too big to convert")
        return prepare(self, batch)

    monkeypatch.setattr(ModelRunner, "prepare", failing_prepare)


@pytest.mark.parametrize("async_loop", [False, True])
def test_a_row_that_fails_inside_a_step_fails_alone(tmp_path, monkeypatch, async_loop):
    lines = [*rows(3), {"id": "poison", "prompt_token_ids": POISON}, *rows(4, start=3)]
    path, out, clean = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl", tmp_path / "clean.jsonl"
    loop = ["--include-token-ids", *(["--async"] if async_loop else [])]
    assert invoke(write_jsonl(tmp_path / "clean_in.jsonl", [*rows(3), *rows(4, start=3)]), "-o", clean,
                  *loop).exit_code == 0
    poison_steps(monkeypatch)
    result = invoke(path, "-o", out, "--max-num-seqs", 4, *loop)
    assert result.exit_code == 1  # an error record remains; the job itself went on
    by_id = {r["id"]: r for r in records(out)}
    assert sorted(by_id) == sorted(r["id"] for r in lines)
    assert "the engine failed on this row alone: OverflowError" in by_id.pop("poison")["error"]
    for expected in records(clean):  # the rows that shared its steps were rerun and answered as in a clean run
        got = by_id[expected["id"]]
        assert got["error"] is None and got["token_ids"] == expected["token_ids"], expected["id"]


def test_retry_failed_on_parquet_output(tmp_path):
    lines = [*rows(2), {"id": "bad", "prompt_token_ids": [1], "temperature": -1}]
    path, out = write_jsonl(tmp_path / "in.jsonl", lines), tmp_path / "out.parquet"
    assert invoke(path, "-o", out).exit_code == 1
    assert invoke(path, "-o", out, "--resume").exit_code == 1
    path.write_text(path.read_text().replace('"temperature": -1', '"temperature": 0'))
    assert invoke(path, "-o", out, "--retry-failed").exit_code == 0
    table = pq.read_table(out).to_pylist()
    assert sorted(r["id"] for r in table) == ["bad", "r0", "r1"] and all(r["error"] is None for r in table)


def test_quiet_still_prints_row_errors(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [*rows(1), {"id": "x", "prompt": 5}])
    result = invoke(path, "-q")
    assert result.exit_code == 1
    assert "line 2: 'prompt' must be a non-empty string, not an integer" in result.stderr


def test_every_record_is_one_line_for_any_line_splitter(tmp_path):
    """JSON may hold U+0085, U+2028 and U+2029 raw; str.splitlines and some editors end a line there."""
    odd = "a\x85b\u2028c\u2029d"
    path, out = write_jsonl(tmp_path / "in.jsonl", [{"id": odd, "prompt_token_ids": [1, 2]}]), tmp_path / "out.jsonl"
    assert invoke(path, "-o", out).exit_code == 0
    assert [r["id"] for r in records(out)] == [odd]  # records() reads with splitlines
    assert invoke(path, "-o", out, "--resume").exit_code == 0 and [r["id"] for r in records(out)] == [odd]


# ---- progress ------------------------------------------------------------------------------------------------------

def test_progress_counts_tokens_generated_before_any_row_finishes():
    from nanovllm_cli.job import BatchRunner, EngineFeeder, RunStats
    from nanovllm_cli.progress import RecentRates, TokenBudget
    from nanovllm_cli.run_cmd import snapshot

    llm = LLM("tiny-qwen3", load_format="dummy", max_model_len=128, num_kv_blocks=32)
    rates = RecentRates()
    rates.update(0, 0)  # the job's start
    budget = TokenBudget(total=50, id_key="id", skip_ids=set(), default_max_tokens=64)
    list(budget.rows([(1, {"id": "a", "max_tokens": 50})]))
    llm.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    for _ in range(6):
        llm.step()
    stats = RunStats(rows_total=1)
    runner = BatchRunner(EngineFeeder(llm), None, None, stats, window=1, reorder=False, skip_ids=set(),
                         on_step=lambda: None)
    snap = snapshot(stats, llm, runner, budget, rates)
    # 1 prefill step + 5 decode steps sampled 6 tokens; the counter leaves out the in-flight row's first one
    assert stats.rows_done == 0 and llm.report()["tokens"]["generated"] == 5
    assert snap.output_tok_s > 0 and snap.prefill_tok_s > 0
    assert snap.eta_s is None and snap.eta_bound_s == pytest.approx(45 / snap.output_tok_s)  # no row finished yet


def test_eta_moves_while_long_rows_generate_and_is_bounded_by_each_rows_max_tokens():
    """Ten rows of ~100 tokens, one finished, three in flight: the estimate falls as the in-flight rows generate;
    a row never counts for more than its max_tokens."""
    from nanovllm_cli.display import eta_seconds
    from nanovllm_cli.job import BatchRunner, RunStats

    assert eta_seconds(900.0, 0, 10.0) == 90.0
    assert eta_seconds(900.0, 150, 10.0) == 75.0
    assert eta_seconds(100.0, 500, 10.0) == 0.0  # longer than the mean: never negative
    assert eta_seconds(None, 150, 10.0) is None
    runner = BatchRunner(None, None, None, RunStats(rows_total=10), window=4, reorder=False, skip_ids=set(),
                         on_step=lambda: None)
    runner.rows_read, runner.open = 4, {"short": 8, "long": 500, "mid": 100}  # read, not answered
    # 8 + 100 + 100 for the open rows, then 6 rows not read yet at most --max-tokens 64 each
    assert runner.output_tokens_left(100.0, 64) == 8 + 100 + 100 + 6 * 64


# ---- resume by row content -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_resume_notices_changed_and_removed_rows(tmp_path, suffix):
    path, out = write_jsonl(tmp_path / "in.jsonl", rows(5)), tmp_path / f"out{suffix}"
    assert invoke(path, "-o", out).exit_code == 0
    edited = rows(5)
    edited[1]["prompt_token_ids"] = [7, 7, 7, 7]  # changed
    del edited[3]  # removed
    write_jsonl(path, [*edited, {"id": "new", "prompt_token_ids": [9]}])
    result = invoke(path, "-o", out, "--resume", engine=UNLOADABLE)
    assert result.exit_code == 2
    assert "1 rows changed since they were answered (e.g. 'r1')" in result.stderr
    assert "1 records answer rows no longer in INPUT (e.g. 'r3')" in result.stderr and "--sync" in result.stderr
    result = invoke(path, "-o", out, "--sync", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["rows_skipped"] == 3
    final = pq.read_table(out).to_pylist() if suffix == ".parquet" else records(out)
    by_id = {r["id"]: r for r in final}
    assert len(final) == len(by_id) == 5 and set(by_id) == {"r0", "r1", "r2", "r4", "new"}
    assert by_id["r1"]["prompt_tokens"] == 4  # answered again, from the edited row
    assert invoke(path, "-o", out, "--resume").exit_code == 0  # now in step: nothing to do
