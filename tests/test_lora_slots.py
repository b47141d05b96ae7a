"""The adapter slot pool's host logic (core/lora/slots.py): free slots first, pins while rows run, LRU eviction of
unpinned adapters only, a row that finds every slot pinned waits, checked step by step against an oracle that
recomputes the expected slot owners from the whole history."""
import random

import pytest

from nanovllm.lora.adapter import LoRARequest
from nanovllm.lora.slots import SlotPool


def request(i: int) -> LoRARequest:
    return LoRARequest(f"adapter-{i}", i, f"/adapters/{i}")


class Recorder:
    """The pool's `load`: records (slot, adapter id); fails for the ids in `failing`."""

    def __init__(self, failing=()):
        self.loads, self.failing = [], set(failing)

    def __call__(self, slot, req):
        if req.lora_int_id in self.failing:
            raise OSError(f"cannot read {req.lora_path}")
        self.loads.append((slot, req.lora_int_id))


def test_free_slots_first_then_least_recently_released():
    load = Recorder()
    pool = SlotPool(3, load)
    assert [pool.acquire(request(i)) for i in (1, 2, 3)] == [0, 1, 2]
    assert pool.acquire(request(1)) == 0  # resident: pinned again, not reloaded
    assert load.loads == [(0, 1), (1, 2), (2, 3)]
    assert not pool.can_acquire(4) and pool.acquire(request(4)) is None  # every slot pinned: the row waits
    assert pool.can_acquire(2)  # a resident adapter always can
    pool.release(3)
    pool.release(2)
    pool.release(1)  # adapter 1 still has a row
    assert pool.can_acquire(4)
    assert pool.acquire(request(4)) == 2  # adapter 3 was released first
    assert pool.slot_of(3) is None and pool.slot_of(2) == 1
    assert pool.acquire(request(3)) == 1  # adapter 2 next; adapter 1 (pinned) stays
    assert load.loads[3:] == [(2, 4), (1, 3)] and pool.num_evictions == 2 and pool.num_loads == 5


def test_reacquired_adapter_leaves_the_eviction_order():
    pool = SlotPool(2, Recorder())
    pool.acquire(request(1))
    pool.acquire(request(2))
    pool.release(1)
    pool.release(2)
    pool.acquire(request(1))  # pinned again: no longer evictable
    assert pool.acquire(request(3)) == 1  # takes adapter 2's slot
    assert pool.acquire(request(4)) is None


def test_failed_load_leaves_the_slot_free():
    load = Recorder(failing={2})
    pool = SlotPool(1, load)
    with pytest.raises(OSError, match="/adapters/2"):
        pool.acquire(request(2))
    assert pool.slot_of(2) is None and pool.acquire(request(1)) == 0


def test_misuse_is_refused():
    pool = SlotPool(2, Recorder())
    pool.acquire(request(1))
    with pytest.raises(ValueError, match="lora_int_id 1 names adapter 'adapter-1'.*needs an id of its own"):
        pool.acquire(LoRARequest("other", 1, "/adapters/other"))
    with pytest.raises(ValueError, match="adapter 7 has no row holding its slot"):
        pool.release(7)
    with pytest.raises(ValueError, match="max_loras must be at least 1"):
        SlotPool(0, Recorder())


@pytest.mark.parametrize("seed", range(5))
def test_random_rows_against_an_oracle(seed):
    """Rows of 6 adapters start and finish at random over 4 slots. The oracle keeps, for each slot, its adapter
    and when its last row ended; it predicts every acquire's answer and every load."""
    rng = random.Random(seed)
    load = Recorder()
    pool = SlotPool(4, load)
    owner = {}  # slot -> adapter id
    rows = {}  # adapter id -> running rows
    released_at = {}  # adapter id -> time its last row ended (only while it has none)
    running = []
    for time in range(400):
        if running and rng.random() < 0.5:
            adapter = running.pop(rng.randrange(len(running)))
            pool.release(adapter)
            rows[adapter] -= 1
            if rows[adapter] == 0:
                released_at[adapter] = time
            continue
        adapter = rng.randrange(1, 7)
        resident = {a: s for s, a in owner.items()}
        free = sorted(s for s in range(4) if s not in owner)
        idle = sorted((released_at[a], resident[a]) for a in resident if rows.get(a, 0) == 0)
        if adapter in resident:
            expected, loaded = resident[adapter], False
        elif free:
            expected, loaded = free[0], True
        elif idle:
            expected, loaded = idle[0][1], True
        else:
            expected, loaded = None, False
        assert pool.can_acquire(adapter) == (expected is not None)
        loads_before = len(load.loads)
        assert pool.acquire(request(adapter)) == expected
        assert len(load.loads) == loads_before + loaded
        if expected is not None:
            owner[expected] = adapter
            rows[adapter] = rows.get(adapter, 0) + 1
            released_at.pop(adapter, None)
            running.append(adapter)
        assert all(pool.slot_of(a) == s for s, a in owner.items())
