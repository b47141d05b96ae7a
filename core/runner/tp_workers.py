"""Tensor parallelism over processes (docs/ARCHITECTURE.md).

Rank 0 is the calling process: it owns the scheduler, the tokenizer and the outputs. Ranks 1..N-1 are spawned
worker processes that build the same model on their shard, then execute every step rank 0 launches:

- rank 0 writes a small header per step into each worker's pipe and broadcasts the step's tensors as one byte
  payload over the group (tp_step.py); the workers rebuild the StepInputs and call the same
  `ModelRunner.execute` rank 0 calls, so whatever path rank 0 takes (eager or CUDA graph) the workers take too.
  Only rank 0 gets logits (gathered to it) and samples.
- the pipe is also the life line: a worker reports its traceback through it before it exits, and reads EOF when
  rank 0 goes away; a watchdog thread in each worker exits as soon as rank 0's process dies, so no worker outlives
  it. Rank 0 watches the workers' process sentinels before each step and while it waits for one, and a watchdog
  thread watches them while rank 0 builds the model (`build_guard`), so a dead worker is noticed within milliseconds
  even when a collective would wait for it until it times out.
- any failure or interrupt during a step stops every worker and the engine; `LLM.exit()`, the context manager
  and an atexit hook stop the workers in an orderly way.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from nanovllm.config import EngineConfig
from nanovllm.distributed import (
    COLLECTIVE_TIMEOUT,
    abort_collectives,
    broadcast_from_rank0,
    destroy_tp_group,
    init_tp_group,
    tp_size,
)
from nanovllm.loaders import ResolvedModel
from nanovllm.models.registry import model_class_for
from nanovllm.pooling import PoolingSpec
from nanovllm.runner.inputs import LaunchedForward, StepInputs
from nanovllm.runner.model_runner import ModelRunner
from nanovllm.runner.spawn_guard import check_main_guard
from nanovllm.runner.tp_step import pack, unpack
from nanovllm.step_types import ScheduledBatch, StepHandle

if TYPE_CHECKING:
    from nanovllm.structured import StepMask

_HOST = "127.0.0.1"
_STOP, _STEP, _LORA_LOADS = 0, 1, 2  # first word of a message from rank 0
_STARTUP_TIMEOUT_S = 600.0  # a worker that has not connected by then (stuck importing, say) fails the start
_GRACE_S = 2.0  # after a collective fails, how long rank 0 waits for the worker that caused it to report
_JOIN_TIMEOUT_S = 10.0  # for workers to leave after a stop message


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker died or raised; every worker is stopped and the engine cannot run further steps."""


def check_tp_split(hf_config, world: int, device: torch.device, model_kind: str = "generate") -> None:
    """Refuse, before any process starts, a size that cannot split the model or does not fit the machine.

    Attention heads, KV heads and the MLP are split evenly; the vocabulary need not be (its last shard is padded)."""
    dims = model_class_for(hf_config, model_kind).tensor_parallel_dims(hf_config)
    bad = [f"{name}={value}" for name, value in dims.items() if value % world]
    if bad:
        common = math.gcd(*dims.values())
        sizes = ", ".join(str(n) for n in range(1, common + 1) if common % n == 0)
        raise ValueError(f"engine argument tensor_parallel_size={world} does not divide the model's "
                         f"{', '.join(bad)}; sizes that split it: {sizes}")
    if device.type == "cuda" and torch.cuda.device_count() < world:
        raise ValueError(f"engine argument tensor_parallel_size={world} needs {world} CUDA devices (one per rank); "
                         f"{torch.cuda.device_count()} visible")


def start_workers(config: EngineConfig, resolved: ResolvedModel, max_model_len: int,
                  pooling: PoolingSpec | None = None) -> TPWorkers | None:
    """Ranks 1..N-1 of a tensor-parallel engine, joined into one group with this process as rank 0; None when N=1.
    `pooling`: the model's pooling spec (a pooling model), as rank 0's runner has it."""
    if tp_size() > 1:
        raise RuntimeError("a tensor-parallel engine is running in this process: exit() it before starting another")
    if config.tensor_parallel_size == 1:
        return None
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialised in this process; a tensor-parallel engine "
                           "makes its own process group")
    check_tp_split(resolved.hf_config, config.tensor_parallel_size, config.resolve_device(),
                   pooling.model_kind if pooling else "generate")
    check_main_guard()
    return TPWorkers(config, resolved, max_model_len, pooling)


