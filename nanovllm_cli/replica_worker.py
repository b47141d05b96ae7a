"""A data-parallel replica's process (the child side of replicas.py): load the engine, then feed it the prefix
groups the parent sends, and send back what the parent needs to dispatch, count and answer the rows."""
from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection

from nanovllm_cli.admission import PrefixGroup
from nanovllm_cli.job import EngineFailure, EngineFeeder

REPORT_INTERVAL_S = 0.5  # how often a replica sends its engine report (progress figures)


def _read_inbox(conn: Connection, inbox: queue.Queue) -> None:
    """The pipe from the parent, drained into `inbox` by a thread, so the parent's sends never wait on a step.
    EOF (the parent is gone) reads as a stop."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            message = ("stop",)
        inbox.put(message)
        if message[0] == "stop":
            return


def replica_main(model: str | None, engine_args: dict, conn_in: Connection, conn_out: Connection) -> None:
    """A replica: load the engine, report its info, then feed it the groups the parent sends, sending back the
    ids that enter the engine (before the step that first runs them), the finished rows and, every
    REPORT_INTERVAL_S, the engine's report; a function the parent sends is called with the engine and its
    result sent back. Ends on a stop message (sending a last report) or on EOF."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent handles it
    from nanovllm import LLM

    try:
        llm = LLM(model, **engine_args)
    except Exception as exc:  # noqa: BLE001 (the parent reports it as this replica's)
        conn_out.send(("error", f"cannot load the model: {type(exc).__name__}: {exc}"))
        return
    inbox: queue.Queue = queue.Queue()
    threading.Thread(target=_read_inbox, args=(conn_in, inbox), daemon=True).start()
    with llm:
        feeder = EngineFeeder(llm, on_admit=lambda ids: conn_out.send(("admitted", ids)))
        conn_out.send(("ready", llm.info, llm.report()))
        reported = time.monotonic()
        try:
            while True:
                message = inbox.get() if feeder.idle() else _get_nowait(inbox)
                while message is not None:
                    if message[0] == "stop":
                        conn_out.send(("report", llm.report()))
                        return
                    if message[0] == "groups":
                        feeder.add([PrefixGroup(deque(group)) for group in message[1]])
                    elif message[0] == "withdraw":
                        conn_out.send(("withdrawn", [[r.id for r in g] for g in feeder.withdraw(message[1])]))
                    elif message[0] == "call":
                        conn_out.send(("result", message[1](llm, *message[2])))
                    message = _get_nowait(inbox)
                if feeder.idle():
                    continue
                try:
                    finished = feeder.step()
                except EngineFailure as failure:
                    conn_out.send(("failed", str(failure), failure.problem, [r.id for r in failure.requests]))
                    return
                report = None
                if time.monotonic() - reported >= REPORT_INTERVAL_S or feeder.idle():
                    report, reported = llm.report(), time.monotonic()
                if finished or report is not None:
                    conn_out.send(("finished", [(r.id, result) for r, result in finished], report))
        except (BrokenPipeError, EOFError):
            return  # the parent is gone
        except Exception:  # noqa: BLE001 (reported as this replica's error; the parent restarts it)
            with contextlib.suppress(OSError):
                conn_out.send(("error", traceback.format_exc()))


def _get_nowait(inbox: queue.Queue) -> tuple | None:
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


# ---- the parent's side --------------------------------------------------------------------------------------------
