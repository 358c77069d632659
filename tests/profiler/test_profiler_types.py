"""Profile value types: JSON round trip, version refusal, uniform fallback."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
from lru_reference import zipf_batches

from torchrec_mtrains.profiler import (
    PROFILE_VERSION,
    AccessProfile,
    HitRateMethod,
    PolicyCurves,
    ProfileFormatError,
    ProfileSource,
    ReplacementPolicy,
    TableInfo,
    TableProfile,
    profile_batches,
    uniform_profile,
)

TABLES = {
    "small": TableInfo(num_rows=5_000, dim=16),
    "large": TableInfo(num_rows=200_000, dim=64, element_bytes=2),
}


@pytest.fixture(scope="module")
def profile() -> AccessProfile:
    small = zipf_batches(1, 5_000, 1.2, 512, 40)
    large = zipf_batches(2, 200_000, 1.05, 256, 40)
    batches = [{"small": s, "large": g} for s, g in zip(small, large)]
    return profile_batches(batches, TABLES, 0.5, 0, batch_size=128)


def test_json_round_trip_is_lossless(profile: AccessProfile, tmp_path: Path) -> None:
    path = profile.to_json(tmp_path / "profile.json")
    data = json.loads(path.read_text())
    assert data["version"] == PROFILE_VERSION and set(data["tables"]) == {"small", "large"}
    loaded = AccessProfile.from_json(path)
    assert loaded == profile
    assert loaded["large"].hit_rate(1234.5) == profile["large"].hit_rate(1234.5)
    assert isinstance(loaded["small"].hit_rate_curve[3][0], int)
    assert not list(tmp_path.glob("*.tmp"))


def test_unknown_version_is_refused_naming_the_file(profile: AccessProfile, tmp_path: Path) -> None:
    path = profile.to_json(tmp_path / "future.json")
    data = json.loads(path.read_text())
    data["version"] = PROFILE_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileFormatError, match=rf"{path}.*version {PROFILE_VERSION + 1}"):
        AccessProfile.from_json(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"format": "something else", "version": 1}', "not a torchrec_mtrains.access_profile"),
        ('{"format": "torchrec_mtrains.access_profile", "version": 1}', "invalid access profile"),
    ],
)
def test_malformed_files_are_refused_naming_the_file(
    tmp_path: Path, content: str, message: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileFormatError, match=message) as info:
        AccessProfile.from_json(path)
    assert str(path) in str(info.value)


def test_uniform_fallback_is_labelled_and_linear(profile: AccessProfile) -> None:
    info = TableInfo(num_rows=1_000, dim=32)
    assumed = uniform_profile("cold", info, accesses_per_sample=3.0)
    assert assumed.source is ProfileSource.ASSUMED_UNIFORM
    assert assumed.hit_rate_method is HitRateMethod.UNIFORM
    for rows in (0, 1, 250, 999, 1_000):
        assert assumed.hit_rate(rows) == pytest.approx(rows / 1_000)
    assert assumed.hit_rate(5_000) == 1.0
    assert assumed.bytes_per_sample == 3.0 * 32 * 4
    assert assumed.access_share(0.3) == pytest.approx(0.3)
    # The planner's lookup: measured where a profile exists, the labelled guess elsewhere.
    assert profile.table_or_uniform("small", TABLES["small"]) is profile["small"]
    fallback = profile.table_or_uniform("cold", info, accesses_per_sample=2.0)
    assert fallback.source is ProfileSource.ASSUMED_UNIFORM
    assert "cold" not in profile and "small" in profile
    with pytest.raises(KeyError, match="no profile for table 'cold'"):
        profile["cold"]


def test_uniform_unique_ratio_is_the_expected_distinct_fraction() -> None:
    rng = np.random.default_rng(0)
    info = TableInfo(num_rows=500, dim=8)
    assumed = uniform_profile("u", info, accesses_per_sample=2.0, batch_size=300)
    draws = [len(np.unique(rng.integers(0, 500, 600))) / 600 for _ in range(400)]
    assert assumed.unique_ratio == pytest.approx(np.mean(draws), abs=0.003)
    one_row = uniform_profile("one", TableInfo(num_rows=1, dim=8), batch_size=10)
    assert one_row.unique_ratio == pytest.approx(0.1)
    assert uniform_profile("u", info).unique_ratio == 1.0


def test_round_trip_of_the_uniform_profile(tmp_path: Path) -> None:
    tables = {"u": uniform_profile("u", TableInfo(num_rows=77, dim=3), batch_size=5)}
    original = AccessProfile(
        tables, sampling_rate=1.0, seed=0, batches_seen=0, batches_profiled=0, batch_size=5
    )
    assert AccessProfile.from_json(original.to_json(tmp_path / "u.json")) == original


def test_invalid_profiles_are_rejected(profile: AccessProfile) -> None:
    good = profile["small"].to_dict()
    for key, value, message in [
        ("hit_rate_curve", [[1, 0.5]], "start at"),
        ("hit_rate_curve", [[0, 0.0], [10, 0.5], [20, 0.4]], "non-decreasing"),
        ("hit_rate_curve", [[0, 0.0], [10, 0.5], [10, 0.6]], "strictly increasing"),
        ("hot_row_shares", [0.5], "hot rows but"),
        ("unique_ratio", 1.5, "unique_ratio"),
        ("source", "guessed", "guessed"),
        ("accesses_per_sample", math.inf, "finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            TableProfile.from_dict({**good, key: value})
    with pytest.raises(ValueError, match="stored under key"):
        AccessProfile({"x": profile["small"]}, 1.0, 0, 1, 1, 1)
    with pytest.raises(ValueError, match="positive int"):
        TableInfo(num_rows=0, dim=4)


def test_policy_curves_round_trip_and_old_profiles_load(
    profile: AccessProfile, tmp_path: Path
) -> None:
    large = profile["large"]
    curves = large.policy_curves
    assert curves is not None and curves.lookahead == 2 and curves.optimal
    data = json.loads(profile.to_json(tmp_path / "p.json").read_text())
    assert set(data["tables"]["large"]["policy_curves"]) == {
        "lookahead",
        "min_cache_rows",
        "lfu_decay_interval",
        "min",
        "min_seen_ahead",
        "lfu",
    }
    # A profile written before the curves: it loads, has none, and LRU reads as before.
    for table in data["tables"].values():
        del table["policy_curves"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    old = AccessProfile.from_json(tmp_path / "old.json")["large"]
    assert old.policy_curves is None and old.policy_hit_rate("min", 5_000) is None
    assert old == dataclasses.replace(large, policy_curves=None)
    assert old.policy_hit_rate("lru", 5_000) == large.hit_rate(5_000)
    # Interpolated between points; nothing below the smallest cache that runs the trace.
    (x0, y0), (x1, y1) = curves.optimal[:2]
    assert large.policy_hit_rate("min", (x0 + x1) / 2) == pytest.approx((y0 + y1) / 2)
    assert large.policy_hit_rate(ReplacementPolicy.MIN, x0 - 1) is None
    assert large.policy_hit_rate("lfu", 10**9) == curves.lfu[-1][1]
    with pytest.raises(ValueError, match="profile's hit_rate_curve"):
        curves.curve("lru")


def test_invalid_policy_curves_are_rejected(profile: AccessProfile) -> None:
    good = profile["small"].policy_curves
    assert good is not None
    lowest = good.min_cache_rows
    for change, message in [
        ({"optimal": ((lowest, 0.5), (lowest + 9, 0.4))}, "non-decreasing"),
        ({"lfu": ((lowest - 1, 0.5),)}, "increase strictly from"),
        ({"seen_ahead": ((lowest, 1.5),)}, r"within \[0, 1\]"),
        ({"lookahead": -1}, "lookahead"),
    ]:
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(good, **change)  # type: ignore[arg-type]
    # LFU is no stack algorithm: a larger cache may hit less, and the curve may say so.
    dip = ((lowest, 0.5), (lowest + 9, 0.4))
    assert dataclasses.replace(good, lfu=dip).hit_rate("lfu", lowest + 9) == 0.4
    assert PolicyCurves.from_dict(good.to_dict()) == good