@dataclass
class _Worker:
    rank: int
    process: BaseProcess
    conn: Connection  # rank 0's end of the pipe: step headers out; "ready" or the worker's traceback in
    ready: bool = False
    error: str | None = None


class TPWorkers:
    """Rank 0's handle on the worker processes: start, send steps, watch, stop."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel, max_model_len: int,
                 pooling: PoolingSpec | None = None):
        world = config.tensor_parallel_size
        device = config.resolve_device()
        # The workers need the config's values, not transformers, whose import would double a worker's start
        # (num_labels, which a classifier's head reads, is a property that to_dict leaves out).
        hf_config = resolved.hf_config
        resolved = dataclasses.replace(resolved, hf_config=SimpleNamespace(
            **hf_config.to_dict(), num_labels=getattr(hf_config, "num_labels", None)))
        context = mp.get_context("spawn")
        self.ranks: list[_Worker] = []
        self.closed = False
        self.failure: str | None = None
        self.threads_before = torch.get_num_threads()
        atexit.register(self.shutdown)
        with self.guard():
            if device.type == "cpu":
                torch.set_num_threads(_cpu_threads_per_rank(world))
            store = dist.TCPStore(_HOST, 0, world, is_master=True, wait_for_workers=False,
                                  timeout=COLLECTIVE_TIMEOUT)
            for rank in range(1, world):
                ours, theirs = context.Pipe()
                process = context.Process(target=_worker_main, name=f"nanovllm-tp-rank{rank}", daemon=True,
                                          args=(rank, store.port, config, resolved, max_model_len, pooling,
                                                theirs))
                process.start()
                theirs.close()
                self.ranks.append(_Worker(rank, process, ours))
            self._await_ready()
            init_tp_group(0, world, store, device)

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.ranks]

    # ---- steps -------------------------------------------------------------------------------------------------

    def send_step(self, inputs: StepInputs) -> None:
        """Hand one step to every worker: its header through the pipes, its tensors by one broadcast."""
        self.check()
        header, payload = pack(inputs)
        message = array("q", [_STEP, payload.numel(), *header]).tobytes()
        for w in self.ranks:
            w.conn.send_bytes(message)
        broadcast_from_rank0(payload)

    def send_lora_loads(self, loads: list) -> None:
        """Have every worker write LoRA adapters into their slots before the next step it runs: (slot,
        LoRARequest) pairs, each worker reading its shard from the adapter's files (ModelRunner.load_adapters)."""
        self.check()
        message = array("q", [_LORA_LOADS]).tobytes() + pickle.dumps(loads)
        for w in self.ranks:
            w.conn.send_bytes(message)

    def wait_for(self, event: torch.cuda.Event) -> None:
        """Block until `event` (a step's end on the device) completes, watching the workers meanwhile: a dead
        worker leaves the step's collectives waiting for it."""
        while not event.query():
            self.check()
            time.sleep(0)

    # ---- failures ----------------------------------------------------------------------------------------------

    def check(self) -> None:
        """Raise TPWorkerError if a worker died or reported an error."""
        if wait(self._watched, timeout=0):
            self.failure = self._failures(_GRACE_S)
            if self.failure:
                raise TPWorkerError(self.failure)

    @property
    def _watched(self) -> list:
        """What becomes readable when a worker reports or dies: its pipe and its process sentinel."""
        return [w.conn for w in self.ranks] + [w.process.sentinel for w in self.ranks]

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Around rank 0's part of work all ranks share: if it fails or is interrupted, stop every worker, and
        raise the workers' own error when one of them caused it."""
        if self.closed:
            raise TPWorkerError(f"the tensor-parallel engine is stopped: {self.failure or 'LLM.exit() was called'}")
        try:
            yield
        except BaseException as exc:
            reported = isinstance(exc, TPWorkerError)
            if not reported:
                # A collective or a pipe that broke may be a worker's doing: give it a moment to report.
                broken = isinstance(exc, (RuntimeError, OSError, EOFError))
                self.failure = self._failures(_GRACE_S if broken else 0.0)
            self.shutdown(abort=True)
            if reported:
                raise
            if self.failure:
                raise TPWorkerError(self.failure) from exc
            self.failure = f"rank 0 raised {type(exc).__name__}: {exc}"
            raise

    @contextlib.contextmanager
    def build_guard(self) -> Iterator[None]:
        """`guard` around the model's build, which waits in collectives that a step's own waits do not watch: a
        watchdog thread also aborts the group's collectives when a worker fails meanwhile, and the failure is
        raised once rank 0 gets through. Steps do without it: a thread started and joined per step would cost up
        to its poll interval each time."""
        with self.guard():
            if tp_size() <= 1:  # not in the group: no collective to wait in
                yield
            else:
                with self._watchdog():
                    yield

    @contextlib.contextmanager
    def _watchdog(self) -> Iterator[None]:
        failed, done = threading.Event(), threading.Event()
        watchdog = threading.Thread(target=self._abort_on_failure, args=(failed, done), name="nanovllm-tp-watchdog",
                                    daemon=True)
        watchdog.start()
        try:
            yield
        finally:
            done.set()
            watchdog.join()
        if failed.is_set():  # rank 0 got through, on collectives the abort cut short
            raise TPWorkerError(self._failures(_GRACE_S) or "a tensor-parallel worker failed")

    def _abort_on_failure(self, failed: threading.Event, done: threading.Event) -> None:
        """While rank 0 works in `build_guard` (the model's build: weights, memory profile, graph capture, all with
        collectives), cancel the group's collectives as soon as a worker reports an error or dies: rank 0 would
        otherwise wait in one for the collective timeout, with the worker's traceback unread in its pipe."""
        while not done.is_set():
            if wait(self._watched, timeout=0.1):
                failed.set()
                abort_collectives()
                return

    def _failures(self, wait_s: float) -> str | None:
        """What went wrong with the workers, waiting up to `wait_s` for a first failure; the dead ones first."""
        deadline = time.monotonic() + wait_s
        while True:
            died, raised = [], []
            for w in self.ranks:
                self._read(w)
                if w.error is not None:
                    raised.append(f"rank {w.rank} (pid {w.process.pid}) raised:\n{w.error.rstrip()}")
                elif not w.process.is_alive():
                    died.append(f"rank {w.rank} (pid {w.process.pid}) died: {_exit_reason(w.process.exitcode)}")
            remaining = deadline - time.monotonic()
            if died or raised or remaining <= 0:
                break
            wait(self._watched, timeout=remaining)
        if not (died or raised):
            return None
        return "tensor-parallel worker failure, the engine is stopped:\n" + "\n".join(died + raised)

    @staticmethod
    def _read(w: _Worker) -> None:
        with contextlib.suppress(EOFError, OSError):  # EOF: the worker is gone; OSError: we closed the pipe
            while w.conn.poll():
                kind, text = w.conn.recv()
                if kind == "ready":
                    w.ready = True
                else:
                    w.error = text

    def _await_ready(self) -> None:
        """Until every worker is about to join the group; an import or device error surfaces here, with its text."""
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not all(w.ready for w in self.ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                late = [str(w.rank) for w in self.ranks if not w.ready]
                raise TPWorkerError(f"tensor-parallel rank(s) {', '.join(late)} did not start within "
                                    f"{_STARTUP_TIMEOUT_S:.0f} s")
            wait(self._watched, timeout=remaining)
            for w in self.ranks:
                self._read(w)
            self.check()

    # ---- life cycle --------------------------------------------------------------------------------------------

    def shutdown(self, abort: bool = False) -> None:
        """Stop every worker and leave the group (idempotent). `abort`: after a failure, kill instead of asking."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self.shutdown)
        if not abort:
            for w in self.ranks:
                with contextlib.suppress(OSError):
                    w.conn.send_bytes(array("q", [_STOP]).tobytes())
            destroy_tp_group()
        deadline = time.monotonic() + (0.0 if abort else _JOIN_TIMEOUT_S)
        for w in self.ranks:
            w.process.join(max(deadline - time.monotonic(), 0.0))
            if w.process.is_alive():
                w.process.kill()
                w.process.join()
            w.conn.close()
        if abort:
            destroy_tp_group(abort=True)
        torch.set_num_threads(self.threads_before)


class TPRunner:
    """Rank 0's runner under tensor parallelism, for the step loop: every step it launches is also sent to the
    workers, and every wait for one watches them."""

    def __init__(self, runner: ModelRunner, workers: TPWorkers):
        self.runner = runner
        self.workers = workers

    def prepare(self, batch: ScheduledBatch) -> StepInputs:
        with self.workers.guard():  # a stopped engine's sequences may wait on steps that never ran
            if batch.lora_loads:
                self.workers.send_lora_loads(batch.lora_loads)
            return self.runner.prepare(batch)

    def execute(self, inputs: StepInputs) -> StepHandle:
        with self.workers.guard():
            self.workers.send_step(inputs)
            return self.runner.execute(inputs)

    def launch_forward(self, inputs: StepInputs) -> LaunchedForward:
        with self.workers.guard():  # the workers run the whole step; only rank 0 samples
            self.workers.send_step(inputs)
            return self.runner.launch_forward(inputs)

    def launch_sample(self, launched: LaunchedForward, step_mask: StepMask | None) -> StepHandle:
        return self.runner.launch_sample(launched, step_mask)

    def wait(self, handle: StepHandle) -> tuple[list[int], float | None]:
        with self.workers.guard():
            if handle.ready is not None:
                self.workers.wait_for(handle.ready)
            return self.runner.wait(handle)


def _cpu_threads_per_rank(world: int) -> int:
    """On the CPU the ranks share the cores: more threads than cores spin against each other at every collective
    (several times slower)."""
    return max(1, len(os.sched_getaffinity(0)) // world)


def _exit_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        return f"killed by {signal.Signals(-exitcode).name}"
    return f"exit code {exitcode}"


# ---- the worker process ----------------------------------------------------------------------------------------

def _worker_main(rank: int, port: int, config: EngineConfig, resolved: ResolvedModel, max_model_len: int,
                 pooling: PoolingSpec | None, conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for rank 0, which then stops every worker
    threading.Thread(target=_exit_with_parent, name="nanovllm-parent-watchdog", daemon=True).start()
    try:
        device = config.resolve_device()
        if device.type == "cuda":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(_cpu_threads_per_rank(config.tensor_parallel_size))
        store = dist.TCPStore(_HOST, port, is_master=False, timeout=COLLECTIVE_TIMEOUT)
        conn.send(("ready", None))
        init_tp_group(rank, config.tensor_parallel_size, store, device)
        runner = ModelRunner(config, resolved, max_model_len, eos_token_ids=[], pooling=pooling)  # rank 0 samples
        _serve(runner, conn, device)
        destroy_tp_group()
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises it; this process just ends
        with contextlib.suppress(OSError):
            conn.send(("error", traceback.format_exc()))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # a broken group must not be torn down politely: peers may never answer


def _serve(runner: ModelRunner, conn: Connection, device: torch.device) -> None:
    """Execute the steps rank 0 sends until it says stop."""
    while True:
        data = conn.recv_bytes()
        if memoryview(data)[:8].cast("q")[0] == _LORA_LOADS:
            runner.load_adapters(pickle.loads(data[8:]))
            continue
        message = array("q")
        message.frombytes(data)
        if message[0] == _STOP:
            return
        payload = broadcast_from_rank0(torch.empty(message[1], dtype=torch.uint8, device=device))
        runner.execute(unpack(StepInputs, message[2:].tolist(), payload))


def _exit_with_parent() -> None:
    """A worker's watchdog: when rank 0's process dies, even by SIGKILL, the worker ends at once."""
    wait([mp.parent_process().sentinel])
    os._exit(1)
