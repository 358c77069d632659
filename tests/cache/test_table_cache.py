"""TableCache's incremental bookkeeping: reserved (pinned or held) and free slot counts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torchrec_mtrains.cache.kernels import NUMBA_AVAILABLE
from torchrec_mtrains.cache.table_cache import CacheTooSmallError, TableCache
from torchrec_mtrains.planner.perf_model import SLOT_OVERHEAD_BYTES

BACKENDS = [
    "torch",
    pytest.param(
        "numba", marks=pytest.mark.skipif(not NUMBA_AVAILABLE, reason="numba is not installed")
    ),
]


def assert_counts_consistent(cache: TableCache) -> None:
    expected = cache.pinned | (cache.holds > 0)
    assert torch.equal(cache._reserved, expected)
    assert cache._num_reserved == int(expected.sum())
    assert cache._num_free == int((cache.slot_to_id < 0).sum())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_counts_follow_holds_pins_evictions_and_clear(policy: str, backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    cache = TableCache("t", num_rows=1000, num_slots=64, policy=policy, backend=backend)
    held: list[torch.Tensor] = []
    for step in range(300):
        ids = torch.unique(torch.randint(0, 1000, (10,), generator=g))
        plan = cache.plan(ids)
        cache.hold(plan.slots)
        held.append(plan.slots)
        if len(held) > 3:  # three batches in flight, as with look-ahead 2
            cache.release(held.pop(0))
        if step % 50 == 7:
            cache.pin(plan.slots[:2])
        if step == 200:
            cache.clear()
            held.clear()
        assert_counts_consistent(cache)
        resident_ids = cache.slot_to_id[cache.slot_to_id >= 0]
        assert torch.equal(
            cache.id_to_slot[resident_ids].to(torch.int64),
            torch.nonzero(cache.slot_to_id >= 0).flatten(),
        )
    assert cache.stats.evictions > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_slot_counts_once(backend: str) -> None:
    cache = TableCache("t", num_rows=10, num_slots=4, backend=backend)
    slots = cache.plan(torch.tensor([1, 2])).slots
    cache.hold(torch.cat([slots[:1], slots[:1]]))  # held twice
    assert cache._num_reserved == 1
    cache.release(slots[:1])
    assert cache._num_reserved == 1  # one hold left
    cache.release(slots[:1])
    assert cache._num_reserved == 0
    assert_counts_consistent(cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_held_slots_are_never_evicted_and_capacity_counts_them(backend: str) -> None:
    cache = TableCache("t", num_rows=100, num_slots=6, backend=backend)
    first = cache.plan(torch.tensor([0, 1, 2, 3]))
    cache.hold(first.slots)
    second = cache.plan(torch.tensor([4, 5]))  # fills the free slots
    assert not set(second.load_slots.tolist()) & set(first.slots.tolist())
    with pytest.raises(CacheTooSmallError, match=r"'t'.*4 slots are pinned or held"):
        cache.plan(torch.tensor([6, 7, 8]))
    assert_counts_consistent(cache)
    third = cache.plan(torch.tensor([6, 7]))  # evicts 4 and 5, never the held rows
    assert third.evict_ids.tolist() == [4, 5]  # equal recency: in slot order
    assert_counts_consistent(cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_victims_follow_the_policy_order(policy: str, backend: str) -> None:
    """LRU evicts the oldest use; LFU the fewest uses, then the oldest; ties by slot."""
    cache = TableCache("t", num_rows=100, num_slots=4, policy=policy, backend=backend)
    cache.plan(torch.tensor([10, 11, 12, 13]))  # slots 0..3, step 1
    cache.plan(torch.tensor([10, 11]))  # step 2
    cache.plan(torch.tensor([10, 11]))  # step 3
    cache.plan(torch.tensor([12]))  # step 4
    plan = cache.plan(torch.tensor([20, 21]))
    # lru, last use: 13@1, 10@3, 11@3, 12@4; lfu, (count, last use): 13 (1, 1), 12 (2, 4), ...
    assert plan.evict_ids.tolist() == ([13, 10] if policy == "lru" else [13, 12])
    assert plan.load_ids.tolist() == [20, 21]
    assert plan.load_slots.tolist() == cache.lookup(torch.tensor([20, 21])).tolist()


def _array_bytes(obj: object, seen: set[int], depth: int = 0) -> int:
    """Bytes of the tensors and numpy arrays reachable from ``obj``'s attributes, each buffer
    once (a numpy view of a tensor shares its data pointer)."""
    if isinstance(obj, torch.Tensor | np.ndarray):
        if isinstance(obj, torch.Tensor):
            ptr, nbytes = obj.untyped_storage().data_ptr(), obj.untyped_storage().nbytes()
        else:
            ptr, nbytes = obj.__array_interface__["data"][0], obj.nbytes
        if ptr in seen:
            return 0
        seen.add(ptr)
        return nbytes
    if depth > 3:
        return 0
    children = obj if isinstance(obj, tuple | list) else getattr(obj, "__dict__", {}).values()
    return sum(_array_bytes(c, seen, depth + 1) for c in children)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_the_planner_counts_every_byte_a_cache_slot_takes(policy: str, backend: str) -> None:
    """The planner's per-slot bookkeeping (``SLOT_OVERHEAD_BYTES``) covers what a cache
    allocates per slot with each built-in policy: its plan is the memory the run takes."""
    sizes = {}
    for slots in (1 << 12, 1 << 13):
        cache = TableCache("t", num_rows=100, num_slots=slots, policy=policy, backend=backend)
        cache.plan(torch.arange(50))
        sizes[slots] = _array_bytes(cache, set())
    per_slot = (sizes[1 << 13] - sizes[1 << 12]) / (1 << 12)
    assert per_slot > 0
    assert per_slot <= SLOT_OVERHEAD_BYTES, (policy, backend, per_slot)
