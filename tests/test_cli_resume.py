"""Durability: `--resume` after a torn line, after a crash between a Parquet merge and its cleanup, and after a
real SIGKILL of a running job (every id exactly once, a readable file); interrupts exit 130."""
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from nanovllm_cli import writers
from nanovllm_cli.main import app
from nanovllm_cli.records import RecordLayout

NANOVLLM = Path(sys.executable).parent / "nanovllm"
ENGINE_ARGS = ["--model", "tiny-qwen3", "--load-format", "dummy", "--max-tokens", "6", "--ignore-eos"]


def write_rows(path, n):
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [i % 500 + 1] * (3 + i % 7)}) + "\n"
                            for i in range(n)))
    return path


def invoke(*args):
    result = CliRunner().invoke(app, ["run", *map(str, args), *ENGINE_ARGS, "-q"])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def records(path):
    if path.suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_exactly_once(path, n):
    rows = records(path)
    assert sorted(r["id"] for r in rows) == sorted(f"r{i}" for i in range(n))
    assert all(r["error"] is None and r["completion_tokens"] == 6 for r in rows)


def test_resume_cuts_a_torn_line_and_finishes_exactly_once(tmp_path):
    path, out = write_rows(tmp_path / "in.jsonl", 12), tmp_path / "out.jsonl"
    assert invoke(path, "-o", out).exit_code == 0
    lines = out.read_text().splitlines(keepends=True)
    out.write_text("".join(lines[:5]) + lines[5][:17])  # five whole records, then a torn one
    result = invoke(path, "-o", out, "--resume", "--json")
    assert result.exit_code == 0
    assert out.read_text().splitlines(keepends=True)[:5] == lines[:5]  # kept as they were
    summary = json.loads(result.stdout)
    assert (summary["rows_skipped"], summary["rows_ok"]) == (5, 7)
    assert_exactly_once(out, 12)
    again = json.loads(invoke(path, "-o", out, "--resume", "--json").stdout)  # nothing left to do
    assert (again["rows_skipped"], again["rows_ok"], again["exit_code"]) == (12, 0, 0)
    assert_exactly_once(out, 12)


def test_resume_parquet_from_its_journal(tmp_path):
    path, out = write_rows(tmp_path / "in.jsonl", 10), tmp_path / "out.parquet"
    assert invoke(path, "-o", out).exit_code == 0
    done = records(out)
    out.unlink()  # as if killed before the merge: only the journal holds rows, the last one torn
    journal = writers.journal_path(out)
    journal.write_text("".join(json.dumps(r) + "\n" for r in done[:4]) + json.dumps(done[4])[:20])
    result = invoke(path, "-o", out, "--resume", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["rows_skipped"] == 4
    assert not journal.exists()
    assert_exactly_once(out, 10)


def test_journal_left_by_a_crash_after_the_merge_is_not_merged_twice(tmp_path, monkeypatch):
    layout = RecordLayout(openai=False)
    out = tmp_path / "out.parquet"
    record = {"text": "x", "finish_reason": "stop", "prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0,
              "error": None}
    writer = writers.open_writer(out, layout, append=False)
    for i in range(3):
        writer.write({"id": f"r{i}", **record})
    real_unlink = Path.unlink

    def crash_on_journal(self, *args, **kwargs):
        if self.name.endswith(".journal.jsonl"):
            raise OSError("killed between the replace and the cleanup")
        real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", crash_on_journal)
    with pytest.raises(OSError, match="killed"):
        writer.close()
    monkeypatch.undo()
    assert writers.journal_path(out).exists() and len(records(out)) == 3
    assert writers.resume_ids(out, layout).ids == {"r0", "r1", "r2"}
    assert not writers.journal_path(out).exists()  # recognised as merged
    writer = writers.open_writer(out, layout, append=True)
    writer.write({"id": "r3", **record})
    writer.close()
    assert [r["id"] for r in records(out)] == ["r0", "r1", "r2", "r3"]


def test_resume_refuses_an_output_of_another_kind(tmp_path):
    path, out = write_rows(tmp_path / "in.jsonl", 3), tmp_path / "out.jsonl"
    assert invoke(path, "-o", out).exit_code == 0
    openai = tmp_path / "batch.jsonl"
    openai.write_text(json.dumps({"custom_id": "a", "url": "/v1/completions", "body": {"prompt": [1, 2]}}) + "\n")
    result = invoke(openai, "-o", out, "--resume")
    assert result.exit_code == 2 and "not a result record with 'custom_id'" in result.stderr
    parquet = tmp_path / "out.parquet"
    assert invoke(path, "-o", parquet).exit_code == 0
    result = invoke(path, "-o", parquet, "--resume", "--include-token-ids")
    assert result.exit_code == 2 and "other columns" in result.stderr


def start_job(path, out, *extra):
    """A job slowed down to two rows at a time, so that it is still running when it is stopped."""
    return subprocess.Popen([str(NANOVLLM), "run", str(path), "-o", str(out), *ENGINE_ARGS, "--max-num-seqs", "2",
                             "--quiet", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_records(proc, path, count, timeout=120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().count(b"\n") >= count:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"no {count} records in {path} after {timeout} s")


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_sigkill_mid_job_then_resume_gives_every_id_once(tmp_path, suffix):
    n = 40
    path, out = write_rows(tmp_path / "in.jsonl", n), tmp_path / f"out{suffix}"
    proc = start_job(path, out)
    written = writers.journal_path(out) if suffix == ".parquet" else out
    wait_for_records(proc, written, 8)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    assert written.read_bytes().count(b"\n") < n  # really cut short
    result = invoke(path, "-o", out, "--resume")
    assert result.exit_code == 0, result.stderr
    assert_exactly_once(out, n)


def test_sigterm_stops_cleanly_with_exit_130(tmp_path):
    n = 40
    path, out = write_rows(tmp_path / "in.jsonl", n), tmp_path / "out.jsonl"
    proc = start_job(path, out)
    wait_for_records(proc, out, 4)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "--resume" in stderr and "Traceback" not in stderr
    written = out.read_text()
    assert written.endswith("\n") and 4 <= written.count("\n") < n  # every written record is whole
    assert invoke(path, "-o", out, "--resume").exit_code == 0
    assert_exactly_once(out, n)


def test_kills_at_several_points_with_an_edited_input_leave_every_row_answered_once(tmp_path):
    """kill -9, edit the input (a changed row, a removed row, new rows), kill -9 again mid --sync, then finish:
    every current row is answered exactly once, the changed one from its new content (the lock a killed job
    leaves behind is no obstacle: the OS released it with the process)."""
    path, out = write_rows(tmp_path / "in.jsonl", 30), tmp_path / "out.jsonl"
    proc = start_job(path, out)
    wait_for_records(proc, out, 6)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    answered = [json.loads(line)["id"] for line in out.read_text().splitlines() if line.endswith("}")]
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    changed, removed = answered[0], answered[1]
    for row in rows:
        if row["id"] == changed:
            row["prompt_token_ids"] = [11] * 9
    rows = [r for r in rows if r["id"] != removed] + [{"id": f"new{i}", "prompt_token_ids": [i + 1]} for i in range(4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = start_job(path, out, "--sync")
    wait_for_records(proc, out, len(answered) + 4)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert invoke(path, "-o", out, "--resume").exit_code == 0
    final = records(out)
    assert sorted(r["id"] for r in final) == sorted(r["id"] for r in rows)
    assert all(r["error"] is None and r["completion_tokens"] == 6 for r in final)
    assert next(r for r in final if r["id"] == changed)["prompt_tokens"] == 9
