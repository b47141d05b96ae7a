"""`--metrics-file`: a job's live figures as JSON lines, one every `--metrics-interval` seconds and a last one
when the job ends, for a dashboard to tail (`tail -F`, a log shipper).

Each line is the progress snapshot (`display.Snapshot.as_dict`): rows done / total / failed, tokens, throughput,
ETA, each replica's rows, tokens, rate, state and restarts, and the retries (replica deaths, restarts, rows run
again), with the wall-clock `time` (Unix seconds) and `final` (true on the job's last line). Each line is flushed
as it is written; the file is started anew by each run.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from nanovllm_cli.display import Snapshot


def check_writable(path: Path | None) -> None:
    """Before the model loads: the metrics file can be written (raises OSError naming it)."""
    if path is not None:
        with open(path, "a", encoding="utf-8"):
            pass


class MetricsLog:
    """Call `tick()` often (it writes when the interval is due) and `close()` at the end (the final line).
    Without a path it does nothing."""

    def __init__(self, path: Path | None, interval_s: float, snapshot: Callable[[], Snapshot]):
        self.snapshot = snapshot
        self.interval_s = interval_s
        self.file = None if path is None else open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self.last = time.monotonic()

    def tick(self, final: bool = False) -> None:
        if self.file is None or (not final and time.monotonic() - self.last < self.interval_s):
            return
        self.last = time.monotonic()
        line = {"time": time.time(), **self.snapshot().as_dict(), "final": final}
        self.file.write(json.dumps(line) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.tick(final=True)
            self.file.close()
            self.file = None

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
