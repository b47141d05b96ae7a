"""Data parallelism on one host: N engine replicas as spawned worker processes, fed prefix groups by the parent.

The parent reads, checks and tokenizes the rows and writes every record (`job.BatchRunner`, as with one
engine); a `ReplicaPool` stands in for the engine. Each replica runs the same `job.EngineFeeder` a single
engine runs, fed through a pipe:

- placement (`placement.plan_replicas`): the devices, memory share and environment each replica is born with.
- start: every replica starts at once (replicas sharing GPUs wave by wave), before the parent imports the engine
  (replica_start.py), and loads while the parent loads its tokenizer; a replica's process runs
  replica_worker.py. The job starts as soon as one replica is ready; each other one takes rows when it is ready,
  so a slow start idles no one.
- dispatch: a prefix group (rows sharing their first KV block, `admission.admission_groups`) goes whole to one
  replica, so its prefix cache serves the followers; a group larger than a replica's max_num_seqs is cut into
  chunks of that size (contiguous in token order, so longer shared prefixes stay together). Each group goes to
  the replica with the fewest outstanding tokens (prompt + max_tokens of its rows not yet answered) among those
  with room (fewer than 2 x max_num_seqs rows outstanding), which bounds memory and keeps every engine fed; a
  prefix seen before goes back to the replica that has it cached while that one is at most one group's tokens
  busier than the least busy. With nothing left to dispatch and an engine with room (a replica that just started,
  or the job's tail), the replica with the most rows queued gives half of them back (whole prefix groups none of
  whose rows entered its engine), to be dispatched again.
- failures: a replica isolates the row that fails a step as one engine does (job.EngineFeeder). A replica that
  dies (killed, crashed, out of memory, or an engine that cannot run any more) does not end the job. It tells
  the parent which rows enter its engine before the step that first runs them; when it dies, its rows not yet in
  its engine go back to the queue, and each row that was in its engine becomes a *suspect*. While ordinary rows
  keep the replicas busy, suspects rerun one per replica beside them, so a second death names the row that
  caused it and costs no throughput; once only suspects are left, they rerun in groups spread over the replicas
  (a job's tail must not run them one by one), and the rows of a group that died together go alone next. A row
  alone among the suspects of an engine that died, after an earlier death, gets an error record (a poison row
  kills two or three replicas, not every one). The dead replica is restarted, at most `max_restarts` times;
  the job ends (`ReplicaFailed`) only when no replica is left. A replica reads EOF when the parent goes away and
  exits after its step; replicas ignore SIGINT (the parent stops them).
"""
from __future__ import annotations

import contextlib
import signal
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

from nanovllm import EngineInfo, PromptTokenizer, SamplingParams
from nanovllm_cli.admission import PrefixGroup
from nanovllm_cli.job import Finished, JobFailed, RowFailure
from nanovllm_cli.placement import Placement
from nanovllm_cli.replica_process import DEFAULT_RESTARTS, ReplicaProcess, start_replica_process
from nanovllm_cli.rows import RowRequest

WAIT_S = 0.25  # longest wait for replicas' messages in one `step()` (the display ticks between)
STOP_TIMEOUT_S = 30.0  # for replicas to leave after a stop message
AFFINITY_ENTRIES = 4096  # prefixes whose replica is remembered


class ReplicaFailed(JobFailed):
    """No replica is left (each died more often than it may be restarted), or none could start: the job ends."""


