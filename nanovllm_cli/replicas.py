"""Data parallelism on one host: N engine replicas as spawned worker processes, fed prefix groups by the parent.

The parent reads, checks and tokenizes the rows and writes every record (`job.BatchRunner`, as with one
engine); a `ReplicaPool` stands in for the engine. Each replica runs the same `job.EngineFeeder` a single
engine runs, fed through a pipe:

- placement (`placement.plan_replicas`): the devices, memory share and environment each replica is born with;
  replicas sharing GPUs start one after another.
- dispatch: a prefix group (rows sharing their first KV block, `admission.admission_groups`) goes whole to one
  replica, so its prefix cache serves the followers; a group larger than a replica's max_num_seqs is cut into
  chunks of that size (contiguous in token order, so longer shared prefixes stay together). Each group goes to
  the replica with the fewest outstanding tokens (prompt + max_tokens of its rows not yet answered) among those
  with room (fewer than 2 x max_num_seqs rows outstanding), which bounds memory and keeps every engine fed.
- failures: a replica isolates the row that fails a step as one engine does (job.EngineFeeder); a replica
  whose engine cannot run any more reports the rows in it and those waiting to be rerun (error records); a
  replica that dies (killed, crashed, out of memory) ends the job with `ReplicaFailed` naming it (index, pid,
  devices) and its error. Either way the other replicas are stopped and what is written stays (`--resume`).
  A replica reads EOF when the parent goes away and exits after its step; replicas ignore SIGINT (the parent
  stops them).
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from nanovllm import EngineInfo, PromptTokenizer, SamplingParams
from nanovllm_cli import options as o
from nanovllm_cli.admission import PrefixGroup
from nanovllm_cli.job import EngineFailure, EngineFeeder, Finished, JobFailed, RowFailure
from nanovllm_cli.options import EngineOptions
from nanovllm_cli.placement import Placement, PlacementError, born_with, plan_replicas, visible_gpus
from nanovllm_cli.rows import RowRequest

REPORT_INTERVAL_S = 0.5  # how often a replica sends its engine report (progress figures)
WAIT_S = 0.25  # longest wait for replicas' messages in one `step()` (the display ticks between)
STOP_TIMEOUT_S = 30.0  # for replicas to leave after a stop message


class ReplicaFailed(JobFailed):
    """A replica died or failed: the job ends (exit 3)."""


# ---- the replica process ------------------------------------------------------------------------------------------

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
    finished rows and, every REPORT_INTERVAL_S, the engine's report; a function the parent sends is called with
    the engine and its result sent back. Ends on a stop message (sending a last report) or on EOF."""
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
        feeder = EngineFeeder(llm)
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
        except Exception:  # noqa: BLE001 (reported as this replica's error; the parent ends the job)
            with contextlib.suppress(OSError):
                conn_out.send(("error", traceback.format_exc()))


def _get_nowait(inbox: queue.Queue) -> tuple | None:
    try:
        return inbox.get_nowait()
    except queue.Empty:
        return None


# ---- the parent's side --------------------------------------------------------------------------------------------

@dataclass
class Replica:
    index: int
    placement: Placement
    process: BaseProcess
    send_end: Connection  # parent -> replica
    recv_end: Connection  # replica -> parent
    info: EngineInfo | None = None
    report: dict | None = None  # the engine's latest report (`LLM.report()`)
    outstanding: dict[str, int] = field(default_factory=dict)  # request id -> its tokens (prompt + max_tokens)
    outstanding_tokens: int = 0
    rows: int = 0  # rows answered (or refused) by it
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def describe(self) -> str:
        devices = self.placement.devices
        where = f"GPU{'s' if len(devices) > 1 else ''} {','.join(devices)}" if devices else "CPU"
        return f"replica {self.index} (pid {self.process.pid}, {where})"

    def figures(self) -> dict:
        """This replica's share of the job, for the summary and bench's --json."""
        return {"index": self.index, "pid": self.process.pid,
                "devices": list(self.placement.devices) if self.placement.devices else None,
                "rows": self.rows, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "completion_tokens": self.completion_tokens, "generated_tokens": self.report["tokens"]["generated"],
                "engine": self.report["steps"], "kv_cache": self.report["kv_cache"]}


def request_tokens(request: RowRequest) -> int:
    """The load a row puts on a replica until it is answered (a pooling row generates nothing)."""
    if not isinstance(request.params, SamplingParams):
        return len(request.token_ids)
    return len(request.token_ids) + request.params.max_tokens * max(request.params.n, request.params.best_of or 1)


