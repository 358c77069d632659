"""TableCache's incremental bookkeeping: reserved (pinned or held) and free slot counts."""

from __future__ import annotations

import pytest
import torch

from torchrec_mtrains.cache.table_cache import CacheTooSmallError, TableCache


def assert_counts_consistent(cache: TableCache) -> None:
    expected = cache.pinned | (cache.holds > 0)
    assert torch.equal(cache._reserved, expected)
    assert cache._num_reserved == int(expected.sum())
    assert cache._num_free == int((cache.slot_to_id < 0).sum())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_counts_follow_holds_pins_evictions_and_clear(policy: str) -> None:
    g = torch.Generator().manual_seed(0)
    cache = TableCache("t", num_rows=1000, num_slots=64, policy=policy)
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


def test_a_repeated_slot_counts_once() -> None:
    cache = TableCache("t", num_rows=10, num_slots=4)
    slots = cache.plan(torch.tensor([1, 2])).slots
    cache.hold(torch.cat([slots[:1], slots[:1]]))  # held twice
    assert cache._num_reserved == 1
    cache.release(slots[:1])
    assert cache._num_reserved == 1  # one hold left
    cache.release(slots[:1])
    assert cache._num_reserved == 0
    assert_counts_consistent(cache)


def test_held_slots_are_never_evicted_and_capacity_counts_them() -> None:
    cache = TableCache("t", num_rows=100, num_slots=6)
    first = cache.plan(torch.tensor([0, 1, 2, 3]))
    cache.hold(first.slots)
    second = cache.plan(torch.tensor([4, 5]))  # fills the free slots
    assert not set(second.load_slots.tolist()) & set(first.slots.tolist())
    with pytest.raises(CacheTooSmallError, match=r"'t'.*4 slots are pinned or held"):
        cache.plan(torch.tensor([6, 7, 8]))
    assert_counts_consistent(cache)
    third = cache.plan(torch.tensor([6, 7]))  # evicts 4 and 5, never the held rows
    assert set(third.evict_ids.tolist()) == {4, 5}
    assert_counts_consistent(cache)
