"""Where each data-parallel replica runs: its devices, its memory share, the environment it is born with.

On GPUs replica i gets the visible GPUs [i*TP, (i+1)*TP) through CUDA_VISIBLE_DEVICES, set before the process
starts. More replicas than GPU sets share them round-robin, when the memory fits: the replicas on one GPU ask
gpu_memory_utilization u each (an engine's share of the device) and together at most 0.95; they start one after
another (`Placement.wave`), so that each measures its free memory with the caches of those before it allocated.
The host's cores are split between the replicas' processes (OMP_NUM_THREADS, unless set), on GPUs too: N each
running torch's default of one thread per core would contend for the cores in their CPU-side work (loading,
graph capture) and start slower side by side than alone.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

MAX_SHARED_UTILIZATION = 0.95  # the most the replicas sharing a GPU may ask of it together
DEFAULT_UTILIZATION = 0.9  # the engine's default gpu_memory_utilization


class PlacementError(ValueError):
    """The replicas do not fit the visible devices; the message says what to change."""


@dataclass(frozen=True)
class Placement:
    devices: tuple[str, ...] | None  # CUDA_VISIBLE_DEVICES of the replica; None on the CPU
    gpu_memory_utilization: float | None  # what the replica asks; None: the engine's default
    wave: int  # replicas start wave by wave: those sharing GPUs one after another
    env: tuple[tuple[str, str], ...] = ()  # environment the replica is born with


def plan_replicas(size: int, tp: int, on_gpu: bool, visible: list[str], utilization: float | None) -> list[Placement]:
    """Where each of `size` replicas of `tp` GPUs runs (see the module docstring). `visible`: the GPUs this
    process sees, as CUDA_VISIBLE_DEVICES entries."""
    processes = size * tp  # a replica's tensor-parallel workers inherit its environment
    threads = ("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS") or str(max((os.cpu_count() or 1) // processes, 1)))
    if not on_gpu:
        return [Placement(None, utilization, 0, (threads,))] * size
    if tp > len(visible):
        raise PlacementError(f"--tensor-parallel-size {tp} needs {tp} GPUs per replica; {len(visible)} visible")
    sets = len(visible) // tp
    per_set = math.ceil(size / sets)
    u = DEFAULT_UTILIZATION if utilization is None else utilization
    if per_set > 1 and per_set * u > MAX_SHARED_UTILIZATION + 1e-9:
        raise PlacementError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tp} needs {size * tp} GPUs; {len(visible)} "
            f"visible. Replicas can share GPUs ({per_set} on each here) when their --gpu-memory-utilization "
            f"adds up to at most {MAX_SHARED_UTILIZATION} (now {per_set} x {u:g} = {per_set * u:.2f}): pass "
            f"--gpu-memory-utilization {math.floor(MAX_SHARED_UTILIZATION / per_set * 100) / 100:g} or less, or "
            "fewer replicas")
    placements = []
    for index in range(size):
        gpu_set, slot = index % sets, index // sets
        devices = tuple(visible[gpu_set * tp:(gpu_set + 1) * tp])
        placements.append(Placement(devices, None if per_set == 1 and utilization is None else u, slot,
                                    (("CUDA_VISIBLE_DEVICES", ",".join(devices)), threads)))
    return placements


def gpu_count() -> int | None:
    """The GPUs the driver has, through NVML (as torch counts them without a CUDA context, but without importing
    torch: the parent starts its replicas before it imports the engine); None where NVML is missing or fails."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        return count.value if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 else None
    finally:
        nvml.nvmlShutdown()


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES entries (without creating a CUDA context). NVML's count
    answers where the variable is unset or lists distinct ordinals below it; anything else (-1, UUIDs, repeats,
    ordinals past the count, no NVML) is read as torch reads it."""
    count = gpu_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    entries = None if listed is None else [d.strip() for d in listed.split(",") if d.strip()]
    if count is not None and entries is None:
        return [str(i) for i in range(count)]
    if (count is not None and all(e.isdigit() and int(e) < count for e in entries)
            and len({int(e) for e in entries}) == len(entries)):
        return entries
    import torch

    count = torch.cuda.device_count()
    return [str(i) for i in range(count)] if entries is None else entries[:count]


@contextlib.contextmanager
def born_with(placement: Placement) -> Iterator[None]:
    """This process's environment with the placement's variables, for starting its replica (a spawned child
    copies the environment at start, before torch looks at the devices); restored afterwards."""
    values = dict(placement.env)
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