class ReplicaPool:
    """N replicas behind the `job.Engine` interface; use as a context manager (it stops the replicas)."""

    def __init__(self, model: str | None, engine_args: dict, prompts: PromptTokenizer, placements: list[Placement]):
        self.prompts = prompts
        self.replicas: list[Replica] = []
        self.pending: deque[list[RowRequest]] = deque()  # groups not yet sent to a replica
        self.requests: dict[str, tuple[RowRequest, Replica]] = {}
        self.failure: EngineFailure | ReplicaFailed | None = None  # to raise once the rows finished with it are out
        ctx = mp.get_context("spawn")
        try:
            for wave in range(max(p.wave for p in placements) + 1):
                started = [self._start(ctx, index, p, model, engine_args)
                           for index, p in enumerate(placements) if p.wave == wave]
                self._wait_ready(started)
        except BaseException:
            self.close()
            raise
        info = self.replicas[0].info
        self.info = info
        self.block_size = info.block_size
        self.chunk = info.max_num_seqs
        self.room = 2 * info.max_num_seqs

    def _start(self, ctx, index: int, placement: Placement, model: str | None, engine_args: dict) -> Replica:
        args = dict(engine_args)
        if placement.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = placement.gpu_memory_utilization
        to_child, from_parent = ctx.Pipe(duplex=False)
        to_parent, from_child = ctx.Pipe(duplex=False)
        process = ctx.Process(target=replica_main, args=(model, args, to_child, from_child),
                              name=f"nanovllm-replica-{index}")
        with born_with(placement):
            process.start()
        to_child.close()
        from_child.close()
        replica = Replica(index, placement, process, from_parent, to_parent)
        self.replicas.append(replica)
        return replica

    def _wait_ready(self, replicas: list[Replica]) -> None:
        waiting = list(replicas)
        while waiting:
            for replica, message in self._messages(waiting, None):
                if message[0] != "ready":
                    raise ReplicaFailed(f"{replica.describe()} sent {message[0]!r} while starting")
                replica.info, replica.report = message[1], message[2]
                waiting.remove(replica)

    # ---- the Engine interface -------------------------------------------------------------------------------------

    def wants_rows(self) -> bool:
        return self.failure is None and not self.pending and any(len(r.outstanding) < self.room for r in self.replicas)

    def add(self, groups: list[PrefixGroup]) -> None:
        for group in groups:
            rows = list(group.requests)
            self.pending.extend(rows[i:i + self.chunk] for i in range(0, len(rows), self.chunk))
        self._dispatch()

    def idle(self) -> bool:
        return self.failure is None and not self.pending and not self.requests

    def step(self) -> list[Finished]:
        """Dispatch what fits, then the rows finished by any replica (waiting up to WAIT_S for one). A failure
        met after other replicas' rows finished is raised by the next call, once those rows are written."""
        if self.failure is not None:
            raise self.failure
        self._dispatch()
        finished: list[Finished] = []
        try:
            for replica, message in self._messages(self.replicas, WAIT_S):
                kind = message[0]
                if kind == "finished":
                    finished += [self._finish(replica, rid, result) for rid, result in message[1]]
                    replica.report = message[2] or replica.report
                elif kind == "failed":
                    _, error, problem, ids = message
                    failed = [self._finish(replica, rid, RowFailure(problem, 500))[0] for rid in ids]
                    raise EngineFailure(f"{replica.describe()}: {error}", problem, failed)
                else:
                    raise ReplicaFailed(f"{replica.describe()} sent {kind!r} mid-job")
        except (EngineFailure, ReplicaFailed) as failure:
            if not finished:
                raise
            self.failure = failure
        return finished

    # ---- helpers --------------------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while self.pending:
            open_ = [r for r in self.replicas if len(r.outstanding) < self.room]
            if not open_:
                return
            replica = min(open_, key=lambda r: r.outstanding_tokens)
            group = self.pending.popleft()
            for request in group:
                tokens = request_tokens(request)
                replica.outstanding[request.id] = tokens
                replica.outstanding_tokens += tokens
                self.requests[request.id] = (request, replica)
            try:
                replica.send_end.send(("groups", [group]))
            except OSError:
                self._raise_dead(replica)

    def _finish(self, replica: Replica, request_id: str, result) -> Finished:
        request, _ = self.requests.pop(request_id)
        replica.outstanding_tokens -= replica.outstanding.pop(request_id)
        replica.rows += 1
        if not isinstance(result, RowFailure) and not result.error:
            replica.prompt_tokens += result.num_prompt_tokens
            replica.cached_tokens += result.num_cached_tokens
            replica.completion_tokens += len(result.token_ids)
        return request, result

    def _messages(self, replicas: list[Replica], timeout: float | None) -> Iterator[tuple[Replica, tuple]]:
        """The messages waiting from `replicas` (waiting up to `timeout` for the first); a replica that died
        raises ReplicaFailed (after its last messages: its own error, when it sent one)."""
        by_conn = {r.recv_end: r for r in replicas}
        by_sentinel = {r.process.sentinel: r for r in replicas}
        ready = wait([*by_conn, *by_sentinel], timeout)
        for handle in ready:
            replica = by_conn.get(handle)
            if replica is None:
                continue
            while replica.recv_end.poll():
                try:
                    message = replica.recv_end.recv()
                except (EOFError, OSError):
                    break
                if message[0] == "error":
                    raise ReplicaFailed(f"{replica.describe()} failed: {message[1].strip()}")
                yield replica, message
        for handle in ready:
            replica = by_sentinel.get(handle)
            if replica is not None:
                self._raise_dead(replica)

    def _raise_dead(self, replica: Replica) -> None:
        replica.process.join(1.0)
        code = replica.process.exitcode
        if code is not None and code < 0:
            why = f"killed by {signal.Signals(-code).name}" + (
                " (out of memory?)" if -code == signal.SIGKILL else "")
        else:
            why = f"exited with code {code}"
        lost = len(replica.outstanding)
        raise ReplicaFailed(f"{replica.describe()} died: {why}" + (
            f"; its {lost} unanswered rows have no records yet" if lost else ""))

    def call(self, fn: Callable, *args) -> list:
        """`fn(llm, *args)` in every replica (a module-level function); their results, by replica."""
        for replica in self.replicas:
            replica.send_end.send(("call", fn, args))
        results: dict[int, object] = {}
        while len(results) < len(self.replicas):
            for replica, message in self._messages(self.replicas, None):
                if message[0] == "result":
                    results[replica.index] = message[1]
                elif message[0] == "finished":
                    replica.report = message[2] or replica.report
        return [results[r.index] for r in self.replicas]

    def report(self) -> dict:
        """The replicas' latest engine reports merged (`merge_reports`), with "replicas": each one's figures."""
        return {**merge_reports([r.report for r in self.replicas]), "replicas": [r.figures() for r in self.replicas]}

    def close(self) -> None:
        """Stop every replica (a last report comes back from each that is alive) and reap them."""
        for replica in self.replicas:
            with contextlib.suppress(OSError):
                replica.send_end.send(("stop",))
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for replica in self.replicas:
            with contextlib.suppress(EOFError, OSError):
                while replica.recv_end.poll(max(deadline - time.monotonic(), 0)):
                    message = replica.recv_end.recv()
                    if message[0] == "report":
                        replica.report = message[1]
                        break
            replica.process.join(max(deadline - time.monotonic(), 0.1))
            if replica.process.is_alive():
                replica.process.kill()
                replica.process.join()
            replica.send_end.close()
            replica.recv_end.close()

    exit = close  # the name `LLM` gives it

    def __enter__(self) -> ReplicaPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_replicas(engine: EngineOptions, seed: int | None = None) -> ReplicaPool:
    """`engine.data_parallel_size` replicas of the engine these options describe, placed on the visible devices;
    a clean usage error (exit 2, nothing run) when the options, the model or the placement do not work."""
    import torch

    from nanovllm import plan_kv_cache

    try:
        args = engine.args(seed)
        # The model resolved and its tokenizer loaded here, without weights or a device: the parent tokenizes.
        prompts = plan_kv_cache(engine.model, 1, **args).prompts
        on_gpu = args.get("device", "cuda" if torch.cuda.is_available() else "cpu") != "cpu"
        placements = plan_replicas(engine.data_parallel_size, args.get("tensor_parallel_size", 1), on_gpu,
                                   visible_gpus() if on_gpu else [], args.get("gpu_memory_utilization"))
    except PlacementError as exc:
        raise o.fail(str(exc)) from None
    except (ValueError, OSError, ImportError, RuntimeError, KeyError) as exc:
        raise o.fail(f"cannot load the model: {exc}") from None
    o.use_chat_template(engine, prompts)
    try:
        return ReplicaPool(engine.model, args, prompts, placements)
    except ReplicaFailed as exc:
        raise o.fail(f"cannot start the replicas: {exc}") from None


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
