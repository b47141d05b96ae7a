"""Starting data-parallel replicas before the parent imports the engine.

Importing the engine (torch, transformers) takes the parent seconds, and each replica pays the same again in its
own process. So the parent places and starts the replicas' processes first, with nothing of the engine imported
(`placement.visible_gpus` counts the GPUs through the driver), and only then imports `replicas` — the pool, the
rows, the engine's types — while the replicas load."""
from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from typing import TYPE_CHECKING

from nanovllm_cli import options as o
from nanovllm_cli.options import EngineOptions
from nanovllm_cli.placement import PlacementError, plan_replicas, visible_gpus
from nanovllm_cli.replica_process import DEFAULT_RESTARTS, ReplicaProcess, start_replica_process, stop_replica_process

if TYPE_CHECKING:
    from nanovllm_cli.replicas import ReplicaPool


def spawn_replicas(model: str | None, args: dict, size: int, *, max_restarts: int = DEFAULT_RESTARTS,
                   on_event: Callable[[str], None] = lambda message: None) -> ReplicaPool:
    """`size` replicas of `LLM(model, **args)` placed on the visible devices and started; returns at once, before
    they are ready (`ReplicaPool.await_first`). Raises PlacementError when they do not fit."""
    on_gpu = args.get("device", "cuda") != "cpu"
    gpus = visible_gpus() if on_gpu else []
    on_gpu = on_gpu and (bool(gpus) or "device" in args)  # no device named: the GPUs if any, else the CPU
    placements = plan_replicas(size, args.get("tensor_parallel_size", 1), on_gpu, gpus,
                               args.get("gpu_memory_utilization"))
    ctx = mp.get_context("spawn")
    first: dict[int, ReplicaProcess] = {}
    try:
        for index, placement in enumerate(placements):
            if placement.wave == 0:
                first[index] = start_replica_process(ctx, model, args, placement, index)
        from nanovllm_cli.replicas import ReplicaPool  # the engine's types: imported while the replicas load

        return ReplicaPool(model, args, placements, ctx, first, max_restarts=max_restarts, on_event=on_event)
    except BaseException:
        for started in first.values():
            stop_replica_process(started)
        raise


def spawn_engine_replicas(engine: EngineOptions, seed: int | None = None, *, max_restarts: int = DEFAULT_RESTARTS,
                          on_event: Callable[[str], None] = lambda message: None) -> ReplicaPool:
    """`spawn_replicas` for `engine.data_parallel_size` replicas of the engine these options describe; a clean
    usage error (exit 2) when the options or the placement do not work. `run` starts them before its checks of
    INPUT and OUTPUT, which then overlap the replicas' start (`ready_replicas` waits for them)."""
    try:
        args = engine.args(seed)
    except ValueError as exc:
        raise o.fail(str(exc)) from None
    try:
        return spawn_replicas(engine.model, args, engine.data_parallel_size, max_restarts=max_restarts,
                              on_event=on_event)
    except PlacementError as exc:
        raise o.fail(str(exc)) from None


def start_replicas(model: str | None, args: dict, size: int, *, max_restarts: int = DEFAULT_RESTARTS,
                   on_event: Callable[[str], None] = lambda message: None) -> ReplicaPool:
    """`spawn_replicas`, then `await_first`: returns once one is ready. Raises PlacementError, ReplicaFailed (no
    replica could start) or the tokenizer's error."""
    pool = spawn_replicas(model, args, size, max_restarts=max_restarts, on_event=on_event)
    try:
        pool.await_first()
    except BaseException:
        pool.close()
        raise
    return pool


def ready_replicas(pool: ReplicaPool, engine: EngineOptions) -> ReplicaPool:
    """`pool.await_first()` with clean usage errors (exit 2, nothing run) when the model does not work, then the
    options' chat template. The caller closes the pool if this raises."""
    from nanovllm_cli.replicas import ReplicaFailed

    try:
        pool.await_first()
    except ReplicaFailed as exc:
        raise o.fail(f"cannot start the replicas: {exc}") from None
    except (ValueError, OSError, ImportError, RuntimeError, KeyError) as exc:
        raise o.fail(f"cannot load the model: {exc}") from None
    o.use_chat_template(engine, pool.prompts)
    return pool


def load_replicas(engine: EngineOptions, seed: int | None = None, *, max_restarts: int = DEFAULT_RESTARTS,
                  on_event: Callable[[str], None] = lambda message: None) -> ReplicaPool:
    """`spawn_engine_replicas`, then `ready_replicas`."""
    pool = spawn_engine_replicas(engine, seed, max_restarts=max_restarts, on_event=on_event)
    try:
        return ready_replicas(pool, engine)
    except BaseException:
        pool.close()
        raise
