"""Ctrl-C and SIGTERM stop a command once, whenever they come: the first raises KeyboardInterrupt in the main thread
(during the model load too), and any later one while the command stops is only counted, so that the stop (records
flushed, OUTPUT closed, engines released) is never cut short and the exit code is 130 however many signals came."""
from __future__ import annotations

import functools
import signal
import threading
from collections.abc import Callable
from types import FrameType

import typer

from nanovllm_cli.options import ExitCode

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupts:
    """Installs the handlers for the duration of a `with` block (main thread only; elsewhere it does nothing); once
    a signal came, the handlers left behind only count later ones (the process is stopping)."""

    def __init__(self):
        self.received = 0
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._count(signum, frame)
        if self.received == 1:
            raise KeyboardInterrupt

    def _count(self, signum: int, frame: FrameType | None) -> None:
        self.received += 1

    def __enter__(self) -> Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            # Once stopping, a signal that comes after the command returned but before the process exits must not
            # turn exit 130 into a kill: it stays counted, not given back to the default handler. (A Python handler,
            # unlike SIG_IGN, is not inherited by the programs a process starts later.)
            signal.signal(s, self._count if self.received else handler)
        self._previous = {}


def interruptible(command: Callable) -> Callable:
    """A typer command that exits 130 on Ctrl-C or SIGTERM wherever they come (see Interrupts)."""
    @functools.wraps(command)
    def command_stopping_on_signals(*args, **kwargs):
        with Interrupts():
            try:
                return command(*args, **kwargs)
            except KeyboardInterrupt:
                typer.echo("interrupted", err=True)
                raise typer.Exit(ExitCode.INTERRUPTED) from None

    return command_stopping_on_signals
