"""The tensor-parallel group of this process (docs/ARCHITECTURE.md). Until `init_tp_group` the engine is a single rank.

One group per process: NCCL when the ranks run on CUDA devices, gloo on the CPU; the model's collectives and the
step broadcast use the same calls on both."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Bounds a collective that a peer never joins (a hung rank). A dead rank is noticed sooner: gloo sees its sockets
# close, and rank 0 polls its workers while it waits for a step.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class _Group:
    rank: int
    size: int
    device: torch.device  # where tensors of collectives live: a CUDA device (NCCL) or the CPU (gloo)


_group: _Group | None = None
_aborted = False  # abort_collectives ran on the current group
_before_destroy: list[Callable[[], None]] = []


def init_tp_group(rank: int, size: int, store: dist.Store, device: torch.device) -> None:
    """Join the group of `size` ranks that meet at `store`."""
    global _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    _group = _Group(rank, size, device)


def before_tp_group_destroyed(release: Callable[[], None]) -> None:
    """Call `release` when the group is left in an orderly way. CUDA graphs that captured collectives must go
    first: NCCL counts those collectives as outstanding while the graph lives, and its teardown waits for them."""
    _before_destroy.append(release)


def abort_collectives() -> None:
    """From any thread: cancel the collectives in flight, which a dead peer would never join (NCCL; gloo's fail
    by themselves once the peer's sockets close). The group is left with destroy_tp_group(abort=True)."""
    global _aborted
    if _group is not None and _group.device.type == "cuda" and not _aborted:
        _aborted = True
        dist.distributed_c10d._abort_process_group()


def destroy_tp_group(abort: bool = False) -> None:
    """Leave the group. `abort` after a peer failed: pending collectives are cancelled instead of awaited."""
    global _group, _aborted
    if _group is None:
        return
    group, _group = _group, None
    already_aborted, _aborted = _aborted, False
    releases = _before_destroy[:]
    _before_destroy.clear()
    if abort and group.device.type == "cuda":  # NCCL: unblocks the device work stuck in collectives with a dead peer
        if not already_aborted:
            dist.distributed_c10d._abort_process_group()
    elif abort:
        # gloo (an NCCL-only abort would leave its threads to be torn down at interpreter exit, where they may
        # abort the process): the peers are dead, so a collective in flight fails at once and shutdown joins.
        dist.destroy_process_group()
    else:
        for release in releases:
            release()
        dist.destroy_process_group()


def tp_rank() -> int:
    return _group.rank if _group else 0


def tp_size() -> int:
    return _group.size if _group else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate per-rank shards along `dim` on rank 0; other ranks get None."""
    if tp_size() == 1:
        return x
    shards = [torch.empty_like(x) for _ in range(tp_size())] if tp_rank() == 0 else None
    dist.gather(x, shards, dst=0)
    return torch.cat(shards, dim=dim) if tp_rank() == 0 else None


def broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere)."""
    if tp_size() > 1:
        dist.broadcast(x, src=0)
    return x


def min_over_ranks(value: int) -> int:
    """The smallest of the ranks' values (e.g. the KV-cache blocks that fit on every device)."""
    if tp_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=_group.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
