"""VirtualRowMap: a virtual table shard's id -> row map, against a dict under random churn."""

from __future__ import annotations

import numpy as np
import pytest

from torchrec_mtrains.cache.id_map import NO_ROW, VirtualRowMap, VirtualTableFullError


@pytest.mark.parametrize("capacity", [1, 7, 300])
def test_assign_lookup_remove_match_a_dict(capacity: int) -> None:
    rng = np.random.default_rng(capacity)
    ids_space = 4 * capacity + 10
    m, ref = VirtualRowMap("t", capacity), {}
    for _ in range(2000):
        ids = np.unique(rng.integers(0, ids_space, rng.integers(1, capacity + 2)))
        new = [i for i in ids.tolist() if i not in ref]
        if rng.random() < 0.6 and len(ref) + len(new) <= capacity:
            rows, made = m.assign(ids)
            assert sorted(ids[made].tolist()) == sorted(new)
            for i, r in zip(ids.tolist(), rows.tolist()):
                assert ref.setdefault(i, r) == r
        else:
            freed = m.remove(ids)
            assert freed.tolist() == [ref.pop(i, NO_ROW) for i in ids.tolist()]
        assert len(m) == len(ref) and m.free_rows == capacity - len(ref)
        probe = np.arange(ids_space)
        assert m.lookup(probe).tolist() == [ref.get(i, NO_ROW) for i in probe.tolist()]
        assert len(set(ref.values())) == len(ref)  # a row holds one id
        live_ids, live_rows = m.live()
        assert dict(zip(live_ids.tolist(), live_rows.tolist())) == ref


def test_ids_from_the_whole_int64_range_and_a_full_map_refuses_changing_nothing() -> None:
    m = VirtualRowMap("t_big", 3)
    ids = np.array([0, 2**50 - 1, 2**62 + 5], dtype=np.int64)
    rows, made = m.assign(ids)
    assert sorted(rows.tolist()) == [0, 1, 2] and made.tolist() == [0, 1, 2]
    with pytest.raises(
        VirtualTableFullError, match=r"virtual table 't_big'.*1 new ids.*0 of its 3"
    ):
        m.assign(np.array([0, 7], dtype=np.int64))
    assert m.lookup(np.array([7])).tolist() == [NO_ROW] and len(m) == 3
    assert m.lookup(ids).tolist() == rows.tolist()


def test_removed_ids_free_rows_in_their_order_and_leave_the_table_as_never_inserted() -> None:
    """A round's removals visit the table by region, not in the ids' order: the rows still go
    on the free stack in the ids' order (new ids get them last freed first), and the table is
    the one the remaining ids alone would have built."""
    rng = np.random.default_rng(5)
    ids = rng.choice(2**40, 3000, replace=False).astype(np.int64)
    m = VirtualRowMap("t", 3000)
    m.assign(ids)
    gone = rng.permutation(3000)[:900]
    freed = m.remove(ids[gone])
    assert (m.lookup(ids[gone]) == NO_ROW).all()
    rows, made = m.assign(np.arange(1, 901, dtype=np.int64))
    assert made.tolist() == list(range(900)) and rows.tolist() == freed[::-1].tolist()
    m.remove(np.arange(1, 901, dtype=np.int64))
    alone = VirtualRowMap("t", 3000)
    alone.assign(np.delete(ids, gone))  # the remaining ids, in their order of insertion
    assert np.array_equal(m._keys, alone._keys)
