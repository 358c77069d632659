"""Hit rates of MIN, MIN seeing ahead, and the cache's LRU and LFU against naive references."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lru_reference import lru_hit_rate
from replacement_reference import (
    cache_hits,
    optimal_hits,
    random_trace,
    seen_ahead_hits,
    unique_batches,
    windows,
)

from torchrec_mtrains.profiler.replacement import (
    BatchTrace,
    ReplacementPolicy,
    batch_hits,
    policy_curve,
    policy_hit_rates,
)

MIN = ReplacementPolicy.MIN
AHEAD = ReplacementPolicy.MIN_SEEN_AHEAD
LRU = ReplacementPolicy.LRU
LFU = ReplacementPolicy.LFU

tiny_traces = st.lists(
    st.lists(st.integers(min_value=0, max_value=6), max_size=4), min_size=1, max_size=7
)


def _hits(trace: BatchTrace, policy: ReplacementPolicy, rows: int, k: int, **kw: int) -> int | None:
    hits = batch_hits(trace, policy, rows, k, **kw)  # type: ignore[arg-type]
    return None if hits is None else int(hits.sum())


def test_hand_worked_trace() -> None:
    # Batches {1, 3}, {1, 2}, {3}. With 2 rows and no look-ahead, batch 1 needs 1 and 2 at
    # once, so 3 must go, though MIN would rather keep it than 1; with 3 rows all stay.
    trace = BatchTrace.from_batches([[3, 1, 3], [1, 2], [3]])
    assert trace.lookups == 5 and trace.compulsory_misses == 3 and trace.distinct == 3
    assert trace.window_rows(0).tolist() == [2, 2, 1]
    assert trace.window_rows(1).tolist() == [2, 3, 3]
    assert trace.min_cache_rows(1) == 3
    for policy in ReplacementPolicy:
        rates = policy_hit_rates(trace, policy, [1, 2, 3], 0)
        assert np.isnan(rates[0]) and rates[1:].tolist() == [0.2, 0.4]
        assert np.isnan(policy_hit_rates(trace, policy, [2], 1)[0])
    # Counting only the last batch: MIN with 3 rows hits its one lookup.
    assert policy_hit_rates(trace, MIN, [3], 0, first=2).tolist() == [1.0]


def test_min_keeps_the_row_used_soonest_where_lru_keeps_the_latest() -> None:
    # 0 1 | 2 | 0 | 1: with 2 rows LRU evicts 0 for 2, then 1 for 0 (0 hits, 2 misses);
    # MIN evicts 1 for 2 (0 hits), then 0 for 1: one hit more.
    trace = BatchTrace.from_batches([[0, 1], [2], [0], [1]])
    assert _hits(trace, LRU, 2, 0) == 0
    assert _hits(trace, MIN, 2, 0) == 1
    assert _hits(trace, AHEAD, 2, 0, horizon=1) == 1  # sees 0 coming when it loads 2
    assert _hits(trace, AHEAD, 2, 0, horizon=0) == 0  # sees nothing: LRU


@settings(max_examples=150, deadline=None)
@given(batches=tiny_traces, k=st.integers(0, 2))
def test_min_is_the_exhaustive_optimum(batches: list[list[int]], k: int) -> None:
    ids = unique_batches(batches)
    trace = BatchTrace.from_batches(batches)
    for rows in range(9):
        assert _hits(trace, MIN, rows, k) == optimal_hits(ids, rows, k)


@settings(max_examples=150, deadline=None)
@given(batches=tiny_traces, k=st.integers(0, 2), data=st.data())
def test_min_from_a_batch_on_is_the_optimum_of_those_batches(
    batches: list[list[int]], k: int, data: st.DataObject
) -> None:
    # A window after a warm-up: the most hits any cache has in it, whatever it did before.
    ids = unique_batches(batches)
    first = data.draw(st.integers(0, len(ids)))
    trace = BatchTrace.from_batches(batches)
    for rows in range(9):
        hits = batch_hits(trace, MIN, rows, k, first=first)
        want = optimal_hits(ids, rows, k, first)
        assert (None if hits is None else int(hits[first:].sum())) == want


def test_min_of_a_window_may_beat_min_of_the_whole_trace_there() -> None:
    # Two rows: loading 2 in batch 2 evicts 1 or 3. MIN keeps 1 (used next, in batch 3) and
    # misses 3 in batch 4; counting from batch 4 on, keeping 3 instead hits there.
    trace = BatchTrace.from_batches([[1, 3], [1], [2], [1], [3]])
    assert batch_hits(trace, MIN, 2, 0).tolist() == [0, 1, 0, 1, 0]  # type: ignore[union-attr]
    assert batch_hits(trace, MIN, 2, 0, first=4).tolist()[4] == 1  # type: ignore[union-attr]
    assert policy_hit_rates(trace, MIN, [2], 0, first=4).tolist() == [1.0]


@settings(max_examples=150, deadline=None)
@given(batches=tiny_traces, k=st.integers(0, 2), horizon=st.integers(0, 8))
def test_seen_ahead_matches_the_naive_policy(
    batches: list[list[int]], k: int, horizon: int
) -> None:
    ids = unique_batches(batches)
    trace = BatchTrace.from_batches(batches)
    for rows in range(9):
        want = seen_ahead_hits(ids, rows, k, horizon)
        got = batch_hits(trace, AHEAD, rows, k, horizon=horizon)
        assert (None if got is None else got.tolist()) == want


@settings(max_examples=100, deadline=None)
@given(
    batches=tiny_traces,
    k=st.integers(0, 2),
    policy=st.sampled_from(["lru", "lfu"]),
    decay=st.integers(1, 4),
)
def test_lru_and_lfu_replay_the_row_cache(
    batches: list[list[int]], k: int, policy: str, decay: int
) -> None:
    ids = unique_batches(batches)
    trace = BatchTrace.from_batches(batches)
    for rows in range(1, 9):
        got = batch_hits(trace, policy, rows, k, decay_interval=decay)
        assert (None if got is None else got.tolist()) == cache_hits(ids, rows, k, policy, decay)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_replay_matches_the_row_cache_on_a_longer_trace(policy: str) -> None:
    # Hundreds of batches: the slot order of ties, free slots and LFU's halvings all matter.
    ids = random_trace(np.random.default_rng(3), 300, 400, 40)
    trace = BatchTrace.from_batches(ids)
    for rows in (120, 200):
        got = batch_hits(trace, policy, rows, 2, decay_interval=7)
        assert got is not None
        assert got.tolist() == cache_hits(ids, rows, 2, policy, decay_interval=7)


@settings(max_examples=150, deadline=None)
@given(batches=tiny_traces, k=st.integers(0, 2))
def test_min_bounds_every_policy_and_grows_with_the_cache(batches: list[list[int]], k: int) -> None:
    trace = BatchTrace.from_batches(batches)
    ids = unique_batches(batches)
    smallest = max(len(w) for w in windows(ids, k))
    assert trace.min_cache_rows(k) == smallest
    sizes = list(range(smallest, trace.distinct + 3))
    best = policy_hit_rates(trace, MIN, sizes, k)
    assert not np.isnan(best).any()
    assert np.all(np.diff(best) >= 0)
    for rows, rate in zip(sizes, best):
        # LRU's stack distances ignore the window: the rows it holds are LRU's anyway.
        assert rate >= lru_hit_rate(ids, rows) - 1e-12
        for policy in (LRU, LFU, AHEAD):
            assert rate >= policy_hit_rates(trace, policy, [rows], k)[0] - 1e-12
    lookups = trace.lookups
    if lookups:
        assert best[-1] == pytest.approx(1.0 - trace.compulsory_misses / lookups)
    if smallest > 0:
        assert np.isnan(policy_hit_rates(trace, MIN, [smallest - 1], k)[0])


def test_seeing_the_whole_trace_is_min_on_zipf_traces() -> None:
    # Two unrelated algorithms (interval packing, and a heap of next uses) must agree.
    rng = np.random.default_rng(0)
    for k in (0, 2):
        ids = random_trace(rng, 400, 3_000, 200)
        trace = BatchTrace.from_batches(ids)
        lo = trace.min_cache_rows(k)
        for rows in (lo, lo + 50, 2 * lo, 4 * lo):
            best = _hits(trace, MIN, rows, k)
            assert best == _hits(trace, AHEAD, rows, k, horizon=trace.num_batches)
            assert best is not None and best >= (_hits(trace, AHEAD, rows, k) or 0)
            assert best >= (_hits(trace, LRU, rows, k) or 0)


def test_curve_starts_where_a_window_fits() -> None:
    trace = BatchTrace.from_batches(random_trace(np.random.default_rng(1), 50, 500, 30))
    lo = trace.min_cache_rows(2)
    curve = policy_curve(trace, MIN, [1, lo - 1, lo, 2 * lo, 10 * lo], 2)
    assert [x for x, _ in curve] == [lo, 2 * lo, 10 * lo]
    assert curve[-1][1] == pytest.approx(1 - trace.compulsory_misses / trace.lookups)


def test_empty_traces_and_bad_arguments() -> None:
    empty = BatchTrace.from_batches([])
    assert empty.num_batches == 0 and empty.min_cache_rows(2) == 0
    assert policy_hit_rates(empty, MIN, [0, 5], 2).tolist() == [0.0, 0.0]
    blank = BatchTrace.from_batches([[], []])
    for policy in ReplacementPolicy:
        assert batch_hits(blank, policy, 0, 1).tolist() == [0, 0]  # type: ignore[union-attr]
    big = BatchTrace.from_batches([[2**40, 5, 2**40], [5]])
    assert big.distinct == 2 and _hits(big, MIN, 2, 0) == 1
    with pytest.raises(ValueError, match="1-D"):
        BatchTrace.from_batches([np.zeros((2, 2), dtype=np.int64)])
    with pytest.raises(ValueError, match="integers"):
        BatchTrace.from_batches([np.array([0.5])])
    with pytest.raises(ValueError, match="lookahead"):
        batch_hits(big, MIN, 2, -1)
    with pytest.raises(ValueError, match="cache_rows"):
        batch_hits(big, MIN, -1, 0)
    with pytest.raises(ValueError, match="'belady'"):
        batch_hits(big, "belady", 2, 0)
