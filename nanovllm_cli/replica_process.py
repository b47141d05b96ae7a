"""Starting one data-parallel replica's process (replica_worker.py runs in it). Nothing here imports the engine:
the parent starts its replicas before it imports the engine (replica_start.py)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess

from nanovllm_cli.placement import Placement, born_with

DEFAULT_RESTARTS = 3  # restarts of each replica after it died


@dataclass
class ReplicaProcess:
    """One started replica process and its two pipe ends in the parent."""
    process: BaseProcess
    send_end: Connection  # parent -> replica
    recv_end: Connection  # replica -> parent
    spawned: float  # monotonic clock of its start


def _replica_entry(model: str | None, engine_args: dict, conn_in: Connection, conn_out: Connection) -> None:
    from nanovllm_cli.replica_worker import replica_main  # in the child: the engine is imported there

    replica_main(model, engine_args, conn_in, conn_out)


def start_replica_process(ctx: SpawnContext, model: str | None, engine_args: dict, placement: Placement,
                          index: int) -> ReplicaProcess:
    """Start replica `index` of `LLM(model, **engine_args)` with its placement's devices, memory share and
    environment; returns at once."""
    args = dict(engine_args)
    if placement.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = placement.gpu_memory_utilization
    child_reads, parent_writes = ctx.Pipe(duplex=False)
    parent_reads, child_writes = ctx.Pipe(duplex=False)
    process = ctx.Process(target=_replica_entry, args=(model, args, child_reads, child_writes),
                          name=f"nanovllm-replica-{index}")
    with born_with(placement):
        process.start()
    child_reads.close()
    child_writes.close()
    return ReplicaProcess(process, parent_writes, parent_reads, time.monotonic())


def stop_replica_process(started: ReplicaProcess) -> None:
    """Kill a started replica and reap it: its process joined, its pipe ends closed."""
    if started.process.is_alive():
        started.process.kill()
    started.process.join()
    for end in (started.send_end, started.recv_end):
        with contextlib.suppress(OSError):
            end.close()