@dataclass
class Replica:
    index: int
    placement: Placement
    process: BaseProcess | None = None
    send_end: Connection | None = None  # parent -> replica
    recv_end: Connection | None = None  # replica -> parent
    state: str = "starting"  # starting | ready | retired (died with no restart left)
    spawned: float = 0.0  # monotonic clock of this incarnation's start
    start_s: float | None = None  # how long its first start took
    info: EngineInfo | None = None
    report: dict | None = None  # the engine's latest report (`LLM.report()`)
    past_reports: list[dict] = field(default_factory=list)  # the last reports of its earlier incarnations
    outstanding: dict[str, int] = field(default_factory=dict)  # request id -> its tokens (prompt + max_tokens)
    outstanding_tokens: int = 0
    in_engine: set[str] = field(default_factory=set)  # outstanding ids the replica reported in its engine
    suspects: set[str] = field(default_factory=set)  # the one group of suspect rows it may hold
    withdrawing: bool = False  # asked to give back queued rows, no answer yet
    restarts: int = 0
    rows: int = 0  # rows answered (or refused) by it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def describe(self, process: BaseProcess | None = None) -> str:
        devices = self.placement.devices
        where = f"GPU{'s' if len(devices) > 1 else ''} {','.join(devices)}" if devices else "CPU"
        return f"replica {self.index} (pid {(process or self.process).pid}, {where})"

    def generated_tokens(self) -> int:
        """Tokens its engines generated, every incarnation's."""
        return sum(r["tokens"]["generated"] for r in [*self.past_reports, self.report] if r is not None)

    def figures(self) -> dict:
        """This replica's share of the job, for the summary and bench's --json."""
        report = self.report or (self.past_reports[-1] if self.past_reports else None)
        return {"index": self.index, "pid": self.process.pid, "state": self.state, "restarts": self.restarts,
                "devices": list(self.placement.devices) if self.placement.devices else None,
                "start_s": self.start_s, "rows": self.rows, "outstanding": len(self.outstanding),
                "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached_tokens, "completion_tokens": self.completion_tokens,
                "generated_tokens": self.generated_tokens(), "engine": report and report["steps"],
                "kv_cache": report and report["kv_cache"]}


def request_tokens(request: RowRequest) -> int:
    """The load a row puts on a replica until it is answered (a pooling row generates nothing)."""
    if not isinstance(request.params, SamplingParams):
        return len(request.token_ids)
    return len(request.token_ids) + request.params.max_tokens * max(request.params.n, request.params.best_of or 1)


def _why_dead(process: BaseProcess) -> str:
    process.join(1.0)
    code = process.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}" + (" (out of memory?)" if -code == signal.SIGKILL else "")
    return f"exited with code {code}"


