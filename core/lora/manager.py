"""The engine's host side of multi-LoRA: the adapters requests name, and which device slot each running row's
adapter holds.

A request's adapter is read and checked against the model when the request is added (`check`: its matrices
fit the model's layers), once per `lora_int_id`; the verdict is kept, so a job of many rows naming one adapter
reads it once, and one id always names one adapter. The scheduler admits a row only when its adapter can get a
slot (`can_admit`; a row that cannot waits and others are admitted meanwhile), pins the slot while the row runs
(`admit`) and unpins it when the row finishes or is preempted (`release`); slots.py decides which slot, evicting
the least recently released adapter. Writing an adapter into a slot is the device side's work: the writes a
step needs are handed over with that step (`take_loads`, ScheduledBatch.lora_loads), and the runner performs
them before the step, in launch order, so a step in flight still reads what it was launched with."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from nanovllm.lora.adapter import LoRAAdapter, LoRARequest, load_adapter
from nanovllm.lora.slots import SlotPool


class Sequence(Protocol):
    """What the manager reads and writes of the engine's sequences."""

    lora_request: LoRARequest | None
    lora_slot: int  # -1: no slot


class LoRAManager:
    def __init__(self, max_loras: int, max_lora_rank: int, check: Callable[[LoRAAdapter], None]):
        """`check(adapter)`: raise ValueError when the adapter does not fit the model (the runner's layers)."""
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self._check = check
        self._known: dict[int, LoRARequest] = {}  # lora_int_id -> the request it was first seen with
        self._errors: dict[int, str] = {}  # lora_int_id -> why its adapter cannot run
        self._loads: list[tuple[int, LoRARequest]] = []  # slot writes the next step performs first, in order
        self.pool = SlotPool(max_loras, self._queue_load)

    def validate(self, request: LoRARequest) -> None:
        """Raise ValueError (a request error) when `request` cannot run: not a LoRARequest, an id already naming
        another adapter, or an adapter that cannot be read or does not fit the model."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, not {type(request).__name__}")
        key = request.lora_int_id
        known = self._known.get(key)
        if known is not None and known != request:
            raise ValueError(f"lora_int_id {key} names adapter {known.lora_name!r} ({known.lora_path}); "
                             f"{request.lora_name!r} ({request.lora_path}) needs an id of its own")
        if known is None:
            self._known[key] = request
            try:
                self._check(load_adapter(request.lora_path, self.max_lora_rank, request.lora_name))
            except ValueError as exc:  # the adapter's own fault, said by name
                self._errors[key] = str(exc)
            except Exception as exc:  # noqa: BLE001 - unreadable (I/O, Hub, safetensors): this request's error
                self._errors[key] = (f"LoRA adapter {request.lora_name!r}: cannot read {request.lora_path}: "
                                     f"{type(exc).__name__}: {exc}")
        if key in self._errors:
            raise ValueError(self._errors[key])

    def can_admit(self, seq: Sequence) -> bool:
        return seq.lora_request is None or self.pool.can_acquire(seq.lora_request.lora_int_id)

    def admit(self, seq: Sequence) -> None:
        """Pin a slot for the row being admitted (`can_admit` said it can have one)."""
        if seq.lora_request is not None:
            slot = self.pool.acquire(seq.lora_request)
            assert slot is not None, "admit without can_admit"
            seq.lora_slot = slot

    def release(self, seq: Sequence) -> None:
        """The row finished or was preempted: unpin its slot."""
        if seq.lora_slot >= 0:
            self.pool.release(seq.lora_request.lora_int_id)
            seq.lora_slot = -1

    def take_loads(self) -> list[tuple[int, LoRARequest]]:
        """The slot writes queued since the last call: (slot, adapter), to perform in this order."""
        loads, self._loads = self._loads, []
        return loads

    def abort(self, seqs: list[Sequence]) -> None:
        """After a failed step, whose slot writes may not have happened: every slot is taken for empty, so an
        adapter is written again before a row uses it; `seqs` (the rows that ran) hold no slot any more."""
        for seq in seqs:
            seq.lora_slot = -1
        self._loads = []
        self.pool = SlotPool(self.max_loras, self._queue_load)

    def _queue_load(self, slot: int, request: LoRARequest) -> None:
        self._loads.append((slot, request))
