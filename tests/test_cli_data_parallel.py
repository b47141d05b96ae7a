"""Data parallelism (`--data-parallel-size`): replicas give the records one engine gives, rows sharing a prefix
meet on one replica; a killed replica is restarted and the job answers every id once, saying what it retried; a row
that kills two replicas gets an error record and the others finish; the progress, the metrics file and the summary
show each replica's figures; dispatch by outstanding tokens and prefix; the placement rule on GPUs."""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import process_alive
from typer.testing import CliRunner

from nanovllm_cli.main import app
from nanovllm_cli.placement import PlacementError, plan_replicas

NANOVLLM = Path(sys.executable).parent / "nanovllm"
SAMPLE = Path(__file__).resolve().parent.parent / "samples" / "prompts.jsonl"
SHAPE = ["--model", "tiny-qwen3", "--load-format", "dummy"]  # a model shape: random weights, token ids only


def invoke(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert "Traceback" not in result.stderr, result.stderr
    return result


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path):
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def shared_prefix_rows(groups, per_group, prefix_len=32):
    """Rows in file order g0-0 g1-0 ... g0-1 g1-1 ...: each group shares a 2-block prefix, then its own tail (token
    ids inside a tiny preset's vocabulary of 512)."""
    return [{"id": f"g{group}-{member}",
             "prompt_token_ids": [100 * (group + 1) + t for t in range(prefix_len)] + [400 + member] * 5}
            for member in range(per_group) for group in range(groups)]


def run_both(tmp_path, path, *args):
    """The same job with one engine and with two replicas (showing its progress and summary table on stderr):
    their summaries and records, and the replicas' stderr."""
    out = {}
    for dp in (1, 2):
        out[dp] = tmp_path / f"dp{dp}.jsonl"
        quiet = ["-q"] if dp == 1 else []
        result = invoke("run", path, "-o", out[dp], "--json", *quiet, "--data-parallel-size", dp, *args)
        assert result.exit_code == 0, result.stderr
        out[dp] = (json.loads(result.stdout), records(out[dp]))
    return out[1], out[2], result.stderr


def check_replica_figures(stderr: str, summary: dict) -> None:
    """The last progress line shows each replica's output tok/s (or that it is still starting: the job does not
    wait for it) beside the total; the table has a row per replica."""
    progress = [line for line in stderr.splitlines() if line.startswith("[nanovllm] ")][-1]
    total = float(re.search(r"\| out ([\d,.]+) tok/s", progress)[1].replace(",", ""))
    each = re.search(r"\| replicas ([\d,.]+|starting) / ([\d,.]+|starting) tok/s \|", progress)
    assert each, progress
    rates = [float(rate.replace(",", "")) for rate in each.groups() if rate != "starting"]
    assert rates and sum(rates) == pytest.approx(total, rel=0.01, abs=0.2)
    for replica in summary["replicas"]:
        assert f"replica {replica['index']} (CPU, pid {replica['pid']})" in stderr
        assert (replica["output_tok_s"] > 0) == (replica["rows"] > 0)
        assert replica["start_s"] is not None or replica["rows"] == 0


def test_two_replicas_give_the_records_of_one_and_a_prefix_group_meets_on_one_replica(tmp_path):
    rows = [{"id": f"u{i}", "prompt_token_ids": [i % 500 + 1] * (3 + i % 7)} for i in range(12)]
    rows += shared_prefix_rows(groups=2, per_group=4)  # two groups of 4 rows sharing a 32-token (2-block) prefix
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    (one, by_id), (two, by_id_dp), stderr = run_both(tmp_path, path, *SHAPE, "--max-tokens", 5,
                                                     "--include-token-ids")
    assert by_id_dp == by_id and len(by_id) == len(rows)  # the same records, cached_tokens included
    # Every follower hit its group's whole prefix: the group's rows ran on one replica, its leader first.
    for group in range(2):
        assert sorted(by_id[f"g{group}-{m}"]["cached_tokens"] for m in range(4)) == [0, 32, 32, 32]
    assert two["cached_tokens"] == one["cached_tokens"] == 2 * 3 * 32
    replicas = two["replicas"]
    assert [r["index"] for r in replicas] == [0, 1] and two["data_parallel_size"] == 2
    assert sum(r["rows"] for r in replicas) == len(rows)  # on the replicas ready in time (the job waits for none)
    assert two["retries"] == {"replica_deaths": 0, "replica_restarts": 0, "rows_rerun": 0, "rows_failed_by_deaths": 0,
                              "events": []}
    assert sum(r["cached_tokens"] for r in replicas) == 2 * 3 * 32
    assert sum(r["engine"]["requests"] for r in replicas if r["engine"]) == len(rows)
    assert two["engine"]["requests"] == len(rows) and two["kv_cache"]["prefix_cache"]["hit_tokens"] == 2 * 3 * 32
    assert "replicas" not in one
    check_replica_figures(stderr, two)


