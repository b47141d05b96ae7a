"""Which adapter each of the `max_loras` device slots holds (host side; layers.py holds the slots' weights).

A running row pins its adapter's slot (`acquire` when it is admitted, `release` when it finishes or is
preempted), so a slot is never rewritten while a row uses it. An adapter stays resident after its last row is
released, in case more rows come for it; a new adapter takes a never-used slot first, else the least recently
released resident adapter's. When every slot is pinned by running rows, `acquire` says no and the row waits:
the scheduler asks `can_acquire` (O(1)) before admitting a row, and admits others meanwhile.

Every operation is O(1) (dicts and an ordered dict); `load` (writing the weights) is the caller's, and runs only
when an adapter is not resident already."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from nanovllm.lora.adapter import LoRARequest


class SlotPool:
    def __init__(self, max_loras: int, load: Callable[[int, LoRARequest], None]):
        """`load(slot, request)`: write the adapter's weights into the slot (it may raise: the slot stays free)."""
        if max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {max_loras}")
        self.max_loras = max_loras
        self._load = load
        self._free = list(range(max_loras - 1, -1, -1))  # never-used slots, popped from the end (slot 0 first)
        self._slot: dict[int, int] = {}  # resident adapter id -> slot
        self._request: dict[int, LoRARequest] = {}  # resident adapter id -> the request it was loaded for
        self._pins: dict[int, int] = {}  # resident adapter id -> rows using it (absent: none)
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident adapters no row uses, least recent first
        self.num_loads = 0
        self.num_evictions = 0

    def slot_of(self, lora_int_id: int) -> int | None:
        """The slot of a resident adapter, else None."""
        return self._slot.get(lora_int_id)

    def can_acquire(self, lora_int_id: int) -> bool:
        """Whether a row of this adapter could get its slot now: resident, or a slot free or evictable."""
        return lora_int_id in self._slot or bool(self._free) or bool(self._idle)

    def acquire(self, request: LoRARequest) -> int | None:
        """Pin the adapter's slot for one more row, loading it first if it is not resident; None (nothing changed)
        when every slot is pinned by rows of other adapters."""
        key = request.lora_int_id
        if key in self._slot:
            known = self._request[key]
            if known != request:
                raise ValueError(f"lora_int_id {key} names adapter {known.lora_name!r} ({known.lora_path}); "
                                 f"{request.lora_name!r} ({request.lora_path}) needs an id of its own")
            self._idle.pop(key, None)
            self._pins[key] = self._pins.get(key, 0) + 1
            return self._slot[key]
        if self._free:
            slot = self._free.pop()
        elif self._idle:
            evicted, _ = self._idle.popitem(last=False)
            slot = self._slot.pop(evicted)
            del self._request[evicted]
            self.num_evictions += 1
        else:
            return None
        try:
            self._load(slot, request)
        except BaseException:
            self._free.append(slot)
            raise
        self.num_loads += 1
        self._slot[key] = slot
        self._request[key] = request
        self._pins[key] = 1
        return slot

    def release(self, lora_int_id: int) -> None:
        """One row of the adapter finished or was preempted; with its last row the slot becomes evictable."""
        pins = self._pins.get(lora_int_id, 0)
        if pins == 0:
            raise ValueError(f"adapter {lora_int_id} has no row holding its slot")
        if pins > 1:
            self._pins[lora_int_id] = pins - 1
            return
        del self._pins[lora_int_id]
        self._idle[lora_int_id] = None  # most recently released: evicted last
