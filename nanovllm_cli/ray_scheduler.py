"""The driver's side of `nanovllm run --ray`: engine actors (`ray_engine.EngineActor`) fed tasks, one at a time.

- Slots: each of `replicas` slots holds one actor. Its actor starts (`start`: OUTPUT and the model checked on its
  node, then the engine) and takes a task whenever it has none. The job goes on with the actors that are ready,
  so one slow to start (a node pulling the model, or waiting for resources) idles no one.
- An actor that dies (its process or node gone) or whose `run` fails (its engine died more often than it may be
  restarted) is killed and replaced, at most `max_restarts` times per slot: its task goes back to the head of the
  queue under a new key, unless its manifest was committed before the death (then the task is done). With no
  slot left the job fails (`JobFailed`, exit 3), naming the last death.
- An actor that fails to start (OUTPUT not writable from its node, the model missing there, an engine that
  cannot load) before any has started ends the job at once: a setting is likely wrong, and every other actor
  would fail alike. Once one has started, such a failure is the node's: the actor is replaced as if it died.
- Progress: every PROGRESS_S each busy actor's figures (its part's rows, tokens generated, its engine's deaths and
  restarts, whose notices are passed on).
"""
from __future__ import annotations

import contextlib
import json
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nanovllm_cli.job import JobFailed
from nanovllm_cli.shards import MANIFESTS, ShardFolder, part_key

WAIT_S = 0.25  # longest wait for an actor's answer between two ticks of the display
PROGRESS_S = 1.0  # how often busy actors are asked for their figures
STOP_TIMEOUT_S = 30.0
INNER_RETRIES = ("replica_deaths", "replica_restarts", "rows_rerun", "rows_failed_by_deaths")


@dataclass
class Slot:
    index: int
    actor: object = None
    state: str = "starting"  # starting | ready | retired
    start_ref: object = None
    run_ref: object = None
    progress_ref: object = None
    task: dict | None = None
    restarts: int = 0
    info: dict | None = None  # where its actor runs: node, pid, start_s
    figures: dict = field(default_factory=dict)  # its actor's latest progress
    before: dict = field(default_factory=lambda: dict.fromkeys(("generated_tokens", *INNER_RETRIES), 0))
    events_seen: int = 0
    parts: int = 0
    totals: dict = field(default_factory=lambda: dict.fromkeys(
        ("rows", "prompt_tokens", "cached_tokens", "completion_tokens"), 0))  # of the parts it committed

    def describe(self) -> str:
        where = f"{self.info['node']}, pid {self.info['pid']}" if self.info else "not started"
        return f"engine actor {self.index} ({where})"

    def generated_tokens(self) -> int:
        return self.before["generated_tokens"] + self.figures.get("generated_tokens", 0)

    def inner(self, name: str) -> int:
        """Deaths, restarts, rows rerun or given up by the engines of this slot's actors."""
        return self.before[name] + self.figures.get("retries", {}).get(name, 0)


def describe_task(task: dict) -> str:
    part = task["part"]
    label = "rows" if part["format"] == "parquet" else "lines"
    name = part["source"] or part["url"]
    return f"{name} {label} {part['first']}-{part['first'] + part['count'] - 1}"