@pytest.mark.slow  # three loads of the embedded model (one engine, then two replicas)
def test_two_replicas_on_the_embedded_model_give_the_records_of_one(tmp_path):
    """The sample file (text and chat rows) on the embedded SmolLM2, tokenized once in the parent."""
    (_, by_id), (two, by_id_dp), _ = run_both(tmp_path, SAMPLE, "--max-tokens", 3, "--include-token-ids")
    assert by_id_dp == by_id and all(r["error"] is None for r in by_id.values())
    assert sum(r["rows"] for r in two["replicas"]) == len(by_id)


def test_logprobs_come_back_from_the_replicas_as_from_one_engine(tmp_path):
    """Replicas send their outputs through a pipe: logprobs and prompt logprobs (with their token texts) arrive
    whole, as one engine gives them (values within float32 rounding of another batch composition)."""
    rows = [{"id": f"r{i}", "prompt": f"Count to {i}:", "logprobs": 1 + i % 3, "prompt_logprobs": i % 2}
            for i in range(6)]
    path = write_jsonl(tmp_path / "in.jsonl", rows)
    (_, by_id), (_, by_id_dp), _ = run_both(tmp_path, path, "--max-tokens", 4)

    def flat(positions):
        return [v for p in positions if p is not None
                for v in (p["token_id"], p["token"], p["rank"], p["logprob"],
                          *(x for top in p["top_logprobs"] for x in (top["token_id"], top["token"], top["logprob"])))]

    for row_id, record in by_id.items():
        other = by_id_dp[row_id]
        for field in ("logprobs", "prompt_logprobs"):
            ours, theirs = flat(record.pop(field)), flat(other.pop(field))
            assert ours and [v for v in ours if not isinstance(v, float)] == [v for v in theirs if not isinstance(v, float)]
            assert ours == pytest.approx(theirs, abs=1e-4)
    assert by_id_dp == by_id


