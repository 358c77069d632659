"""The sampling Profiler: per-table statistics from KJTs and id mappings."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch
from lru_reference import lru_hit_rate, zipf_batches
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.profiler import (
    HitRateMethod,
    Profiler,
    ProfilerConfig,
    ProfileSource,
    TableInfo,
    profile_batches,
    replacement,
)

ALL = ProfilerConfig(sampling_rate=1.0)


def kjt(features: dict[str, list[list[int]]]) -> KeyedJaggedTensor:
    """A KJT from per-feature, per-sample id lists."""
    keys = list(features)
    lengths = [len(ids) for k in keys for ids in features[k]]
    values = [i for k in keys for ids in features[k] for i in ids]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )


TABLES = {
    "t0": TableInfo(num_rows=100, dim=8),
    "t1": TableInfo(num_rows=50, dim=4, element_bytes=2),
}
FEATURES = {"f_a": "t0", "f_b": "t0", "f_c": "t1"}


def test_pooling_bytes_and_unique_ratio_from_kjts() -> None:
    b1 = kjt(
        {
            "f_a": [[1, 2], [3], [1]],  # 4 ids
            "f_b": [[1], [], [9, 9]],  # 3 ids -> t0 batch: 1,2,3,1,1,9,9: 4 unique of 7
            "f_c": [[5], [5], [5]],  # t1: 1 unique of 3
        }
    )
    b2 = kjt({"f_a": [[4], [4], [4]], "f_b": [[], [], []], "f_c": [[0, 1], [2, 3], [4, 5]]})
    profiler = Profiler(TABLES, FEATURES, ALL)
    assert profiler.observe(b1) and profiler.observe(b2)
    profile = profiler.finish()
    t0, t1 = profile["t0"], profile["t1"]
    assert profile.batch_size == 3 and t0.samples == 6
    assert t0.accesses_per_sample == pytest.approx(10 / 6)
    assert t0.bytes_per_sample == pytest.approx(10 / 6 * 8 * 4)
    assert t0.unique_ratio == pytest.approx((4 / 7 + 1 / 3) / 2)  # mean of per-batch ratios
    assert t0.unique_per_sample == pytest.approx((4 + 1) / 6)
    assert t1.accesses_per_sample == pytest.approx(9 / 6)
    assert t1.bytes_per_sample == pytest.approx(9 / 6 * 4 * 2)
    assert t1.unique_ratio == pytest.approx((1 / 3 + 1.0) / 2)
    assert t0.distinct_rows == 5 and t1.distinct_rows == 6
    assert t0.hot_rows[:2] == (1, 4)  # 3 accesses each; ties broken by id
    assert t0.hot_row_shares[:2] == pytest.approx((0.3, 0.3))
    assert t0.source is ProfileSource.MEASURED


def test_mapping_batches_and_batch_objects() -> None:
    @dataclass
    class Batch:  # the shape of torchrec.datasets.utils.Batch, as far as the profiler cares
        sparse_features: KeyedJaggedTensor

    profiler = Profiler(TABLES, FEATURES, ALL, batch_size=4)
    profiler.observe({"t0": torch.tensor([1, 1, 2, 3]), "t1": np.array([7])})
    profiler.observe({"t0": [5, 6]}, batch_size=2)  # t1 had no lookups
    profiler.observe(Batch(kjt({"f_a": [[1]], "f_c": [[2, 3]]})))
    profile = profiler.finish()
    assert profile["t0"].samples == 7
    assert profile["t0"].accesses_per_sample == pytest.approx(7 / 7)
    assert profile["t1"].accesses_per_sample == pytest.approx(3 / 7)
    assert profile["t1"].unique_ratio == pytest.approx(1.0)  # batches without ids are skipped
    assert profile.batch_size in (4, 2, 1)


def test_bad_batches_are_rejected_with_clear_errors() -> None:
    profiler = Profiler(TABLES, FEATURES, ALL)
    with pytest.raises(ValueError, match="batch_size"):
        profiler.observe({"t0": [1]})
    with pytest.raises(ValueError, match="unknown tables"):
        profiler.observe({"nope": [1]}, batch_size=1)
    with pytest.raises(ValueError, match=r"id 100 outside \[0, 100\)"):
        profiler.observe({"t0": [3, 100]}, batch_size=1)
    with pytest.raises(ValueError, match="feature 'f_x'"):
        profiler.observe(kjt({"f_x": [[1]]}))
    with pytest.raises(ValueError, match="stride"):
        profiler.observe(kjt({"f_a": [[1]]}), batch_size=5)
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        profiler.observe([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown tables"):
        Profiler(TABLES, {"f": "missing"})


def test_sampling_rate_is_honoured_deterministically() -> None:
    def picks(seed: int, rate: float, window: int = 1, n: int = 4000) -> list[int]:
        profiler = Profiler(
            TABLES, config=ProfilerConfig(sampling_rate=rate, seed=seed, window=window)
        )
        return [i for i in range(n) if profiler.observe({"t0": [i % 100]}, batch_size=1)]

    first = picks(seed=7, rate=0.05)
    assert first == picks(seed=7, rate=0.05)
    assert first != picks(seed=8, rate=0.05)
    # Binomial(4000, 0.05): mean 200, sd ~13.8; allow 4 sd.
    assert abs(len(first) - 200) < 56
    assert picks(seed=0, rate=1.0, n=50) == list(range(50))
    windows = picks(seed=1, rate=0.1, window=5)
    assert abs(len(windows) - 400) < 4 * 5 * np.sqrt(800 * 0.1 * 0.9)
    starts = {i - i % 5 for i in windows}
    assert sorted(windows) == sorted(s + k for s in starts for k in range(5))


def test_profile_counts_match_the_sampled_batches_only() -> None:
    batches = [{"t0": np.full(4, i % 100)} for i in range(400)]
    profiler = Profiler(TABLES, config=ProfilerConfig(sampling_rate=0.1, seed=3), batch_size=4)
    taken = [i % 100 for i, b in enumerate(batches) if profiler.observe(b)]
    profile = profiler.finish()
    assert profile.batches_seen == 400 and profile.batches_profiled == len(taken)
    assert profile.sampling_rate == 0.1 and profile.seed == 3
    assert profile["t0"].samples == 4 * len(taken)
    ids, counts = np.unique(taken, return_counts=True)
    hottest = ids[np.lexsort((ids, -counts))][:5]
    assert profile["t0"].hot_rows[:5] == tuple(hottest.tolist())
    # profile_batches drives the same Profiler.
    again = profile_batches(batches, TABLES, 0.1, 3, batch_size=4)
    assert again == profile


def test_max_profiled_batches_and_nothing_profiled() -> None:
    cfg = ProfilerConfig(sampling_rate=1.0, max_profiled_batches=3)
    profile = profile_batches(
        ({"t0": [1]} for _ in range(10)), TABLES, 1.0, 0, batch_size=1, config=cfg
    )
    assert profile.batches_profiled == 3 and profile.batches_seen == 10
    with pytest.raises(ValueError, match="no batch was profiled out of 2"):
        profile_batches([{"t0": [1]}] * 2, TABLES, 0.001, 0, batch_size=1)


def test_hot_rows_and_skew_on_a_zipf_trace() -> None:
    tables = {"z": TableInfo(num_rows=20_000, dim=16)}
    batches = zipf_batches(11, 20_000, 1.2, 2048, 30)
    profile = profile_batches(
        ({"z": b} for b in batches), tables, 1.0, 0, batch_size=512, config=ProfilerConfig(top_k=50)
    )["z"]
    ids, counts = np.unique(np.concatenate(batches), return_counts=True)
    order = np.lexsort((ids, -counts))
    total = counts.sum()
    assert profile.hot_rows == tuple(ids[order][:50].tolist())
    assert profile.hot_row_shares == pytest.approx(tuple(counts[order][:50] / total))
    assert profile.hot_row_shares[0] > 0.1  # the trace really is skewed
    cum = np.cumsum(counts[order]) / total
    for frac, share in profile.access_skew[1:-1]:
        assert share == pytest.approx(cum[round(frac * 20_000) - 1])
    # 1% of the rows take far more than 1% of the accesses.
    assert profile.access_share(0.01) > 0.5
    assert profile.access_share(1.0) == 1.0


def test_sparse_counting_matches_dense_counting() -> None:
    batches = [{"t0": b % 100} for b in zipf_batches(2, 100, 1.1, 300, 40)]
    dense = profile_batches(batches, TABLES, 1.0, 0, batch_size=10)
    sparse = profile_batches(
        batches, TABLES, 1.0, 0, batch_size=10, config=ProfilerConfig(dense_count_limit=0)
    )
    assert sparse == dense


def test_profiled_hit_rate_matches_lru_simulator() -> None:
    tables = {"z": TableInfo(num_rows=30_000, dim=16)}
    batches = zipf_batches(12, 30_000, 1.1, 1024, 60)
    profile = profile_batches(({"z": b} for b in batches), tables, 1.0, 0, batch_size=256)["z"]
    assert profile.hit_rate_method is HitRateMethod.EXACT
    for size, rate in profile.hit_rate_curve[1::40]:
        assert rate == lru_hit_rate(batches, size)
    assert profile.hit_rate(0) == 0.0
    assert profile.hit_rate(10**9) == profile.max_hit_rate == lru_hit_rate(batches, 30_000)
    probes = np.linspace(0, profile.hit_rate_curve[-1][0] * 1.2, 500)
    values = [profile.hit_rate(float(c)) for c in probes]
    assert np.all(np.diff(values) >= 0)
    # Between curve points the interpolation stays within the neighbouring exact values.
    (lo, r_lo), (hi, r_hi) = profile.hit_rate_curve[100], profile.hit_rate_curve[101]
    mid = (lo + hi) // 2
    assert r_lo <= profile.hit_rate(mid) <= r_hi
    assert profile.miss_rows_per_sample(0) == pytest.approx(profile.unique_per_sample)


def test_shards_profile_tracks_the_exact_one() -> None:
    tables = {"z": TableInfo(num_rows=200_000, dim=16)}
    batches = [{"z": b} for b in zipf_batches(5, 200_000, 1.05, 1024, 200)]
    exact = profile_batches(batches, tables, 1.0, 0, batch_size=256)["z"]
    cfg = ProfilerConfig(hit_rate_method=HitRateMethod.SHARDS, shards_rate=0.1)
    sampled = profile_batches(batches, tables, 1.0, 0, batch_size=256, config=cfg)["z"]
    assert sampled.hit_rate_method is HitRateMethod.SHARDS
    # Everything but the curve is computed from all ids either way.
    assert sampled.hot_rows == exact.hot_rows and sampled.unique_ratio == exact.unique_ratio
    sizes = [s for s, _ in exact.hit_rate_curve[1::10]]
    err = max(abs(sampled.hit_rate(s) - exact.hit_rate(s)) for s in sizes)
    assert err <= 0.025
    # Fewer profiled batches than the SHARDS warm-up still give a curve.
    short = profile_batches(batches[:3], tables, 1.0, 0, batch_size=256, config=cfg)["z"]
    assert 0.0 <= short.max_hit_rate < 1.0 and short.hit_rate(0) == 0.0


def test_a_rejected_batch_leaves_no_partial_statistics() -> None:
    profiler = Profiler(TABLES, FEATURES, ALL, batch_size=1)
    profiler.observe({"t0": [1, 2], "t1": [3]})
    with pytest.raises(ValueError, match="table 't1'"):
        profiler.observe({"t0": [7, 7, 7], "t1": [50]})
    profile = profiler.finish()
    assert profile.batches_profiled == 1
    assert profile["t0"].hot_rows == (1, 2) and profile["t0"].accesses_per_sample == 2.0


def test_policy_curves_are_those_of_the_profiled_trace() -> None:
    # t1 has no lookups in batches 1 and 4: its trace keeps them as empty batches, so its
    # windows span the same batches as t0's.
    t0 = zipf_batches(3, 100, 1.2, 64, 12)
    t1 = zipf_batches(4, 50, 1.1, 16, 12)
    batches = [
        {"t0": a, "t1": b} if i not in (1, 4) else {"t0": a} for i, (a, b) in enumerate(zip(t0, t1))
    ]
    cfg = ProfilerConfig(lookahead=1, policy_curve_points=6)
    profile = profile_batches(batches, TABLES, 1.0, 0, batch_size=8, config=cfg)
    for name, ids in (("t0", t0), ("t1", [b if i not in (1, 4) else [] for i, b in enumerate(t1)])):
        want = replacement.policy_curves(replacement.BatchTrace.from_batches(ids), 1, 6)
        assert profile[name].policy_curves == want
    curves = profile["t1"].policy_curves
    assert curves is not None and curves.lookahead == 1 and len(curves.optimal) == 6
    # Every policy ends at the cold misses alone, and MIN is the best of them.
    assert curves.optimal[-1][1] == profile["t1"].max_hit_rate
    for rows, best in curves.optimal:
        assert best >= profile["t1"].hit_rate(rows) - 1e-12
        for policy in ("lfu", "min_seen_ahead"):
            rate = profile["t1"].policy_hit_rate(policy, rows)
            assert rate is not None and best >= rate - 1e-12
    assert profile["t1"].policy_hit_rate("min", curves.min_cache_rows - 1) is None


def test_policy_curves_only_from_the_exact_trace() -> None:
    batches = [{"t0": b} for b in zipf_batches(5, 100, 1.1, 32, 10)]
    shards = ProfilerConfig(hit_rate_method=HitRateMethod.SHARDS)
    off = ProfilerConfig(policy_curves=False)
    for cfg in (shards, off):
        profile = profile_batches(batches, TABLES, 1.0, 0, batch_size=4, config=cfg)["t0"]
        assert profile.policy_curves is None and profile.policy_hit_rate("min", 50) is None
        assert profile.policy_hit_rate("lru", 50) == profile.hit_rate(50)
    for bad in ({"lookahead": -1}, {"policy_curve_points": 1}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ProfilerConfig(**bad)  # type: ignore[arg-type]
