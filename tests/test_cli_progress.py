"""Honest progress (nanovllm_cli/progress.py): rates over a recent window, an ETA bounded by what the rows may
still generate (never "eta 0s" while rows remain), and the stages while the model loads. The figures are checked
against sums worked out by hand on a fake clock and a fake engine report; one run checks the lines a job prints."""
import io
import json
import re

import pytest
from rich.console import Console
from typer.testing import CliRunner

from nanovllm_cli.job import RunStats
from nanovllm_cli.main import app
from nanovllm_cli.progress import RecentRates, TokenBudget, bounded_eta, declared_budget, loading, startup_line
from nanovllm_cli.run_cmd import snapshot


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_recent_rates_follow_the_last_window_not_the_job_average():
    clock = Clock()
    rates = RecentRates(window_s=30.0, clock=clock)
    assert rates.update(0, 0) == (0.0, 0.0)  # one sample: no rate yet
    tokens = prefill = 0
    for _ in range(60):  # a minute of prefill at 1,000 tok/s and output at 100 tok/s
        clock.now += 1
        tokens, prefill = tokens + 100, prefill + 1000
        rates.update(tokens, prefill)
    for _ in range(40):  # then the prompts are in: output at 10 tok/s, no prefill
        clock.now += 1
        tokens += 10
        output_rate, prefill_rate = rates.update(tokens, prefill)
    assert output_rate == pytest.approx(10.0) and prefill_rate == 0.0  # the job's averages: 64 and 600 tok/s


def test_replica_rates_add_up_to_the_job_rate_over_the_same_window():
    """Each replica's rate follows the job's window (a replica spawned late counts 0 before), so the progress line's
    replicas always sum to its total: at the start, and once the window has moved past the job's first minute."""
    from nanovllm_cli.run_cmd import rate_counters

    class Pool:  # a ReplicaPool's report of two replicas, the second spawned 10 s in
        replicas = [None, None]
        generated = [0, 0]

        def report(self):
            spawned = [{"index": i, "generated_tokens": g} for i, g in enumerate(self.generated) if i == 0 or g]
            return {"tokens": {"generated": sum(self.generated), "prefill": 0}, "replicas": spawned}

    clock, pool = Clock(), Pool()
    rates = RecentRates(window_s=30.0, clock=clock)
    rates.update(*rate_counters(pool))
    for second in range(1, 91):
        clock.now = second
        pool.generated[0] += 100
        if second > 10:
            pool.generated[1] += 40 if second < 60 else 10
        total, _, *each = rates.update(*rate_counters(pool))
        assert sum(each) == pytest.approx(total)
    assert each == pytest.approx([100.0, 10.0]) and total == pytest.approx(110.0)  # the last 30 s, not the job's


def test_declared_budget_reads_each_row_form():
    assert declared_budget({"prompt": "x"}, 64) == 64
    assert declared_budget({"prompt": "x", "max_tokens": 5, "n": 3}, 64) == 15
    assert declared_budget({"prompt": "x", "sampling_params": {"max_tokens": 7, "best_of": 2}}, 64) == 14
    assert declared_budget({"custom_id": "a", "body": {"max_completion_tokens": 9, "n": 2}}, 64) == 18
    assert declared_budget({"prompt": "x", "max_tokens": -3}, 64) == 64  # refused later: counts the default
    assert declared_budget("not a row", 64) == 0


def test_token_budget_counts_what_rows_not_answered_may_still_generate():
    rows = [(1, {"id": "a", "max_tokens": 10}), (2, {"id": "b", "max_tokens": 20}), (3, {"id": "done"})]
    budget = TokenBudget(total=10 + 20 + 64, id_key="id", skip_ids={"done"}, default_max_tokens=64)
    read = budget.rows(iter(rows))
    next(read)
    assert budget.left(generated_in_flight=4) == 94 - 4
    list(read)
    assert budget.left(generated_in_flight=4) == 30 - 4  # "done" is in OUTPUT already
    budget.answered({"id": "a"})
    assert budget.left(generated_in_flight=4) == 20 - 4


