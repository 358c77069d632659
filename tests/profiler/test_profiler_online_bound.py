"""The most hits a cache can expect without knowing the future, under independent draws: exact
against enumeration, above every realizable policy replayed, below MIN."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from apps.dlrm.data.synthetic import ZipfRankSampler
from torchrec_mtrains.profiler import BatchTrace, ReplacementPolicy, best_online_hit_rates
from torchrec_mtrains.profiler.replacement import batch_hits


def _enumerated(p: np.ndarray, draws: int, cache: set[int]) -> float:
    """Expected hits over expected unique ids of one batch, by summing over every sequence of
    ``draws`` ids and its probability."""
    hits = unique = 0.0
    for seq in itertools.product(range(p.size), repeat=draws):
        weight = float(np.prod(p[list(seq)]))
        distinct = set(seq)
        unique += weight * len(distinct)
        hits += weight * len(distinct & cache)
    return hits / unique


@settings(max_examples=40, deadline=None)
@given(
    weights=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4).filter(lambda w: sum(w) > 0.1),
    draws=st.integers(1, 3),
)
def test_equals_the_best_cache_set_by_enumeration(weights: list[float], draws: int) -> None:
    p = np.asarray(weights) / sum(weights)
    rows = range(p.size)
    for size in range(p.size + 1):
        best = max(
            _enumerated(p, draws, set(cache)) for cache in itertools.combinations(rows, size)
        )
        assert best_online_hit_rates(p, draws, [size])[0] == pytest.approx(best, abs=1e-9)


def test_no_policy_replayed_on_independent_draws_beats_it_and_min_does() -> None:
    # A cache well above a batch's ~140 unique ids: the batch's own misses must fit in it
    # beside what it keeps, which the bound does not charge.
    n, draws, batches, cache = 20_000, 256, 600, 2000
    sampler = ZipfRankSampler(n, 1.1)
    rng = np.random.default_rng(3)
    perm = rng.permutation(n)  # rows in any order: the bound sorts them
    stream = [np.unique(perm[sampler.sample(rng, draws)]) for _ in range(batches)]
    trace = BatchTrace.from_batches(stream)
    p = np.empty(n)
    p[perm] = sampler.rank_probabilities()
    warm = float(best_online_hit_rates(p, draws, [cache])[0])
    first = 100
    # The stream began with an empty cache: batch t can hit only rows drawn before it.
    bound = float(best_online_hit_rates(p, draws, [cache], after_batches=range(first, batches))[0])
    one_by_one = [best_online_hit_rates(p, draws, [cache], after_batches=t)[0] for t in (100, 599)]
    assert one_by_one[0] < bound < one_by_one[1]  # the window's mean
    assert bound < warm
    lookups = int(trace.batch_lookups()[first:].sum())

    def rate(policy: ReplacementPolicy) -> float:
        hits = batch_hits(trace, policy, cache, lookahead=0, first=first)
        assert hits is not None
        return float(hits[first:].sum()) / lookups

    # Sampling noise over 500 batches of ~140 unique ids is ~0.003.
    for policy in (ReplacementPolicy.LFU, ReplacementPolicy.LRU, ReplacementPolicy.MIN_SEEN_AHEAD):
        assert rate(policy) <= bound + 0.01, policy
    assert rate(ReplacementPolicy.MIN) > bound + 0.05  # knowing the future is worth more
    # The most probable rows held as a fixed set from the start (an oracle that knows the law
    # and needs no first draw), replayed, make the warm bound.
    top = np.argsort(-p)[:cache]
    held = sum(int(np.isin(ids, top).sum()) for ids in stream[first:])
    assert held / lookups == pytest.approx(warm, abs=0.01)


def test_sizes_beyond_the_table_and_bad_input() -> None:
    p = np.array([0.5, 0.25, 0.25])
    rates = best_online_hit_rates(p, 4, [0, 1, 3, 10])
    assert rates[0] == 0.0 and rates[2] == 1.0 and rates[3] == 1.0
    assert 0.0 < rates[1] < 1.0
    # From an empty cache: nothing to hit at first, then towards the warm figure.
    early = [best_online_hit_rates(p, 4, [1, 3], after_batches=t) for t in (0, 1, 3, 50)]
    assert np.all(early[0] == 0.0)
    assert np.all(np.diff([e[1] for e in early]) > 0) and early[-1][1] == pytest.approx(1.0)
    assert np.all(np.array(early) <= rates[[1, 2]] + 1e-12)
    # One row, one draw: held after one batch with its chance of having been drawn.
    one = best_online_hit_rates([0.5], 1, [1], after_batches=1)[0]
    assert one == pytest.approx(0.5)
    with pytest.raises(ValueError, match="sum to at most 1"):
        best_online_hit_rates([0.8, 0.4], 4, [1])
    # A shard: its rows' share of the draws, the rest of the table elsewhere.
    shard = best_online_hit_rates([0.25, 0.25], 4, [1])[0]
    assert shard == pytest.approx(0.5)
    with pytest.raises(ValueError, match="draws"):
        best_online_hit_rates(p, 0, [1])
    with pytest.raises(ValueError, match="cache_rows"):
        best_online_hit_rates(p, 4, [-1])
    with pytest.raises(ValueError, match="after_batches"):
        best_online_hit_rates(p, 4, [1], after_batches=-1)
    with pytest.raises(ValueError, match="at least one row"):
        best_online_hit_rates([], 4, [1])