class ReplicaPool:
    """N replicas behind the `job.Engine` interface; use as a context manager (it stops the replicas).

    `replica_start.spawn_replicas` makes it, the first wave's processes already started; call `await_first`
    before using it. `on_event(message)`: a replica died,
    was restarted or retired."""

    def __init__(self, model: str | None, engine_args: dict, placements: list[Placement], ctx: SpawnContext,
                 started: dict[int, ReplicaProcess], *, max_restarts: int = DEFAULT_RESTARTS,
                 on_event: Callable[[str], None] = lambda message: None):
        self.model = model
        self.engine_args = engine_args
        self.max_restarts = max_restarts
        self.on_event = on_event
        self.prompts: PromptTokenizer | None = None
        self.ctx = ctx
        self.replicas = [Replica(index, p) for index, p in enumerate(placements)]
        self.pending: deque[list[RowRequest]] = deque()  # groups not yet sent to a replica
        self.suspects: deque[RowRequest] = deque()  # rows that were in the engine of a replica that died
        self.strikes: dict[str, list[str]] = {}  # row id -> the deaths it was in an engine for
        self.convicted: list[Finished] = []  # rows alone in an engine at a death, to be answered with errors
        self.requests: dict[str, tuple[RowRequest, Replica]] = {}
        self.affinity: OrderedDict[tuple[int, ...], int] = OrderedDict()  # a prefix's first block -> replica index
        self.failure: ReplicaFailed | None = None  # to raise once the rows finished with it are out
        self.deaths = 0
        self.rows_rerun = 0  # rows of dead replicas sent again
        self.rows_given_up = 0  # rows given error records for the deaths they were in
        self.events: list[str] = []
        self.info: EngineInfo | None = None
        self.block_size = self.chunk = self.room = 0
        self.wave = 0
        for index, process in started.items():  # the first wave, started before this process imported the engine
            self._adopt(self.replicas[index], process)

    # ---- start ------------------------------------------------------------------------------------------------

    def await_first(self) -> None:
        """Load this process's tokenizer (the model resolved, without weights or a device: the parent tokenizes)
        while the replicas start, then wait until one is ready (the job starts with it). A replica that fails
        before any is ready raises ReplicaFailed: the model or an option is wrong, and every replica would fail
        alike."""
        from nanovllm import plan_kv_cache

        self.prompts = plan_kv_cache(self.model, 1, **self.engine_args).prompts
        while self.info is None:
            for replica, process, message in self._receive(self._live(), None):
                if message[0] == "ready":
                    self._joined(replica, message)
                else:
                    raise ReplicaFailed(f"{replica.describe(process)} {self._death_cause(process, message)}")

    def _start_wave(self) -> None:
        """Start the replicas of the current wave (those sharing GPUs with earlier ones wait for them)."""
        for replica in self.replicas:
            if replica.placement.wave == self.wave:
                self._spawn(replica)

    def _spawn(self, replica: Replica) -> None:
        self._adopt(replica, start_replica_process(self.ctx, self.model, self.engine_args, replica.placement,
                                                   replica.index))

    @staticmethod
    def _adopt(replica: Replica, started: ReplicaProcess) -> None:
        replica.process, replica.send_end, replica.recv_end = started.process, started.send_end, started.recv_end
        replica.state, replica.spawned, replica.report = "starting", started.spawned, None

    def _joined(self, replica: Replica, message: tuple) -> None:
        replica.info, replica.report = message[1], message[2]
        replica.state = "ready"
        if replica.start_s is None:
            replica.start_s = time.monotonic() - replica.spawned
        if self.info is None:
            self.info = replica.info
            self.block_size = replica.info.block_size
            self.chunk = replica.info.max_num_seqs
            self.room = 2 * replica.info.max_num_seqs
        waiting = [r for r in self.replicas if r.placement.wave == self.wave and r.state == "starting"]
        if not waiting and any(r.placement.wave > self.wave for r in self.replicas):
            self.wave += 1
            self._start_wave()

    def _wait_all_ready(self) -> None:
        while any(r.state == "starting" for r in self.replicas):
            self._handle(self._receive(self._live(), None))
            if self.failure is not None:
                raise self.failure

    # ---- the Engine interface -------------------------------------------------------------------------------------

    def wants_rows(self) -> bool:
        if self.failure is not None or self.pending:
            return False
        ready = [r for r in self.replicas if r.state == "ready"]
        return not ready or any(len(r.outstanding) < self.room for r in ready)

    def add(self, groups: list[PrefixGroup]) -> None:
        for group in groups:
            rows = list(group.requests)
            self.pending.extend(rows[i:i + self.chunk] for i in range(0, len(rows), self.chunk))
        self._dispatch()

    def idle(self) -> bool:
        return (self.failure is None and not self.pending and not self.suspects and not self.requests
                and not self.convicted)

    def step(self) -> list[Finished]:
        """Dispatch what fits, then the rows finished by any replica (waiting up to WAIT_S for one), and the rows
        given up on after a second death. A failure met after other replicas' rows finished is raised by the
        next call, once those rows are written."""
        if self.failure is not None:
            raise self.failure
        self._dispatch()
        finished = self._handle(self._receive(self._live(), WAIT_S))
        self._dispatch()
        self._rebalance()
        finished += self.convicted
        self.convicted = []
        if self.failure is not None and not finished:
            raise self.failure
        return finished

    # ---- messages -------------------------------------------------------------------------------------------------

    def _live(self) -> list[Replica]:
        return [r for r in self.replicas if r.state in ("starting", "ready")]

    def _receive(self, replicas: list[Replica], timeout: float | None) -> list[tuple[Replica, BaseProcess, tuple]]:
        """The messages waiting from `replicas` (waiting up to `timeout` for the first), each with the process that
        sent it; a replica whose process ended or whose pipe broke gives ("dead",) after its last messages. A
        replica of a later wave has no process yet: nothing to wait on."""
        replicas = [r for r in replicas if r.process is not None]
        by_conn = {r.recv_end: r for r in replicas}
        by_sentinel = {r.process.sentinel: r for r in replicas}
        ready = wait([*by_conn, *by_sentinel], timeout)
        received = []
        for handle in ready:
            replica = by_conn.get(handle)
            if replica is None:
                continue
            while True:
                try:
                    if not replica.recv_end.poll():
                        break
                    received.append((replica, replica.process, replica.recv_end.recv()))
                except (EOFError, OSError):
                    received.append((replica, replica.process, ("dead",)))
                    break
        received += [(by_sentinel[h], by_sentinel[h].process, ("dead",)) for h in ready if h in by_sentinel]
        return received

    def _handle(self, received: list[tuple[Replica, BaseProcess, tuple]]) -> list[Finished]:
        finished: list[Finished] = []
        for replica, process, message in received:
            if replica.process is not process or replica.state == "retired":
                continue  # from an incarnation already handled as dead
            kind = message[0]
            if kind == "finished":
                finished += [self._finish(replica, rid, result) for rid, result in message[1]]
                replica.report = message[2] or replica.report
            elif kind == "admitted":
                replica.in_engine.update(rid for rid in message[1] if rid in replica.outstanding)
            elif kind == "withdrawn":
                self._given_back(replica, message[1])
            elif kind == "ready":
                self._joined(replica, message)
            elif kind == "failed":  # its engine cannot run any more: the rows of the failed step are the suspects
                _, error, _, ids = message
                self._lost(replica, f"its engine failed: {error}", set(ids))
            else:
                self._lost(replica, self._death_cause(process, message))
        return finished

    @staticmethod
    def _death_cause(process: BaseProcess, message: tuple) -> str:
        if message[0] == "error":
            return f"failed: {message[1].strip()}"
        if message[0] == "dead":
            return f"died: {_why_dead(process)}"
        return f"sent {message[0]!r} unasked"

    # ---- failures -------------------------------------------------------------------------------------------------

    def _lost(self, replica: Replica, cause: str, in_engine: set[str] | None = None) -> None:
        """A replica died: its rows go back (those in its engine as suspects, or given up after a second death),
        then it is restarted or retired; no replica left sets `failure`."""
        process = replica.process
        self._reap(replica)
        what = f"{replica.describe(process)} {cause}"
        in_engine = replica.in_engine if in_engine is None else in_engine
        self.deaths += 1
        queued, suspects, given_up = [], 0, 0
        alone = len(replica.suspects & in_engine) == 1  # the one suspect it ran, beside ordinary rows only
        for rid in list(replica.outstanding):
            request, _ = self.requests.pop(rid)
            if rid not in in_engine:
                (self.suspects if rid in self.strikes else queued).append(request)
                continue
            strikes = self.strikes.setdefault(rid, [])
            strikes.append(what)
            if alone and rid in replica.suspects:
                given_up += 1
                del self.strikes[rid]
                self.convicted.append((request, RowFailure(
                    f"{len(strikes)} replicas died with this row in their engine ({'; '.join(strikes)}): the row may "
                    "crash the engine (--retry-failed reruns it)", 500)))
            else:
                suspects += 1
                self.suspects.append(request)
        self.rows_rerun += len(queued) + suspects
        self.rows_given_up += given_up
        self.pending.extendleft(reversed([queued[i:i + self.chunk] for i in range(0, len(queued), self.chunk)]))
        replica.outstanding.clear()
        replica.outstanding_tokens = 0
        replica.in_engine = set()
        replica.suspects = set()
        replica.withdrawing = False
        if replica.report is not None:  # moved, not copied: a retired replica's engine must not count twice
            replica.past_reports.append(replica.report)
            replica.report = None
        if replica.restarts < self.max_restarts:
            replica.restarts += 1
            self._spawn(replica)
            action = f"restarting it ({replica.restarts} of {self.max_restarts} restarts)"
        else:
            replica.state = "retired"
            action = f"it is not restarted (it died {replica.restarts + 1} times)"
        rows = (f"rows run again: {suspects} from its engine (as suspects), {len(queued)} queued"
                + (f"; {given_up} rows in the engine at an earlier death too get error records" if given_up else ""))
        self._event(f"{what}; {rows}; {action}")
        if not self._live():
            self.failure = ReplicaFailed(f"every replica died; the last: {what}" + (
                f"; {len(self.requests) + sum(map(len, self.pending)) + len(self.suspects)} rows have no records yet"))

    def _reap(self, replica: Replica) -> None:
        process = replica.process
        if process.is_alive():
            process.kill()
        process.join()
        for end in (replica.send_end, replica.recv_end):
            with contextlib.suppress(OSError):
                end.close()

    def _event(self, message: str) -> None:
        self.events.append(message)
        self.on_event(message)

    # ---- dispatch -------------------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        ready = [r for r in self.replicas if r.state == "ready"]
        while self.suspects:
            free = [r for r in ready if not r.suspects and len(r.outstanding) < self.room]
            if not free:
                break
            replica = min(free, key=lambda r: r.outstanding_tokens)
            group = self._next_suspects(len(ready))
            replica.suspects = {request.id for request in group}
            self._send(replica, group)
        while self.pending:
            open_ = [r for r in ready if len(r.outstanding) < self.room]
            if not open_:
                return
            group = self.pending.popleft()
            self._send(self._choose(open_, group), group)

    def _next_suspects(self, replicas: int) -> list[RowRequest]:
        """The next group of suspects for one replica: a row that died in a group goes alone, as does every
        suspect while ordinary rows are queued or running (alone, a second death names the row at no cost);
        with nothing else left, the suspects of a single earlier death are spread over the replicas in groups."""
        first = self.suspects.popleft()
        busy = bool(self.pending) or any(len(r.outstanding) > len(r.suspects) for r in self.replicas)
        if busy or len(self.strikes.get(first.id, ())) > 1:
            return [first]
        group, size = [first], -(-(len(self.suspects) + 1) // replicas)
        while self.suspects and len(group) < size and len(self.strikes.get(self.suspects[0].id, ())) <= 1:
            group.append(self.suspects.popleft())
        return group

    def _choose(self, open_: list[Replica], group: list[RowRequest]) -> Replica:
        """The least busy replica, or the one that last ran this prefix if it is at most this group's tokens
        busier (its prefix cache likely still holds it)."""
        least = min(open_, key=lambda r: r.outstanding_tokens)
        first = group[0].token_ids
        if len(first) < self.block_size:
            return least
        key = tuple(first[:self.block_size])
        index = self.affinity.get(key)
        cached = next((r for r in open_ if r.index == index), None)
        choice = least
        if cached is not None and cached.outstanding_tokens <= least.outstanding_tokens + sum(map(request_tokens, group)):
            choice = cached
        self.affinity[key] = choice.index
        self.affinity.move_to_end(key)
        if len(self.affinity) > AFFINITY_ENTRIES:
            self.affinity.popitem(last=False)
        return choice

    def _rebalance(self) -> None:
        """With nothing left to dispatch and a replica whose engine has room (one that just started, or the job's
        tail), ask the replica with the most rows queued (sent, not in its engine) to give half of them back."""
        if self.pending or self.suspects:
            return
        ready = [r for r in self.replicas if r.state == "ready"]
        if not any(len(r.outstanding) < self.chunk for r in ready) or any(r.withdrawing for r in ready):
            return
        donors = [r for r in ready if len(r.outstanding) >= self.chunk and len(r.outstanding) - len(r.in_engine) >= 2]
        if donors:
            donor = max(donors, key=lambda r: len(r.outstanding) - len(r.in_engine))
            donor.withdrawing = True
            with contextlib.suppress(OSError):  # a dead replica: its sentinel tells
                donor.send_end.send(("withdraw", (len(donor.outstanding) - len(donor.in_engine)) // 2))

    def _given_back(self, replica: Replica, groups: list[list[str]]) -> None:
        """Rows a replica gave back (none entered its engine): queued again, first in line."""
        replica.withdrawing = False
        back: list[list[RowRequest]] = []
        for ids in groups:
            group = []
            for rid in ids:
                request, _ = self.requests.pop(rid)
                replica.outstanding_tokens -= replica.outstanding.pop(rid)
                replica.suspects.discard(rid)
                if rid in self.strikes:
                    self.suspects.appendleft(request)
                else:
                    group.append(request)
            if group:
                back.append(group)
        self.pending.extendleft(reversed(back))

    def _send(self, replica: Replica, group: list[RowRequest]) -> None:
        for request in group:
            tokens = request_tokens(request)
            replica.outstanding[request.id] = tokens
            replica.outstanding_tokens += tokens
            self.requests[request.id] = (request, replica)
        with contextlib.suppress(OSError):  # a dead replica: its sentinel tells, and these rows go back then
            replica.send_end.send(("groups", [group]))

    def _finish(self, replica: Replica, request_id: str, result) -> Finished:
        request, _ = self.requests.pop(request_id)
        replica.outstanding_tokens -= replica.outstanding.pop(request_id)
        replica.in_engine.discard(request_id)
        replica.suspects.discard(request_id)
        self.strikes.pop(request_id, None)
        replica.rows += 1
        if not isinstance(result, RowFailure) and not result.error:
            replica.prompt_tokens += result.num_prompt_tokens
            replica.cached_tokens += result.num_cached_tokens
            replica.completion_tokens += len(result.token_ids)
        return request, result

    # ---- figures, calls, stop -------------------------------------------------------------------------------------

    def call(self, fn: Callable, *args) -> list:
        """`fn(llm, *args)` in every replica once all are ready (a module-level function); their results, by
        replica. A replica that dies meanwhile raises ReplicaFailed."""
        self._wait_all_ready()
        live = self._live()
        for replica in live:
            replica.send_end.send(("call", fn, args))
        results: dict[int, object] = {}
        while len(results) < len(live):
            for replica, process, message in self._receive(live, None):
                if message[0] == "result":
                    results[replica.index] = message[1]
                elif message[0] == "finished":
                    replica.report = message[2] or replica.report
                elif message[0] != "admitted":
                    raise ReplicaFailed(f"{replica.describe(process)} {self._death_cause(process, message)}")
        return [results[r.index] for r in live]

    def retries(self) -> dict:
        """What the job went through: replicas that died and were restarted, rows run again, rows given up on."""
        return {"replica_deaths": self.deaths, "replica_restarts": sum(r.restarts for r in self.replicas),
                "rows_rerun": self.rows_rerun, "rows_failed_by_deaths": self.rows_given_up,
                "events": list(self.events)}

    def report(self) -> dict:
        """The replicas' engine reports merged (`merge_reports`; a restarted replica's earlier incarnations
        included), with "replicas": each one's figures, and "retries"."""
        reports = [r for replica in self.replicas for r in [*replica.past_reports, replica.report] if r is not None]
        return {**merge_reports(reports),
                "replicas": [r.figures() for r in self.replicas if r.process is not None],
                "retries": self.retries()}

    def close(self) -> None:
        """Stop every replica (a last report comes back from each that is alive) and reap them."""
        live = [r for r in self.replicas if r.process is not None and r.state != "retired"]
        for replica in live:
            with contextlib.suppress(OSError):
                replica.send_end.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for replica in live:
            with contextlib.suppress(EOFError, OSError):
                while replica.recv_end.poll(max(deadline - time.monotonic(), 0)):
                    message = replica.recv_end.recv()
                    if message[0] == "report":
                        replica.report = message[1]
                        break
            replica.process.join(max(deadline - time.monotonic(), 0.1))
            self._reap(replica)

    exit = close  # the name `LLM` gives it

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def merge_reports(reports: list[dict]) -> dict:
    """The replicas' engine reports (`LLM.report()`) as one of the same shape: counts, host seconds and token
    counters summed, throughputs summed (the replicas run side by side), the wall clock the longest, KV usage
    averaged, the prefix hit rate over all lookups; percentiles and shares, which do not add up, are None (each
    replica's own are in its figures)."""
    steps = [r["steps"] for r in reports]
    merged_steps = dict.fromkeys(steps[0])
    merged_steps.update(device=steps[0]["device"], loop=steps[0]["loop"], overlap=steps[0]["overlap"],
                        wall_s=max(s["wall_s"] for s in steps))
    for key in ("requests", "prompt_tokens", "output_tokens", "steps", "decode_steps", "preemptions",
                "cpu_schedule_s", "cpu_prepare_s", "cpu_execute_s", "cpu_wait_s", "cpu_postprocess_s", "gpu_busy_s",
                "output_tok_s", "total_tok_s", "prefill_tok_s"):
        values = [s[key] for s in steps]
        merged_steps[key] = None if any(v is None for v in values) else sum(values)
    caches = [r["kv_cache"] for r in reports]
    prefix = {key: sum(c["prefix_cache"][key] for c in caches) for key in caches[0]["prefix_cache"]}
    prefix["hit_rate"] = prefix["hit_tokens"] / prefix["queried_tokens"] if prefix["queried_tokens"] else 0.0
    kv_cache = {"num_kv_blocks": sum(c["num_kv_blocks"] for c in caches), "block_size": caches[0]["block_size"],
                "kv_cache_usage": sum(c["kv_cache_usage"] for c in caches) / len(caches),
                "num_preemptions": sum(c["num_preemptions"] for c in caches), "prefix_cache": prefix}
    tokens = {key: sum(r["tokens"][key] for r in reports) for key in reports[0]["tokens"]}
    return {"steps": merged_steps, "kv_cache": kv_cache, "tokens": tokens}
