"""The score rule (TorchRec's ``FeatureScoreBasedEvictionPolicy``) of virtual tables, alone:
what it reads from the policy, what it refuses, and which rows a round keeps; a round's compiled
scans against numpy's paths. (Training with it, bit for bit against a reset FUSED table:
``test_virtual_tables.py`` and the sweep.)"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from torchrec.modules.embedding_configs import FeatureScoreBasedEvictionPolicy

from torchrec_mtrains.cache.id_map import VirtualRowMap
from torchrec_mtrains.cache.kernels import NUMBA_AVAILABLE
from torchrec_mtrains.cache.table_cache import TableCache
from torchrec_mtrains.distributed import virtual_eviction, virtual_rows
from torchrec_mtrains.distributed.virtual_eviction import (
    EvictionKind,
    EvictionRule,
    ShardEviction,
    UnsupportedEvictionPolicy,
    split_at_nth_smallest,
)
from torchrec_mtrains.distributed.virtual_rows import eviction_candidates


def _policy(**kwargs: Any) -> FeatureScoreBasedEvictionPolicy:
    settings: dict[str, Any] = {
        "training_id_eviction_trigger_count": 8,
        "training_id_keep_count": 4,
        "decay_rate": 0.5,
        "enable_auto_feature_score_collection": True,
        "feature_score_mapping": {"f": 2.0},
    }
    return FeatureScoreBasedEvictionPolicy(**(settings | kwargs))


def _no_norms(rows: Any) -> Any:
    raise AssertionError("the score rule reads no weights")


def test_the_rule_reads_trigger_keep_count_decay_and_the_features_score() -> None:
    rule = EvictionRule.from_policy("t", _policy(), ["f"])
    assert rule.kind is EvictionKind.SCORE and rule.evicts
    assert (rule.trigger_count, rule.keep_count, rule.decay_rate, rule.score) == (8, 4, 0.5, 2.0)
    assert rule.columns == ("count", "batches_ago")
    default = _policy(feature_score_mapping={}, feature_score_default_value=3.0)
    assert EvictionRule.from_policy("t", default, ["f", "g"]).score == 3.0
    # as TorchRec says: a TTL set makes it a TTL rule; eviction off, none
    ttl = EvictionRule.from_policy("t", _policy(eviction_ttl_mins=2), ["f"])
    assert (ttl.kind, ttl.ttl_seconds, ttl.trigger_count) == (EvictionKind.TTL, 120.0, 8)
    assert not EvictionRule.from_policy("t", _policy(enable_eviction=False), ["f"]).evicts


@pytest.mark.parametrize(
    ("settings", "features", "message"),
    [
        (
            {"enable_auto_feature_score_collection": False},
            ["f"],
            "enable_auto_feature_score_collection=False takes its scores from the input's weights",
        ),
        ({"training_id_keep_count": 0}, ["f"], r"needs training_id_keep_count > 0 \(got 0\)"),
        ({}, ["f", "g"], "has no score for feature 'g'"),
        (
            {"feature_score_mapping": {"f": 1.0}, "feature_score_default_value": 2.0},
            ["f", "g"],
            "different scores",
        ),
        ({"feature_score_mapping": {"f": -1.0}}, ["f"], "the score -1.0: use a finite score"),
        ({"decay_rate": 1.5}, ["f"], r"decay_rate=1.5 must be in \(0, 1\]"),
    ],
)
def test_what_the_rule_refuses_names_the_table_and_the_option(
    settings: dict[str, Any], features: list[str], message: str
) -> None:
    with pytest.raises(UnsupportedEvictionPolicy, match=r"virtual table 't_v': .*" + message):
        EvictionRule.from_policy("t_v", _policy(**settings), features)


def test_a_round_decays_scores_and_keeps_the_highest_least_recent_going_first() -> None:
    shard = ShardEviction(EvictionRule.from_policy("t", _policy(), ["f"]), capacity=10)
    rows = np.arange(8, dtype=np.int64)
    shard.batches = 1
    # made by a batch of 3 values of rows 0-3 and 1 value of rows 4-7: scores 6 and 2
    shard.made(rows, np.array([3, 3, 3, 3, 1, 1, 1, 1]))
    assert shard.count[:8].tolist() == [6.0] * 4 + [2.0] * 4
    shard.batches = 2
    shard.touch(np.array([4, 5]), np.array([2, 1]))  # 2 + 4 and 2 + 2
    assert shard.count[4:6].tolist() == [6.0, 4.0]
    assert shard.due(live=9, new=0, capacity=10) and not shard.due(live=8, new=2, capacity=10)
    may_go = np.ones(8, dtype=np.bool_)
    may_go[0] = False  # a row the batch uses, or one in flight, never goes
    gone = shard.select(rows, may_go, _no_norms)
    # decayed: 3, 3, 3, 3, 3, 2, 1, 1; keep 4 of 8: rows 6 and 7 (1), 5 (2), then of the rows
    # at 3 the one least recently used (row 4 was used by batch 2) with the lowest id: row 1
    assert gone.tolist() == [1, 5, 6, 7]
    assert shard.count[:8].tolist() == [3.0, 3.0, 3.0, 3.0, 3.0, 2.0, 1.0, 1.0]
    assert (shard.rounds, shard.evicted) == (1, 4)


def test_ties_go_by_last_use_then_id_whatever_the_rows_order() -> None:
    """A reload may give ids other rows: the choice is the same (by score, last use, id)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        n_rows = int(rng.integers(1, 300))
        shard = ShardEviction(EvictionRule.from_policy("t", _policy(), ["f"]), capacity=n_rows)
        shard.count[:] = rng.integers(0, 4, n_rows)  # many equal scores
        shard.last_batch[:] = rng.integers(0, 3, n_rows)
        ids = rng.permutation(10 * n_rows)[:n_rows]
        rows = rng.permutation(n_rows).astype(np.int64)
        room = int(rng.integers(0, n_rows + 2))
        gone = shard.select(rows, np.ones(n_rows, dtype=np.bool_), _no_norms, room, ids[rows])
        order = np.lexsort((ids, shard.last_batch, shard.count))  # by row = position here
        want = max(n_rows - 4, room)
        assert sorted(gone.tolist()) == sorted(order[:want].tolist())