def test_bounded_eta():
    assert bounded_eta(100.0, tokens_left=500, tok_s=10.0) == (50.0, 50.0)  # the estimate cannot pass the bound
    assert bounded_eta(20.0, tokens_left=500, tok_s=10.0) == (20.0, 50.0)
    assert bounded_eta(0.0, tokens_left=500, tok_s=10.0) == (None, 50.0)  # ran out: only the bound
    assert bounded_eta(None, tokens_left=500, tok_s=0.0) == (None, None)  # nothing generated yet


class FakeEngine:
    """An engine's report: `generated` tokens so far (those of the rows in flight included)."""

    class info:  # noqa: N801 (stands in for LLM.info)
        pooling = None

    def __init__(self, generated):
        self.generated = generated

    def report(self):
        return {"kv_cache": {"kv_cache_usage": 0.5, "prefix_cache": {"hit_rate": 0.0}},
                "tokens": {"generated": self.generated, "prefill": 0}}


class FakeRunner:
    """BatchRunner's estimate: each unanswered row at the mean length of the answered ones (8 rows left)."""

    @staticmethod
    def output_tokens_left(per_row, default_max_tokens):
        return 8 * min(per_row, default_max_tokens)


def test_eta_is_never_0s_while_rows_remain():
    """Ten rows of max_tokens 100; two finished after 2 tokens each, the rows in flight have generated 46 tokens
    since: the mean of the finished rows says nothing is left (the old "eta 0s"), the budget bounds the rest."""
    clock = Clock()
    rates = RecentRates(clock=clock)
    stats = RunStats(rows_total=10, rows_ok=2, completion_tokens=4)
    budget = TokenBudget(total=1000, id_key="id", skip_ids=set(), default_max_tokens=100)
    list(budget.rows((i, {"id": str(i), "max_tokens": 100}) for i in range(10)))
    for row_id in ("0", "1"):
        budget.answered({"id": row_id})
    engine = FakeEngine(generated=0)
    rates.update(0, 0)
    clock.now, engine.generated = 10.0, 50  # 5 tok/s
    snap = snapshot(stats, engine, FakeRunner(), budget, rates)
    assert snap.eta_s is None and snap.eta_bound_s == pytest.approx((800 - 46) / 5.0)
    assert "eta <= 2m31s" in snap.figures()
    stats.rows_ok = 10
    assert "eta 0s" in snapshot(stats, engine, FakeRunner(), budget, rates).figures()  # done


def test_loading_names_its_stages_and_the_engines_phases():
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=100)
    with loading(quiet=False, console=console) as stage:
        stage("reading INPUT")
        stage("loading the model")
        stage.done(startup_line({"resolve": 0.5, "load_weights": 2.0, "total": 2.6}))
    text = buffer.getvalue()
    assert "loading the model" in text  # the spinner's last stage, drawn before it stopped
    assert "[nanovllm] model loaded in 2.6 s (resolve 0.5 s, weights 2.0 s)" in text


def test_a_job_logs_its_stages_and_no_eta_0s_before_the_end(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [i + 1] * 3}) + "\n" for i in range(4)))
    result = CliRunner().invoke(app, ["run", str(path), "-o", str(tmp_path / "out.jsonl"), "--model", "tiny-qwen3",
                                      "--load-format", "dummy", "--max-model-len", "64", "--max-tokens", "6",
                                      "--ignore-eos", "--max-num-seqs", "1", "--log-interval", "0.001"])
    assert result.exit_code == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("[nanovllm]")]
    assert lines[0] == "[nanovllm] loading the model ..." and lines[1].startswith("[nanovllm] model loaded in")
    progress = [line for line in lines if " rows (" in line]
    done = [int(re.search(r"(\d+)/4 rows", line).group(1)) for line in progress]
    assert len(progress) >= 4 and done[-1] == 4 and re.search(r"\| eta 0s \| elapsed \S+$", progress[-1])
    assert all("eta 0s" not in line for line, n in zip(progress, done) if n < 4)
