"""Honest progress figures for a `run` job in this process, beside display.py's drawing of them.

- **Loading** (`loading`): while the job checks INPUT and loads the model (tens of seconds for a large one), a
  spinner on a terminal (a line per stage otherwise) names the stage and its time; once loaded, one line gives the
  engine's own phases (`LLM.info.startup_s`).
- **Rates over a recent window** (`RecentRates`): output and prefill tok/s over the last `WINDOW_S` seconds, not
  the job's average, which keeps falling after the prompts are in.
- **A bounded ETA** (`TokenBudget`): every row may generate at most its max_tokens (x its n or best_of). What is
  left is at most the budget of the rows not yet answered less what the rows in flight have generated, so the
  time left is at most that over the recent output rate. The estimate (the mean length of finished rows) is shown
  within that bound; when it has run out (the rows in flight are longer than the finished ones were) only the
  bound is shown, never "0s" while rows still run.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.live import Live
from rich.spinner import Spinner

from nanovllm_cli.rows import is_openai_row, row_id

WINDOW_S = 30.0  # seconds the recent rates are measured over


def declared_budget(row: object, default_max_tokens: int) -> int:
    """The most tokens a raw row may generate: its max_tokens (an OpenAI body's max_completion_tokens or
    max_tokens; a plain row's, or its sampling_params') times its n or best_of, read as declared (a value the row
    parser will refuse counts as the default: its row generates nothing)."""
    if not isinstance(row, dict):
        return 0
    if is_openai_row(row):
        fields = row.get("body")
    else:
        nested = row.get("sampling_params")
        fields = {**row, **nested} if isinstance(nested, dict) else row
    if not isinstance(fields, dict):
        return 0

    def whole(name: str, default: int) -> int:
        value = fields.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 40 else default

    max_tokens = whole("max_completion_tokens", whole("max_tokens", default_max_tokens))
    return max_tokens * max(whole("n", 1), whole("best_of", 1))


class TokenBudget:
    """The tokens the rows not yet answered may still generate (see the module docstring). Feed it the raw rows as
    the job reads them (`rows`) and each record as it is written (`answered`)."""

    def __init__(self, total: int, id_key: str, skip_ids: set[str], default_max_tokens: int):
        self.unread = total  # the budget of the rows the job has not read yet
        self.outstanding: dict[str, int] = {}  # read, not answered: id -> budget
        self.outstanding_total = 0
        self.id_key = id_key
        self.skip_ids = skip_ids
        self.default_max_tokens = default_max_tokens

    def rows(self, rows: Iterable[tuple[int, object]]) -> Iterator[tuple[int, object]]:
        for number, row in rows:
            budget = declared_budget(row, self.default_max_tokens)
            self.unread -= budget
            rid = row_id(number, row)
            if rid not in self.skip_ids and rid not in self.outstanding:
                self.outstanding[rid] = budget
                self.outstanding_total += budget
            yield number, row

    def answered(self, record: dict) -> None:
        self.outstanding_total -= self.outstanding.pop(str(record.get(self.id_key)), 0)

    def left(self, generated_in_flight: int) -> int:
        """The most tokens still to generate, given what the rows in flight have generated."""
        return max(self.unread + self.outstanding_total - generated_in_flight, 0)


class RecordTap:
    """A writer that tells `on_record` of every record before writing it."""

    def __init__(self, writer, on_record: Callable[[dict], None]):
        self._writer = writer
        self._on_record = on_record

    def write(self, record: dict) -> None:
        self._on_record(record)
        self._writer.write(record)

    def __getattr__(self, name: str):
        return getattr(self._writer, name)


class RecentRates:
    """Rates of counters over the last `window_s` seconds (over all samples while the job is younger)."""

    def __init__(self, window_s: float = WINDOW_S, clock: Callable[[], float] = time.perf_counter):
        self.window_s = window_s
        self.clock = clock
        self.samples: deque[tuple[float, tuple[float, ...]]] = deque()

    def update(self, *counters: float) -> tuple[float, ...]:
        """Record the counters now; their rates per second over the window (0 until two samples differ in time)."""
        now = self.clock()
        self.samples.append((now, counters))
        while len(self.samples) > 2 and now - self.samples[1][0] >= self.window_s:
            self.samples.popleft()
        start, first = self.samples[0]
        elapsed = now - start
        if elapsed <= 0:
            return tuple(0.0 for _ in counters)
        return tuple((c - f) / elapsed for c, f in zip(counters, first))


def bounded_eta(estimate_s: float | None, tokens_left: int, tok_s: float) -> tuple[float | None, float | None]:
    """(estimate within the bound, or None when it has none or has run out; the bound) in seconds. The bound is
    None while nothing is being generated (no rate to divide by)."""
    bound = tokens_left / tok_s if tok_s > 0 else None
    if estimate_s is None or estimate_s <= 0:
        return None, bound
    return (estimate_s if bound is None else min(estimate_s, bound)), bound


# Names of `LLM.info.startup_s` phases as the user reads them.
PHASES = {"resolve": "resolve", "load_weights": "weights", "worst_step": "warm-up", "cuda_graphs": "CUDA graphs",
          "sampling_kernels": "sampling kernels"}


def startup_line(startup_s: dict[str, float]) -> str:
    """'model loaded in 12.3 s (resolve 1.0 s, weights 8.1 s, ...)' from `LLM.info.startup_s`."""
    parts = [f"{PHASES.get(name, name)} {seconds:.1f} s" for name, seconds in startup_s.items() if name != "total"]
    total = startup_s.get("total", sum(startup_s.values()))
    return f"model loaded in {total:.1f} s" + (f" ({', '.join(parts)})" if parts else "")


class Stages:
    """Names the stage the job is in (`stage(name)`); on a terminal a spinner with the stage's time, else a line
    on stderr for the long stages."""

    def __init__(self, console: Console, quiet: bool):
        self.console = console
        self.quiet = quiet
        self.name = ""
        self.started = time.perf_counter()
        self.live: Live | None = None
        self.spinner = Spinner("dots")
        self.stop = threading.Event()

    def __call__(self, name: str, log: bool = False) -> None:
        """Enter stage `name`; without a terminal it is said only when `log` (a long stage)."""
        self.name, self.started = name, time.perf_counter()
        if self.quiet:
            return
        if self.live is not None:
            self._draw()
        elif log:
            print(f"[nanovllm] {name} ...", file=sys.stderr, flush=True)

    def _draw(self) -> None:
        self.spinner.update(text=f"{self.name} ({time.perf_counter() - self.started:.0f} s)")

    def __enter__(self) -> Stages:
        if not self.quiet and self.console.is_terminal:
            self.live = Live(self.spinner, console=self.console, refresh_per_second=8, transient=True,
                             redirect_stdout=False, redirect_stderr=False)
            self.live.start()
            threading.Thread(target=self._tick, daemon=True).start()
        return self

    def _tick(self) -> None:
        while not self.stop.wait(0.5):
            self._draw()

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.live is not None:
            self.live.stop()
            self.live = None

    def done(self, line: str) -> None:
        """The stages are over: stop the spinner and say `line`."""
        self.__exit__()
        if not self.quiet:
            self.console.print(f"[nanovllm] {line}", markup=False, highlight=False, soft_wrap=True)


@contextmanager
def loading(quiet: bool, console: Console | None = None) -> Iterator[Stages]:
    """The stages before a job runs (see `Stages`)."""
    with Stages(console or Console(stderr=True), quiet) as stages:
        yield stages