def test_a_round_over_some_live_rows_picks_as_a_full_sort_would() -> None:
    """Rows not live are left out, rows that may not go stay; the live rows' scores decay by
    exactly the rate; the rest goes by (score, last use, id), as a full sort would pick."""
    rng = np.random.default_rng(1)
    for _ in range(60):
        capacity = int(rng.integers(1, 400))
        keep = int(rng.integers(1, capacity + 3))
        rule = EvictionRule.from_policy("t", _policy(training_id_keep_count=keep), ["f"])
        shard = ShardEviction(rule, capacity=capacity)
        shard.count[:] = rng.integers(0, 3, capacity) * 0.75
        shard.last_batch[:] = rng.integers(0, 3, capacity)
        live = np.flatnonzero(rng.random(capacity) < 0.7).astype(np.int64)
        ids = rng.permutation(10 * capacity)[: len(live)].astype(np.int64)
        may_go = rng.random(len(live)) < 0.8
        room = int(rng.integers(0, len(live) + 2))
        before = shard.count.copy()
        gone = shard.select(live, may_go, _no_norms, room, ids)
        assert np.array_equal(shard.count[live], before[live] * 0.5)
        rows, row_ids = live[may_go], ids[may_go]
        order = np.lexsort((row_ids, shard.last_batch[rows], shard.count[rows]))
        want = max(len(live) - keep, room)
        assert sorted(gone.tolist()) == sorted(rows[order[: max(want, 0)]].tolist())


def test_a_round_frees_the_room_new_ids_need_when_that_is_more() -> None:
    shard = ShardEviction(EvictionRule.from_policy("t", _policy(), ["f"]), capacity=6)
    rows = np.arange(6, dtype=np.int64)
    shard.made(rows, np.arange(1, 7))
    gone = shard.select(rows, np.ones(6, dtype=np.bool_), _no_norms, room=3)
    assert gone.tolist() == [0, 1, 2]  # keep 4 would free 2; the batch needs 3
    # never more than may go
    some = np.array([False, False, False, True, True, True])
    assert len(shard.select(rows, some, _no_norms, room=5)) == 3


