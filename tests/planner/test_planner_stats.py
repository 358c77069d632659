"""The plan printout's profiled hit rates: MIN (and the cache's own policy when it is not LRU)
at each cached table's planned size, beside the planner's estimate; the plan is the same with
or without them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from planner_helpers import small_host, tables

from torchrec_mtrains.planner import PlannerConfig, plan_tables
from torchrec_mtrains.planner.stats import PlanSummary
from torchrec_mtrains.profiler import AccessProfile, TableInfo, profile_batches

ROWS = [200_000, 2_000]
BATCH = 128


@pytest.fixture(scope="module")
def profile() -> AccessProfile:
    rng = np.random.default_rng(0)
    perm = [rng.permutation(n) for n in ROWS]
    batches = [
        {f"t_cat_{t}": perm[t][(rng.zipf(1.1, 4 * BATCH) - 1) % n] for t, n in enumerate(ROWS)}
        for _ in range(40)
    ]
    infos = {f"t_cat_{t}": TableInfo(num_rows=n, dim=16) for t, n in enumerate(ROWS)}
    return profile_batches(batches, infos, sampling_rate=1.0, batch_size=BATCH)


def _plan(profile: AccessProfile | None, policy: str = "lru") -> PlanSummary:
    # 7 MiB of DRAM: the 13.6 MB table goes to a storage tier behind a cache.
    host = small_host(dram="8MiB")
    config = PlannerConfig(cache_policy=policy).for_lookahead(2)
    return plan_tables(tables(ROWS), host, 1, BATCH, profile, config=config).summary


def _without_curves(profile: AccessProfile) -> AccessProfile:
    old = {n: dataclasses.replace(t, policy_curves=None) for n, t in profile.tables.items()}
    return dataclasses.replace(profile, tables=old)


def _cached(summary: PlanSummary) -> list[str]:
    return [line.table for line in summary.tables if line.hit_rate is not None]


def test_min_at_the_planned_cache_size_is_reported(profile: AccessProfile) -> None:
    summary = _plan(profile)
    assert _cached(summary) == ["t_cat_0"]
    line = summary.tables[0]
    measured = profile["t_cat_0"]
    assert line.optimal_hit_rate == pytest.approx(measured.policy_hit_rate("min", line.cache_rows))
    assert line.optimal_hit_rate is not None and line.optimal_hit_rate >= line.hit_rate - 1e-3
    assert line.policy_hit_rate is None  # LRU: the planner's own estimate is the policy's
    assert summary.tables[1].optimal_hit_rate is None  # in DRAM, no cache
    text = summary.format()
    header = next(row for row in text.splitlines() if row.startswith("table"))
    assert "MIN" in header and "LRU" not in header
    row = next(row for row in text.splitlines() if row.startswith("t_cat_0"))
    assert f"{line.hit_rate:.3f}{line.optimal_hit_rate:>7.3f}" in row
    assert any(
        note.startswith("MIN: hit rates at the planned cache size") for note in summary.notes
    )
    assert any("look-ahead 2" in note for note in summary.notes)


def test_the_cache_policy_is_shown_beside_min_when_not_lru(profile: AccessProfile) -> None:
    summary = _plan(profile, "lfu")
    line = summary.tables[0]
    assert line.policy_hit_rate == pytest.approx(
        profile["t_cat_0"].policy_hit_rate("lfu", line.cache_rows)
    )
    header = next(row for row in summary.format().splitlines() if row.startswith("table"))
    assert header.index("LFU") < header.index("MIN")
    assert any(note.startswith("LFU and MIN:") for note in summary.notes)


def test_the_plan_is_the_same_without_policy_curves(profile: AccessProfile) -> None:
    # A profile written before the curves existed: no column, no note, the same plan.
    with_curves, without = _plan(profile), _plan(_without_curves(profile))
    assert [dataclasses.replace(t, optimal_hit_rate=None) for t in with_curves.tables] == list(
        without.tables
    )
    assert with_curves.ranks == without.ranks
    assert with_curves.step_time_s == without.step_time_s
    assert all(t.optimal_hit_rate is None for t in without.tables)
    assert "MIN" not in without.format()
    # And without any profile, the printout is as it always was.
    assert "MIN" not in _plan(None).format()