def cause(exc: BaseException) -> str:
    """The root error of a Ray failure in one line. Ray raises the actor's error, whose text ends with the
    traceback's last line, "module.ErrorType: message"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    last = lines[-1] if lines else type(exc).__name__
    return re.sub(r"^(?:\w+\.)+(?=\w+: )", "", last)  # "package.module.ModelNotOnNode: ..." -> "ModelNotOnNode: ..."


def actor_death(exc: BaseException) -> str:
    """Why Ray says an actor died, in a few words: the first sentence of its message and the exit type."""
    text = " ".join(str(exc).split())
    kind = re.search(r"Worker exit type: (\w+)", text)
    return text.split(". ")[0].rstrip(".") + (f" ({kind[1]})" if kind else "")


class RayScheduler:
    """`run()` answers `tasks` with `replicas` actors made by `make_actor()`; returns each task's result
    (`EngineActor.run`'s). `on_event(message)`: an actor or an engine died, was restarted or given up;
    `on_tick()`: called between waits (the display)."""

    def __init__(self, make_actor: Callable[[], object], tasks: list[dict], replicas: int, max_restarts: int,
                 folder: ShardFolder, on_event: Callable[[str], None], on_tick: Callable[[], None]):
        self.make_actor = make_actor
        self.queue = deque(tasks)
        self.slots = [Slot(i) for i in range(min(replicas, len(tasks)) or 1)]
        self.max_restarts = max_restarts
        self.folder = folder
        self.on_event = on_event
        self.on_tick = on_tick
        self.results: list[dict] = []
        self.deaths = 0
        self.parts_rerun = 0
        self.rows_rerun = 0
        self.events: list[str] = []
        self.asked = 0.0
        self.started = False  # an actor has started: a later one that cannot start is replaced, not fatal

    def run(self) -> list[dict]:
        import ray

        try:
            for slot in self.slots:
                self._launch(slot)
            while self.queue or any(s.task is not None for s in self.slots):
                self._receive(ray)
                self._assign()
                self._ask_progress(ray)
                self.on_tick()
        finally:
            self._stop(ray)
        return self.results

    # ---- actors -----------------------------------------------------------------------------------------------

    def _launch(self, slot: Slot) -> None:
        slot.actor = self.make_actor()
        slot.state, slot.info, slot.figures, slot.events_seen = "starting", None, {}, 0
        slot.start_ref = slot.actor.start.remote()

    def _assign(self) -> None:
        for slot in self.slots:
            if slot.state == "ready" and slot.task is None and self.queue:
                slot.task = self.queue.popleft()
                slot.run_ref = slot.actor.run.remote(slot.task)

    def _receive(self, ray) -> None:
        waiting = {}
        for slot in self.slots:
            for kind in ("start", "run"):
                ref = getattr(slot, f"{kind}_ref")
                if ref is not None:
                    waiting[ref] = (slot, kind)
        if not waiting:
            time.sleep(WAIT_S)
            return
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=WAIT_S)
        if ready:
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            slot, kind = waiting[ref]
            setattr(slot, f"{kind}_ref", None)
            try:
                value = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._died(slot, f"died: {actor_death(exc)}")
                continue
            except ray.exceptions.RayTaskError as exc:
                if kind == "start" and not self.started:
                    raise JobFailed(f"engine actor {slot.index} could not start: {cause(exc)}") from None
                self._died(slot, f"{'could not start' if kind == 'start' else 'failed'}: {cause(exc)}")
                continue
            if kind == "start":
                slot.state, slot.info = "ready", value
                self.started = True
            else:
                self._done(slot, value)

    def _done(self, slot: Slot, result: dict) -> None:
        run = result["run"]
        self.results.append(result)
        if "figures" in result:
            self._progress(slot, result["figures"])
        slot.task = None
        slot.parts += 1
        slot.totals["rows"] += run["rows_ok"] + run["rows_failed"]
        for name in ("prompt_tokens", "cached_tokens", "completion_tokens"):
            slot.totals[name] += run[name]

    def _died(self, slot: Slot, why: str) -> None:
        """Replace a dead actor; its task goes back to the queue unless its manifest made it."""
        import ray

        what = f"{slot.describe()} {why}"
        self.deaths += 1
        with contextlib.suppress(Exception):
            ray.kill(slot.actor)
        slot.before["generated_tokens"] += slot.figures.get("generated_tokens", 0)
        for name in INNER_RETRIES:
            slot.before[name] += slot.figures.get("retries", {}).get(name, 0)
        slot.figures, slot.run_ref, slot.start_ref, slot.progress_ref = {}, None, None, None
        task, slot.task = slot.task, None
        committed = None if task is None else self._committed(task)
        if task is None:
            fate = "it held no part"
        elif committed is not None:
            fate = f"its part {describe_task(task)} was committed before"
            failed = committed["rows_failed"]
            self._done(slot, {"manifest": committed, "run": {
                "rows_ok": committed["rows"] - failed, "rows_failed": failed,
                **{n: committed[n] for n in ("prompt_tokens", "cached_tokens", "completion_tokens")}}})
        else:
            fate = f"its part {describe_task(task)} goes to the next free actor"
            self.queue.appendleft({**task, "key": part_key(task["part"]["url"], task["part"]["first"])})
            self.parts_rerun += 1
            self.rows_rerun += len(task["numbers"]) if "numbers" in task else task["part"]["count"]
        if slot.restarts < self.max_restarts:
            slot.restarts += 1
            self._launch(slot)
            action = f"restarting it ({slot.restarts} of {self.max_restarts} restarts)"
        else:
            slot.state = "retired"
            action = f"it is not restarted (it died {slot.restarts + 1} times)"
        self._event(f"{what}; {fate}; {action}")
        if all(s.state == "retired" for s in self.slots):
            raise JobFailed(f"every engine actor died; the last: {what}")

    def _committed(self, task: dict) -> dict | None:
        """The task's manifest, when its actor committed it before it died."""
        path = self.folder.path(MANIFESTS, f"part-{task['key']}.json")
        return json.loads(self.folder.fs.cat(path)) if self.folder.fs.exists(path) else None

    def _event(self, message: str) -> None:
        self.events.append(message)
        self.on_event(message)

    def _ask_progress(self, ray) -> None:
        """Collect the figures asked for last time; ask the busy actors again every PROGRESS_S."""
        asked = [s for s in self.slots if s.progress_ref is not None]
        if asked:
            ready, _ = ray.wait([s.progress_ref for s in asked], num_returns=len(asked), timeout=0)
            for slot in asked:
                if slot.progress_ref in ready:
                    with contextlib.suppress(ray.exceptions.RayError):  # a dead actor: its run tells
                        self._progress(slot, ray.get(slot.progress_ref))
                    slot.progress_ref = None
        if time.monotonic() - self.asked >= PROGRESS_S:
            self.asked = time.monotonic()
            for slot in self.slots:
                if slot.state == "ready" and slot.progress_ref is None:
                    slot.progress_ref = slot.actor.progress.remote()

    def _progress(self, slot: Slot, figures: dict) -> None:
        slot.figures = figures
        events = figures.get("retries", {}).get("events", [])
        for message in events[slot.events_seen:]:
            self._event(f"{slot.describe()}: {message}")
        slot.events_seen = len(events)

    def _stop(self, ray) -> None:
        stopping = [s.actor.stop.remote() for s in self.slots if s.state == "ready"]
        with contextlib.suppress(Exception):
            ray.wait(stopping, num_returns=len(stopping), timeout=STOP_TIMEOUT_S)
        for slot in self.slots:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor)

    # ---- figures ----------------------------------------------------------------------------------------------

    def retries(self) -> dict:
        """Actors and engines that died, restarts, rows run again (the parts of dead actors, and the rows of dead
        engines inside actors), rows given up after two engine deaths, and the messages."""
        inner = {name: sum(s.inner(name) for s in self.slots) for name in INNER_RETRIES}
        return {"replica_deaths": self.deaths + inner["replica_deaths"],
                "replica_restarts": sum(s.restarts for s in self.slots) + inner["replica_restarts"],
                "rows_rerun": self.rows_rerun + inner["rows_rerun"],
                "rows_failed_by_deaths": inner["rows_failed_by_deaths"], "parts_rerun": self.parts_rerun,
                "events": list(self.events)}

    def in_hand(self) -> dict:
        """The rows answered in the parts now running (not committed yet), and the tokens generated so far."""
        parts = [s.figures.get("part", {}) for s in self.slots if s.task is not None]
        return {"rows": sum(p.get("rows", 0) for p in parts), "rows_failed": sum(p.get("rows_failed", 0) for p in parts),
                "completion_tokens": sum(p.get("completion_tokens", 0) for p in parts),
                "generated_tokens": sum(s.generated_tokens() for s in self.slots),
                "prefill_tokens": sum(s.figures.get("prefill_tokens", 0) for s in self.slots)}