def _values(rng: np.random.Generator, kind: int, size: int) -> np.ndarray:
    if kind == 0:  # distinct scores
        return rng.random(size)
    if kind == 1:  # few distinct decayed scores: long ties, as W3's rounds see
        return 0.99 ** rng.integers(0, 5, size) * rng.integers(0, 3, size)
    if kind == 2:  # negative and positive, -0.0 beside 0.0
        v = rng.normal(size=size)
        v[rng.random(size) < 0.2] = -0.0
        v[rng.random(size) < 0.2] = 0.0
        return v
    if kind == 3:  # int64 over its whole range
        return rng.integers(-(2**63), 2**63 - 1, size, dtype=np.int64, endpoint=True)
    return rng.integers(0, 4, size).astype(np.int64)  # int64, long ties (last uses)


@pytest.mark.parametrize("compiled", [True, False])
def test_split_at_the_nth_smallest_is_numpys_partition(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positions below the n-th smallest and equal to it, as numpy's partition and two
    comparisons give them, compiled or not, for floats (signs, zeros, ties) and int64."""
    monkeypatch.setattr(virtual_eviction, "NUMBA_AVAILABLE", compiled and NUMBA_AVAILABLE)
    rng = np.random.default_rng(7)
    for case in range(400):
        size = int(rng.integers(1, 5000))
        values = _values(rng, case % 5, size)
        n = int(rng.choice([1, size, int(rng.integers(1, size + 1))]))
        nth = np.partition(values, n - 1)[n - 1]
        below, tied = split_at_nth_smallest(values, n)
        assert below.dtype == tied.dtype == np.int64
        assert np.array_equal(below, np.flatnonzero(values < nth)), (case, size, n)
        assert np.array_equal(tied, np.flatnonzero(values == nth)), (case, size, n)
    with pytest.raises(ValueError, match="n=0 out of range"):
        split_at_nth_smallest(np.zeros(3), 0)


@pytest.mark.skipif(not NUMBA_AVAILABLE, reason="compares the compiled scan with numpy's")
def test_a_rounds_candidates_compiled_are_numpys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which live rows a round may evict (not the batch's, not those of the batches just
    before it, not those held or pinned in the cache): the compiled scan and numpy's agree."""
    rng = np.random.default_rng(3)
    for _ in range(40):
        capacity = int(rng.integers(1, 3000))
        id_map = VirtualRowMap("t", capacity)
        id_map.assign(np.unique(rng.integers(0, 2**40, int(rng.integers(0, capacity + 1)))))
        id_map.remove(id_map.row_ids[rng.random(capacity) < 0.3])
        eviction = ShardEviction(EvictionRule.from_policy("t", _policy(), ["f"]), capacity)
        eviction.batches = int(rng.integers(0, 20))
        eviction.last_batch[:] = rng.integers(0, eviction.batches + 1, capacity)
        cache = TableCache("t", capacity, max(1, capacity // 3))
        plan = cache.plan(torch.from_numpy(rng.permutation(capacity)[: cache.num_slots]))
        cache.hold(plan.slots[rng.random(cache.num_slots) < 0.3])
        cache.pin(plan.slots[rng.random(cache.num_slots) < 0.1])
        batch_rows = rng.permutation(capacity)[: int(rng.integers(0, capacity))]
        compiled = eviction_candidates(id_map, eviction, batch_rows, cache)
        monkeypatch.setattr(virtual_rows, "NUMBA_AVAILABLE", False)
        reference = eviction_candidates(id_map, eviction, batch_rows, cache)
        monkeypatch.undo()
        for got, want in zip(compiled, reference):
            assert got.dtype == want.dtype and np.array_equal(got, want)
        assert 0 < reference[2].sum() < len(reference[2]) or capacity < 50