def metrics_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_killed_replica_is_restarted_and_every_row_is_answered_once(tmp_path):
    """Kill a replica that is running rows (its pid from the metrics file): the job goes on with the other, the
    dead one's rows run again, it is restarted, and OUTPUT has every id once, each fully answered."""
    n = 60
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": f"r{i}", "prompt_token_ids": [i % 500 + 1] * (3 + i % 7)}
                                               for i in range(n)])
    out, metrics = tmp_path / "out.jsonl", tmp_path / "metrics.jsonl"
    proc = subprocess.Popen([str(NANOVLLM), "run", str(path), "-o", str(out), *SHAPE, "--max-tokens", "12",
                             "--ignore-eos", "--data-parallel-size", "2", "--max-num-seqs", "2", "-q", "--json",
                             "--metrics-file", str(metrics), "--metrics-interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    victim = None
    while victim is None:
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        busy = [r for line in metrics_lines(metrics)[-1:] for r in line["replicas"] if r["state"] == "ready"
                and r["rows"] >= 2 and r["outstanding"] >= 2]
        victim = busy[0] if busy and metrics_lines(metrics)[-1]["rows_done"] < n - 10 else None
        time.sleep(0.05)
    os.kill(victim["pid"], signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    summary = json.loads(stdout)
    retries = summary["retries"]
    assert (retries["replica_deaths"], retries["replica_restarts"], retries["rows_failed_by_deaths"]) == (1, 1, 0)
    assert retries["rows_rerun"] >= 1 and summary["rows_ok"] == n
    died = f"replica {victim['index']} (pid {victim['pid']}, CPU) died: killed by SIGKILL"
    assert retries["events"][0].startswith(died) and f"notice {died}" in stderr and "restarting it" in stderr
    restarted = summary["replicas"][victim["index"]]
    assert restarted["restarts"] == 1 and restarted["pid"] != victim["pid"]
    lines = out.read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(f"r{i}" for i in range(n))  # once each
    assert all(json.loads(line)["completion_tokens"] == 12 for line in lines)
    final = metrics_lines(metrics)[-1]
    assert final["final"] and final["rows_done"] == n and final["retries"]["replica_deaths"] == 1
    assert [r["restarts"] for r in final["replicas"]] == [r["restarts"] for r in summary["replicas"]]
    assert not any(process_alive(r["pid"]) for r in summary["replicas"])  # the restarted one was stopped too


POISON = 499  # a token id no other row of the poison test holds


def poisoned_replica_main(model, engine_args, conn_in, conn_out):
    """`replica_main` whose engine kills its own process at a step running a row whose prompt holds POISON (as a
    row that crashes the engine would)."""
    from nanovllm import LLM
    from nanovllm_cli.replica_worker import replica_main

    add_request, step = LLM.add_request, LLM.step

    def poisoned_add_request(self, *args, **kwargs):
        self.poisoned = getattr(self, "poisoned", False) or POISON in (kwargs.get("prompt_token_ids") or ())
        return add_request(self, *args, **kwargs)

    def poisoned_step(self):
        if getattr(self, "poisoned", False):
            os.kill(os.getpid(), signal.SIGKILL)
        return step(self)

    LLM.add_request, LLM.step = poisoned_add_request, poisoned_step
    replica_main(model, engine_args, conn_in, conn_out)


def test_a_row_that_kills_two_replicas_gets_an_error_record_and_the_others_finish(tmp_path, monkeypatch):
    import nanovllm_cli.replica_process as replica_process

    monkeypatch.setattr(replica_process, "_replica_entry", poisoned_replica_main)
    rows = [{"id": f"r{i}", "prompt_token_ids": [i + 1] * (3 + i % 5)} for i in range(16)]
    rows.insert(5, {"id": "poison", "prompt_token_ids": [7, POISON, 7]})
    path, out = write_jsonl(tmp_path / "in.jsonl", rows), tmp_path / "out.jsonl"
    result = invoke("run", path, "-o", out, *SHAPE, "--max-tokens", 6, "--ignore-eos",
                    "--data-parallel-size", 2, "--max-num-seqs", 2, "--json", "-q")
    assert result.exit_code == 1, result.stderr  # the poison row's error record
    summary = json.loads(result.stdout)
    retries = summary["retries"]
    assert (retries["replica_deaths"], retries["rows_failed_by_deaths"]) == (2, 1), retries["events"]
    by_id = records(out)
    assert sorted(by_id) == sorted(r["id"] for r in rows)  # every row once
    poisoned = by_id.pop("poison")
    assert poisoned["finish_reason"] == "error" and poisoned["error"].startswith("line 6: 2 replicas died with this row")
    assert all(r["error"] is None and r["completion_tokens"] == 6 for r in by_id.values())
    assert (summary["rows_ok"], summary["rows_failed"]) == (16, 1)
    assert all("died: killed by SIGKILL" in event.split(";")[0] for event in retries["events"])


def test_bench_spreads_the_workload_over_replicas(tmp_path):
    result = invoke("bench", *SHAPE, "--num-seqs", 12, "--input-len-range", 8, 24,
                    "--output-len-range", 2, 6, "--data-parallel-size", 2, "--json")
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)
    stats = report["modes"]["sync"]
    assert report["data_parallel_size"] == 2 and stats["rows_failed"] == 0
    assert stats["requests"] == 12 and stats["output_tokens"] == report["workload"]["output_tokens"]
    replicas = stats["replicas"]
    assert len(replicas) == 2 and all(r["requests"] > 0 for r in replicas)
    assert sum(r["output_tokens"] for r in replicas) == stats["output_tokens"]
    assert stats["output_tok_s"] == pytest.approx(stats["output_tokens"] / stats["wall_s"])
    assert all(r["wall_s"] <= stats["wall_s"] for r in replicas)  # the parent's clock spans every replica's steps


def test_placement_on_gpus():
    gpus = ["0", "1", "2", "3"]

    def devices(size, tp, visible=gpus, utilization=None):
        plan = plan_replicas(size, tp, True, visible, utilization)
        return [(p.devices, p.gpu_memory_utilization, p.wave) for p in plan]

    assert devices(2, 2) == [(("0", "1"), None, 0), (("2", "3"), None, 0)]
    assert devices(4, 1, ["4", "6", "7", "9"], 0.8) == [((d,), 0.8, 0) for d in ("4", "6", "7", "9")]
    # Two replicas on one GPU at 0.45 each (an engine's own share): the second starts after the first.
    assert devices(2, 1, ["0"], 0.45) == [(("0",), 0.45, 0), (("0",), 0.45, 1)]
    assert devices(3, 2, gpus, 0.3) == [(("0", "1"), 0.3, 0), (("2", "3"), 0.3, 0), (("0", "1"), 0.3, 1)]
    with pytest.raises(PlacementError, match=r"2 x 0.9 = 1.80\): pass --gpu-memory-utilization 0.47"):
        devices(2, 1, ["0"])
    with pytest.raises(PlacementError, match="--tensor-parallel-size 2 needs 2 GPUs per replica; 1 visible"):
        devices(2, 2, ["0"], 0.4)
    cpu = plan_replicas(3, 1, False, [], None)
    assert [p.devices for p in cpu] == [None] * 3 and all(dict(p.env)["OMP_NUM_THREADS"] for p in cpu)


def test_visible_gpus_reads_the_variable_as_torch_does(monkeypatch):
    """NVML's count answers for distinct ordinals below it; what torch reads otherwise (-1 hides every GPU, a
    repeat or an ordinal past the count ends the list, no NVML) goes to torch, which sees no GPU here."""
    import nanovllm_cli.placement as placement

    monkeypatch.setattr(placement, "gpu_count", lambda: 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert placement.visible_gpus() == ["0", "1", "2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    assert placement.visible_gpus() == ["3", "1"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for listed in ("-1", "0,0", "5", "GPU-6f1a", ""):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", listed)
        assert placement.visible_gpus() == [], listed
    monkeypatch.setattr(placement, "gpu_count", lambda: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0,2")
    assert placement.visible_gpus() == ["1", "0"]


def test_a_later_waves_replica_is_not_waited_on_before_it_starts():
    """Replicas sharing a GPU start wave by wave: until its wave starts, a replica has no process, and the pool
    does not wait on it (it used to read the missing process's sentinel)."""
    from nanovllm_cli.placement import Placement

    pool = idle_pool(2, 4)
    for replica in pool.replicas:  # neither started yet: the first wave's pipes are not needed to show it
        replica.placement, replica.state, replica.send_end = Placement(("0",), 0.45, 1), "starting", None
    assert pool._receive(pool._live(), 0) == []


def test_a_replica_that_fails_to_start_stops_those_started_before_it(monkeypatch):
    """The second start fails: the first replica's process is killed and joined and its pipes closed, and the error
    reaches the caller."""
    import multiprocessing as mp

    import nanovllm_cli.replica_start as replica_start
    from nanovllm_cli.replica_process import ReplicaProcess

    started = []

    def start(ctx, model, args, placement, index):
        if index == 1:
            raise OSError("too many open files")
        process = mp.get_context("spawn").Process(target=time.sleep, args=(60,))
        process.start()
        parent_writes, parent_reads = mp.Pipe()
        started.append(ReplicaProcess(process, parent_writes, parent_reads, time.monotonic()))
        return started[-1]

    monkeypatch.setattr(replica_start, "start_replica_process", start)
    with pytest.raises(OSError, match="too many open files"):
        replica_start.spawn_replicas("tiny-qwen3", {"device": "cpu"}, 2)
    (first,) = started
    assert first.process.exitcode is not None and first.send_end.closed and first.recv_end.closed


def test_data_parallel_usage_errors_exit_2(tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [{"id": "a", "prompt_token_ids": [1, 2]}])
    result = invoke("run", path, *SHAPE, "--data-parallel-size", 0)
    assert result.exit_code == 2 and "--data-parallel-size must be at least 1, not 0" in result.stderr
    result = invoke("run", path, "--model", "no-such-model", "--data-parallel-size", 2)
    assert result.exit_code == 2 and "cannot load the model" in result.stderr
    result = invoke("bench", *SHAPE, "--data-parallel-size", 2, "--structured", "json-schema",
                    "--schema", path)
    assert result.exit_code == 2 and "drop --data-parallel-size" in result.stderr


def test_replicas_start_before_the_checks_and_stop_when_a_check_fails(tmp_path, monkeypatch):
    """`run` spawns the replicas before it resolves the model and checks the files (their start overlaps those
    checks); a check that fails still ends with exit 2 and no replica left running."""
    import multiprocessing

    import nanovllm_cli.replica_start as replica_start

    spawned = []
    start = replica_start.start_replica_process
    monkeypatch.setattr(replica_start, "start_replica_process", lambda *args: (spawned.append(args[-1]),
                                                                               start(*args))[1])
    rows = [{"id": "a", "prompt_token_ids": [1, 2]}, {"id": "a", "prompt_token_ids": [3]}]
    result = invoke("run", write_jsonl(tmp_path / "in.jsonl", rows), "-o", tmp_path / "out.jsonl", *SHAPE,
                    "--device", "cpu", "--data-parallel-size", 2)
    assert result.exit_code == 2 and "INPUT repeats ids" in result.stderr, result.stderr
    assert sorted(spawned) == [0, 1] and not multiprocessing.active_children()


START_WITHOUT_THE_ENGINE = """
import sys
import nanovllm_cli.placement as placement
import nanovllm_cli.replica_start as replica_start

placement.gpu_count = lambda: 2  # what NVML reports on a 2-GPU host, without torch
seen = []

def record(ctx, model, args, where, index):
    seen.append((index, where.devices, "torch" in sys.modules, "nanovllm" in sys.modules))
    raise KeyboardInterrupt  # stop before a process is started

replica_start.start_replica_process = record
try:
    replica_start.spawn_replicas("tiny-qwen3", {}, 2)
except KeyboardInterrupt:
    print(seen)
"""


def test_the_parent_starts_its_replicas_before_it_imports_the_engine():
    """On a GPU host the parent places and starts the replicas' processes with neither torch nor the engine
    imported (their own imports and loads then overlap the parent's): GPUs counted through the driver."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    result = subprocess.run([sys.executable, "-c", START_WITHOUT_THE_ENGINE], capture_output=True, text=True,
                            timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[(0, ('0',), False, False)]", result.stdout


def test_a_replica_whose_engine_fails_in_a_step_reports_the_rows_of_that_step(monkeypatch):
    """The replica's side, in this process: groups in, the rows entering the engine reported, a failing step, then
    the rows of that step sent back as failed (the parent runs them again as suspects and restarts the replica) and
    the replica stops."""
    import multiprocessing as mp

    from nanovllm import LLM, SamplingParams
    from nanovllm_cli.replica_worker import replica_main
    from nanovllm_cli.rows import RowRequest

    def broken_step(self):
        raise RuntimeError("device on fire")

    monkeypatch.setattr(LLM, "step", broken_step)
    replica_in, to_replica = mp.Pipe(duplex=False)
    parent_in, to_parent = mp.Pipe(duplex=False)
    rows = [RowRequest(f"r{i}", f"line {i + 1}", "token_ids", [], SamplingParams(max_tokens=2), token_ids=[i + 1] * 3)
            for i in range(3)]
    to_replica.send(("groups", [[row] for row in rows]))
    sigint = signal.getsignal(signal.SIGINT)
    try:
        replica_main("tiny-qwen3", {"max_num_seqs": 2}, replica_in, to_parent)
    finally:
        signal.signal(signal.SIGINT, sigint)
        to_replica.close()  # the replica's inbox thread reads EOF and ends
    messages = []
    while parent_in.poll():
        messages.append(parent_in.recv())
    assert [m[0] for m in messages] == ["ready", "admitted", "failed"]
    assert messages[1][1] == ["r0", "r1"]  # told before the step that failed: a crash there would name them
    _, error, problem, ids = messages[2]
    assert ids == ["r0", "r1"]  # the two rows in the failed step (max_num_seqs 2); r2 was never admitted
    assert "device on fire" in error and "line 1 (id 'r0')" in error and "device on fire" in problem


class SentMessages:
    """The parent's end of a pipe to a replica: what was sent on it."""

    def __init__(self):
        self.sent = []

    def send(self, message):
        self.sent.append(message)


def idle_pool(replicas: int, max_num_seqs: int):
    """A ReplicaPool's dispatch state without processes: `replicas` replicas with nothing outstanding."""
    from collections import OrderedDict, deque

    from nanovllm_cli.placement import Placement
    from nanovllm_cli.replicas import Replica, ReplicaPool

    pool = object.__new__(ReplicaPool)
    pool.replicas = [Replica(i, Placement(None, None, 0), None, SentMessages(), None, state="ready")
                     for i in range(replicas)]
    pool.pending, pool.suspects, pool.requests, pool.failure = deque(), deque(), {}, None
    pool.strikes, pool.affinity = {}, OrderedDict()
    pool.block_size, pool.chunk, pool.room = 16, max_num_seqs, 2 * max_num_seqs
    return pool


def test_dispatch_sends_each_group_whole_to_the_replica_with_the_fewest_outstanding_tokens():
    from collections import deque

    from nanovllm import SamplingParams
    from nanovllm_cli.admission import PrefixGroup
    from nanovllm_cli.job import RowFailure
    from nanovllm_cli.rows import RowRequest

    def group(name, rows, prompt_len, max_tokens=10):
        return PrefixGroup(deque(RowRequest(f"{name}{i}", f"line {i}", "token_ids", [], SamplingParams(
            max_tokens=max_tokens), token_ids=[7] * prompt_len) for i in range(rows)))

    def placed(pool):
        return [[[row.id for row in g] for m in r.send_end.sent for g in m[1]] for r in pool.replicas]

    pool = idle_pool(2, max_num_seqs=3)
    pool.add([group("long", 1, 200), group("short", 2, 5), group("more", 1, 5)])
    # 1 row of 210 tokens on replica 0; replica 1 takes both later groups (more rows, far fewer tokens).
    assert placed(pool) == [[["long0"]], [["short0", "short1"], ["more0"]]]
    assert [r.outstanding_tokens for r in pool.replicas] == [210, 45]
    pool.add([group("big", 5, 5)])  # cut into chunks of max_num_seqs, each placed on its own
    # The first chunk fills replica 1 to 2 x max_num_seqs rows: however few its tokens, the next goes to replica 0.
    assert placed(pool)[1][-1] == ["big0", "big1", "big2"] and placed(pool)[0][-1] == ["big3", "big4"]
    assert [len(r.outstanding) for r in pool.replicas] == [3, 6] and pool.wants_rows()
    pool.add([group("wait", 3, 5)])  # replica 0, at 3 rows, has room; then neither has
    assert placed(pool)[0][-1] == ["wait0", "wait1", "wait2"] and not pool.wants_rows()
    pool.add([group("late", 1, 5)])
    assert [[r.id for r in g] for g in pool.pending] == [["late0"]]
    pool._finish(pool.replicas[1], "short0", RowFailure("answered", 500))  # a row answered frees room
    pool._dispatch()
    assert placed(pool)[1][-1] == ["late0"] and not pool.pending
    assert len(pool.requests) == 12 and "short0" not in pool.requests


def test_suspects_go_alone_beside_other_rows_in_groups_at_the_tail_and_a_prefix_returns_to_its_replica():
    from collections import deque

    from nanovllm import SamplingParams
    from nanovllm_cli.admission import PrefixGroup
    from nanovllm_cli.job import RowFailure
    from nanovllm_cli.rows import RowRequest

    def row(name, tokens, max_tokens=10):
        return RowRequest(name, "line 1", "token_ids", [], SamplingParams(max_tokens=max_tokens), token_ids=tokens)

    def sent(pool):
        return [[[r.id for r in g] for m in replica.send_end.sent for g in m[1]] for replica in pool.replicas]

    pool = idle_pool(2, max_num_seqs=4)
    pool.add([PrefixGroup(deque([row(f"plain{i}", [9] * 3)])) for i in range(2)])  # ordinary rows in flight
    suspects = [row(f"s{i}", [i + 1] * 3) for i in range(3)]
    pool.strikes = {r.id: ["an earlier death"] for r in suspects}
    pool.suspects.extend(suspects)
    pool._dispatch()
    # Rows that were in a dead replica's engine, while other rows run: one per replica, so that a second death
    # names the row that caused it; more ordinary rows still flow beside them.
    assert [m[-1] for m in sent(pool)] == [["s0"], ["s1"]] and [r.id for r in pool.suspects] == ["s2"]
    assert pool.wants_rows()
    pool._finish(pool.replicas[1], "s1", RowFailure("answered", 500))
    pool._dispatch()
    assert sent(pool)[1][-1] == ["s2"] and not pool.suspects

    pool = idle_pool(2, max_num_seqs=4)
    pool.strikes = {r.id: ["an earlier death"] for r in suspects}
    pool.strikes["s2"].append("a death in a group")
    pool.suspects.extend(suspects + [row("s3", [4] * 3)])
    pool.strikes["s3"] = ["an earlier death"]
    pool._dispatch()
    # Nothing else to run: the suspects of one death spread in groups; a row that died in a group goes alone.
    assert sent(pool) == [[["s0", "s1"]], [["s2"]]] and [r.id for r in pool.suspects] == ["s3"]

    pool = idle_pool(2, max_num_seqs=4)
    prefix = [5] * 16  # one KV block; each row below: 17 prompt tokens + 10 = 27 outstanding
    pool.add([PrefixGroup(deque([row("a", prefix + [1])]))])
    # The same prefix goes back to replica 0 while it is at most that group's tokens busier than replica 1 (27 <=
    # 0 + 27) ...
    pool.add([PrefixGroup(deque([row("b", prefix + [2])]))])
    # ... not when it is busier than that (54 > 0 + 27): the least busy takes it, and has the prefix from then on.
    pool.add([PrefixGroup(deque([row("c", prefix + [3])]))])
    pool.add([PrefixGroup(deque([row("d", prefix + [4])]))])
    assert sent(pool) == [[["a"], ["b"]], [["c"], ["d"]]]
    assert pool.affinity[tuple(prefix)] == 1


def test_an_idle_replica_gets_half_the_rows_queued_on_the_busiest():
    """A replica that starts late, or the job's tail: the rows a replica holds beyond its engine go where there is
    room (whole prefix groups that have not entered its engine, newest first)."""
    from collections import deque

    from nanovllm import SamplingParams
    from nanovllm_cli.admission import PrefixGroup
    from nanovllm_cli.job import EngineFeeder
    from nanovllm_cli.rows import RowRequest

    def row(name):
        return RowRequest(name, "line 1", "token_ids", [], SamplingParams(max_tokens=4), token_ids=[1, 2])

    feeder = object.__new__(EngineFeeder)
    feeder.groups = [PrefixGroup(deque([row("a"), row("b")]), leader_round=1), PrefixGroup(deque([row("c")])),
                     PrefixGroup(deque([row("d"), row("e")]))]
    assert [[r.id for r in g] for g in feeder.withdraw(2)] == [["d", "e"]]
    assert [[r.id for r in g] for g in feeder.withdraw(5)] == [["c"]]  # "a" is in the engine: its group stays
    assert [[r.id for r in g.requests] for g in feeder.groups] == [["a", "b"]]

    pool = idle_pool(2, max_num_seqs=2)
    pool.replicas[1].state = "starting"
    pool.add([PrefixGroup(deque([row(f"r{i}")])) for i in range(4)])  # replica 1 not ready yet: all on replica 0
    pool.replicas[1].state = "ready"
    pool.replicas[0].in_engine = {"r0", "r1"}
    pool._rebalance()
    assert pool.replicas[0].send_end.sent[-1] == ("withdraw", 1) and pool.replicas[0].withdrawing
    pool._given_back(pool.replicas[0], [["r3"]])  # what the replica still had queued
    pool._dispatch()
    assert pool.replicas[1].send_end.sent[-1][1][0][0].id == "r3" and not pool.replicas[0].withdrawing
    assert sorted(pool.replicas[0].outstanding) == ["r0", "r1", "r2"] and sorted(pool.requests) == ["r0", "r1", "r2", "r3"]


def test_a_group_that_died_together_goes_alone_and_a_lone_suspect_gets_an_error_record(monkeypatch):
    """ReplicaPool._lost's verdicts: rows of a suspect group in the engine at a death are not convicted (any of
    them may be the cause): they run alone next; a suspect alone in an engine that dies gets its error record,
    the ordinary rows beside it become suspects."""
    from types import SimpleNamespace

    from nanovllm import SamplingParams
    from nanovllm_cli.job import RowFailure
    from nanovllm_cli.replicas import ReplicaPool
    from nanovllm_cli.rows import RowRequest

    def row(name):
        return RowRequest(name, "line 1", "token_ids", [], SamplingParams(max_tokens=4), token_ids=[3, 4])

    pool = idle_pool(2, max_num_seqs=4)
    pool.max_restarts, pool.deaths, pool.rows_rerun, pool.rows_given_up = 3, 0, 0, 0
    pool.events, pool.convicted, pool.on_event = [], [], lambda message: None
    monkeypatch.setattr(ReplicaPool, "_reap", lambda self, replica: None)
    monkeypatch.setattr(ReplicaPool, "_spawn", lambda self, replica: None)
    for replica in pool.replicas:
        replica.process = SimpleNamespace(pid=100 + replica.index)
    replica = pool.replicas[0]

    def die(in_engine):
        pool._lost(replica, "died", set(in_engine))
        replica.state = "ready"

    group = [row("s0"), row("s1"), row("s2")]
    pool.strikes = {r.id: ["an earlier death"] for r in group}
    replica.suspects = {r.id for r in group}
    pool._send(replica, group)
    die(["s0", "s1"])  # two of the group in the engine, s2 still queued there
    assert not pool.convicted and [r.id for r in pool.suspects] == ["s0", "s1", "s2"]
    assert [len(pool.strikes[i]) for i in ("s0", "s1", "s2")] == [2, 2, 1]

    pool.suspects.clear()
    replica.suspects = {"s0"}
    pool._send(replica, [group[0], row("plain")])
    die(["s0", "plain"])  # s0 alone among suspects, beside an ordinary row
    assert [(r.id, type(failure)) for r, failure in pool.convicted] == [("s0", RowFailure)]
    assert pool.convicted[0][1].message.startswith("3 replicas died with this row in their engine")
    assert [r.id for r in pool.suspects] == ["plain"] and pool.rows_given_up == 1


def test_a_retired_replica_counts_its_engines_tokens_once(monkeypatch):
    """A replica that dies with no restart left keeps its last engine report among its earlier incarnations'
    (its share of the job), and counts it once."""
    from types import SimpleNamespace

    from nanovllm_cli.replicas import ReplicaPool

    pool = idle_pool(2, max_num_seqs=4)
    pool.max_restarts, pool.deaths, pool.rows_rerun, pool.rows_given_up = 0, 0, 0, 0
    pool.events, pool.convicted, pool.on_event = [], [], lambda message: None
    monkeypatch.setattr(ReplicaPool, "_reap", lambda self, replica: None)
    for replica in pool.replicas:
        replica.process = SimpleNamespace(pid=100 + replica.index)
    replica = pool.replicas[0]
    replica.report = {"tokens": {"generated": 120}}
    pool._lost(replica, "died", set())
    assert replica.state == "retired" and replica.generated_tokens() == 120
