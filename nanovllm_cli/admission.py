"""The order in which a window of rows enters the engine.

Prefix-aware (the default): the window is sorted by LoRA adapter, then by prompt token ids, so rows sharing a
prefix sit together, and consecutive rows of one adapter sharing at least their first full KV block form a group
(the KV of one adapter's rows serves no other adapter's). A group's first row (its leader)
is admitted first; the others follow one engine step later, when the leader's prefix blocks are computed and
hashed, so they hit the prefix cache instead of computing the same prefix beside the leader in the same step.
File order (`reorder=False`): every row is a group of its own, admitted in input order.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from nanovllm_cli.rows import RowRequest


@dataclass
class PrefixGroup:
    requests: deque[RowRequest] = field(default_factory=deque)
    leader_round: int | None = None  # the admission round in which the leader went to the engine


def _adapter(request: RowRequest) -> int:
    return 0 if request.lora_request is None else request.lora_request.lora_int_id


def _shares_a_block(a: RowRequest, b: RowRequest, block_size: int) -> bool:
    return (_adapter(a) == _adapter(b) and len(a.token_ids) >= block_size
            and a.token_ids[:block_size] == b.token_ids[:block_size])


def admission_groups(requests: list[RowRequest], reorder: bool, block_size: int) -> list[PrefixGroup]:
    if not reorder:
        return [PrefixGroup(deque([r])) for r in requests]
    groups: list[PrefixGroup] = []
    for request in sorted(requests, key=lambda r: (_adapter(r), r.token_ids)):
        if not groups or not _shares_a_block(groups[-1].requests[0], request, block_size):
            groups.append(PrefixGroup())
        groups[-1].requests.append(request)
    return groups
