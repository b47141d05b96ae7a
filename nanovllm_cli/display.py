"""What the user sees on stderr: a rich progress bar on a terminal, else a plain line every few seconds, and a
summary table at the end. stdout stays free for `--json`."""
from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text


@dataclass
class ReplicaProgress:
    """One engine replica (a --data-parallel-size process or a --ray actor) in the live figures."""

    index: int
    pid: int | None  # its process (a --ray actor's on its node)
    state: str  # "starting" | "ready" | "retired" (died with no restart left)
    rows: int  # rows it answered
    outstanding: int  # rows it holds, not answered yet
    generated_tokens: int
    tok_s: float  # its generated tokens per second over the span of the job's rate (they add up to the job's)
    restarts: int = 0


@dataclass
class Snapshot:
    rows_done: int  # including rows skipped because OUTPUT has them
    rows_total: int
    rows_failed: int
    rows_per_s: float  # rows answered or failed by this run
    output_tok_s: float  # tokens generated per second, counted every step (not only those of finished rows)
    prefill_tok_s: float
    kv_cache_usage: float | None  # None where the engines' figures do not reach the driver
    prefix_hit_rate: float | None
    elapsed_s: float
    eta_s: float | None
    eta_bound_s: float | None = None  # at most this long: the rows' max_tokens at the output rate (progress.py)
    generated_tokens: int = 0
    completion_tokens: int = 0  # of the rows answered
    replicas: list[ReplicaProgress] | None = None  # with several engines: each one's
    retries: dict | None = None  # replica_deaths, replica_restarts, rows_rerun, rows_failed_by_deaths

    def figures(self) -> str:
        parts = [f"{self.rows_failed} failed", f"out {self.output_tok_s:,.1f} tok/s"]
        if self.replicas is not None:
            parts.append("replicas " + " / ".join(f"{r.tok_s:,.1f}" if r.state == "ready" else r.state
                                                  for r in self.replicas) + " tok/s")
        if self.retries and self.retries["replica_deaths"]:
            parts.append(f"{self.retries['replica_deaths']} replica deaths, {self.retries['rows_rerun']} rows rerun")
        parts.append(f"prefill {self.prefill_tok_s:,.1f} tok/s")
        if self.kv_cache_usage is not None:
            parts.append(f"kv {self.kv_cache_usage:.0%}")
        if self.prefix_hit_rate is not None:
            parts.append(f"prefix hit {self.prefix_hit_rate:.0%}")
        parts.append(f"eta {self.eta()}")
        return " | ".join(parts)

    def eta(self) -> str:
        """'0s' once every row is answered; while rows remain, never '0s' (see `eta_text`)."""
        return "0s" if self.rows_done >= self.rows_total else eta_text(self.eta_s, self.eta_bound_s)

    def as_dict(self) -> dict:
        """The figures for a machine (the metrics file)."""
        return {**{k: v for k, v in vars(self).items() if k != "replicas"},
                "replicas": None if self.replicas is None else [vars(r) for r in self.replicas]}


def eta_text(eta_s: float | None, bound_s: float | None) -> str:
    """The time left while rows remain: '1m10s', '1m10s (<= 4m00s)', or '<= 4m00s' when only the bound is known;
    under half a second '<1s', since '0s' would say the job is done."""
    def left(seconds: float | None) -> str:
        return "<1s" if seconds is not None and seconds < 0.5 else duration(seconds)

    if bound_s is None:
        return left(eta_s)
    return f"<= {left(bound_s)}" if eta_s is None else f"{left(eta_s)} (<= {left(bound_s)})"


def eta_seconds(tokens_left: float | None, tokens_in_flight: int, tok_s: float) -> float | None:
    """Time to generate what is left: `tokens_left`, the output the unanswered rows are expected to produce (each
    row at the mean length of the finished ones, never more than its max_tokens), less what the rows in flight
    already generated, at the current token rate. It moves during long rows, where a rate of finished rows
    stands still; unknown until a row has finished."""
    if tokens_left is None or tok_s <= 0:
        return None
    return max(tokens_left - tokens_in_flight, 0.0) / tok_s


def notice(console: Console, message: str) -> None:
    """Something the job went through (a replica died and was restarted), on stderr, quiet or not."""
    console.print(Text.assemble(("notice ", "yellow"), message), soft_wrap=True, highlight=False)


def duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes, s = divmod(round(seconds), 60)
    h, m = divmod(minutes, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class ProgressDisplay:
    """Call `tick()` often; it redraws at most 4 times a second (terminal) or every `log_interval` s (plain).

    On a terminal: a bar (rows done / total, elapsed) over a line of live figures. Row errors are printed
    (quiet or not) up to `MAX_ROW_ERRORS`; OUTPUT has them all."""

    MAX_ROW_ERRORS = 20

    def __init__(self, snapshot: Callable[[], Snapshot], *, quiet: bool, log_interval: float,
                 console: Console | None = None):
        self.snapshot = snapshot
        self.quiet = quiet
        self.console = console or Console(stderr=True)
        self.interval = 0.25 if self.console.is_terminal else log_interval
        self.last = time.monotonic()
        self.bar = Progress(TextColumn("[bold]rows"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=self.console)
        self.task = self.bar.add_task("rows", total=None)
        self.figures = Text()
        self.live: Live | None = None
        self.row_errors = 0

    def __enter__(self):
        if not self.quiet and self.console.is_terminal:
            self.live = Live(Group(self.bar, self.figures), console=self.console, refresh_per_second=4,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.tick(force=True)
        if self.live is not None:
            self.live.stop()

    def row_error(self, message: str) -> None:
        self.row_errors += 1
        if self.row_errors <= self.MAX_ROW_ERRORS:
            self.console.print(Text.assemble(("row error ", "red"), message), soft_wrap=True, highlight=False)
        elif self.row_errors == self.MAX_ROW_ERRORS + 1:
            self.console.print("more row errors: only in OUTPUT (their records' \"error\" field)")

    def tick(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.quiet or (not force and now - self.last < self.interval):
            return
        self.last = now
        snap = self.snapshot()
        if self.live is not None:
            self.bar.update(self.task, completed=snap.rows_done, total=snap.rows_total)
            self.figures.plain = snap.figures()
        else:
            share = f" ({snap.rows_done / snap.rows_total:.0%})" if snap.rows_total else ""
            print(f"[nanovllm] {snap.rows_done}/{snap.rows_total} rows{share} | {snap.figures()} | "
                  f"elapsed {duration(snap.elapsed_s)}", file=sys.stderr, flush=True)


def _fmt(value: object, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}{unit}" if abs(value) >= 100 else f"{value:,.3g}{unit}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}{unit}"
    return f"{value}{unit}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The figures of the summary table; GPU figures only when the engine ran on a GPU (docs/ARCHITECTURE.md), the
    engine's figures only when it ran in this process or its replicas (not with --ray)."""
    engine = summary.get("engine")
    rows = [
        ("output", f"{summary['output']} ({summary['output_format']})"),
        ("model", summary["model"]),
        ("rows ok / failed / skipped / total",
         " / ".join(_fmt(summary[k]) for k in ("rows_ok", "rows_failed", "rows_skipped", "rows_total"))),
        ("prompt tokens (cached)",
         f"{_fmt(summary['prompt_tokens'])} ({_fmt(summary['cached_tokens'])}, {_pct(summary['prefix_hit_rate'])})"),
        ("completion tokens", _fmt(summary["completion_tokens"])),
        ("elapsed", f"{_fmt(summary['elapsed_s'], ' s')} ({_fmt(summary['rows_per_s'])} rows/s)"),
        ("output / prefill tok/s (job)",
         f"{_fmt(summary['output_tok_s'])} / {_fmt(summary['prefill_tok_s'])}"),
    ]
    retries = summary.get("retries")
    if retries is not None:
        rows.append(("retried", retried(retries)))
    if engine is not None:
        rows += engine_rows(engine)
    for replica in summary.get("replicas", ()):
        if "node" in replica:  # a --ray engine actor
            where = replica["node"] or "not started"
        else:
            where = ",".join(replica["devices"]) if replica["devices"] else "CPU"
        hit = replica["cached_tokens"] / replica["prompt_tokens"] if replica["prompt_tokens"] else 0.0
        restarts = f", restarted {replica['restarts']}x" if replica.get("restarts") else ""
        rows.append((f"replica {replica['index']} ({where}, pid {replica['pid']})",
                     f"{_fmt(replica['rows'])} rows, {_fmt(replica['output_tok_s'])} output tok/s, prefix hit "
                     f"{_pct(hit)}, started in {_fmt(replica.get('start_s'), ' s')}{restarts}"))
    rows.append(("exit code", str(summary["exit_code"])))
    return rows


def retried(retries: dict) -> str:
    """What a job went through, in a few words: "nothing", or the deaths, restarts and rows run again."""
    if not retries["replica_deaths"]:
        return "nothing"
    given_up = retries["rows_failed_by_deaths"]
    return (f"{retries['replica_deaths']} replica deaths, {retries['replica_restarts']} restarts, "
            f"{retries['rows_rerun']} rows rerun" + (f", {given_up} rows given up (error records)" if given_up else ""))


def engine_rows(engine: dict) -> list[tuple[str, str]]:
    """The engine's figures (when it ran in this process or in its replicas; not with --ray)."""
    rows = [
        ("engine", f"{engine['device']}, {engine['loop']}, {engine['steps']:,} steps, {engine['preemptions']} preempted"),
        ("output / prefill tok/s (engine steps)",
         f"{_fmt(engine['output_tok_s'])} / {_fmt(engine['prefill_tok_s'])}"),
        ("TTFT p50 / p99", f"{_fmt(engine['ttft_p50_s'], ' s')} / {_fmt(engine['ttft_p99_s'], ' s')}"),
        ("TPOT p50 / p99", f"{_fmt(engine['tpot_p50_s'], ' s')} / {_fmt(engine['tpot_p99_s'], ' s')}"),
        ("host schedule / prepare / postprocess", " / ".join(
            _pct(engine[k]) for k in ("cpu_schedule_share", "cpu_prepare_share", "cpu_postprocess_share"))),
    ]
    if engine["gpu_busy_frac"] is not None:
        rows.append(("GPU busy / idle", f"{_pct(engine['gpu_busy_frac'])} / {_pct(engine['gpu_idle_frac'])}"))
    return rows


def print_summary(summary: dict, console: Console | None = None) -> None:
    table = Table(title="nanovllm run", show_header=False, title_justify="left")
    table.add_column("figure", style="bold")
    table.add_column("value")
    for label, value in summary_rows(summary):
        table.add_row(label, value)
    (console or Console(stderr=True)).print(table)
