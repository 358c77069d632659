"""The profile PNG: which tables get a line, the summary of the rest, and a readable layout."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from lru_reference import zipf_batches
from matplotlib.figure import Figure
from matplotlib.image import imread
from matplotlib.lines import Line2D

from torchrec_mtrains.profiler import (
    AccessProfile,
    TableInfo,
    TableProfile,
    plot_profile,
    profile_batches,
    uniform_profile,
)
from torchrec_mtrains.profiler.plot import DEFAULT_MAX_TABLES, profile_figure, tables_to_show

# 26 tables of the default model's sizes (the Criteo Kaggle cardinalities, capped at 1M).
SIZES = [1460, 583, 1_000_000, 500_000, 305, 24, 12517, 633, 3, 93145, 5683, 900_000, 3194]
SIZES += [27, 14992, 450_000, 10, 5652, 2173, 4, 800_000, 18, 15, 286181, 105, 142572]


def _profile(tables: dict[str, TableProfile]) -> AccessProfile:
    return AccessProfile(
        tables, sampling_rate=1.0, seed=0, batches_seen=8, batches_profiled=8, batch_size=64
    )


@pytest.fixture(scope="module")
def profile26() -> AccessProfile:
    """26 measured tables, each with its own Zipf exponent, so no two curves coincide."""
    names = [f"t_cat_{i}" for i in range(len(SIZES))]
    alphas = np.linspace(1.05, 1.6, len(SIZES))
    ids = {
        name: zipf_batches(i, n, float(a), 256, 8)
        for i, (name, n, a) in enumerate(zip(names, SIZES, alphas))
    }
    batches = [{name: ids[name][b] for name in names} for b in range(8)]
    tables = {name: TableInfo(num_rows=n, dim=16) for name, n in zip(names, SIZES)}
    return profile_batches(batches, tables, 1.0, 0, batch_size=64)


def _legend_labels(fig: Figure) -> list[str]:
    assert len(fig.legends) == 1, "one legend for both panels"
    return [text.get_text() for text in fig.legends[0].get_texts()]


def _other_lines(fig: Figure) -> list[Line2D]:
    return [line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == "other"]


def test_26_tables_show_the_largest_and_summarize_the_rest(
    profile26: AccessProfile, tmp_path: Path
) -> None:
    fig = profile_figure(profile26)
    labels = _legend_labels(fig)
    assert len(labels) <= DEFAULT_MAX_TABLES + 1
    assert len(labels) == DEFAULT_MAX_TABLES + 1  # distinct curves: one entry per table
    largest = sorted(profile26.tables, key=lambda name: -profile26[name].num_rows)
    for name, label in zip(largest[:DEFAULT_MAX_TABLES], labels):
        assert label.startswith(f"{name}: ")
    assert labels[-1].startswith(f"other {26 - DEFAULT_MAX_TABLES} tables, 3-15k rows")
    assert len(_other_lines(fig)) == 2  # the summary curve on the hit-rate and skew panels
    hit_ax, policy_ax, skew_ax = fig.axes
    for ax in (hit_ax, skew_ax):
        colors = [line.get_color() for line in ax.get_lines() if line.get_gid() != "other"]
        assert len(colors) == DEFAULT_MAX_TABLES and len(set(colors)) == DEFAULT_MAX_TABLES
    # The policy panel: each shown table's LRU, LFU and MIN, in its colour.
    by_policy = {
        p: [line for line in policy_ax.get_lines() if line.get_gid() == p]
        for p in ("lru", "lfu", "min")
    }
    assert all(len(lines) == DEFAULT_MAX_TABLES for lines in by_policy.values())
    assert [line.get_color() for line in by_policy["min"]] == colors
    assert [t.get_text() for t in policy_ax.get_legend().get_texts()] == [
        "LRU",
        "LFU",
        "MIN (Belady's optimal)",
    ]
    # The legend lies outside both panels, so it hides no curve.
    fig.canvas.draw()
    box = fig.legends[0].get_window_extent()
    assert not any(box.overlaps(ax.get_window_extent()) for ax in fig.axes)

    path = plot_profile(profile26, tmp_path / "profile.png", max_tables=4)
    image = imread(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert image.ndim == 3 and image.shape[0] > 500 and image.shape[1] > 1000
    assert float(image[..., :3].std()) > 0.05  # something was drawn, not a blank canvas
    assert len(_legend_labels(profile_figure(profile26, max_tables=4))) == 5


def test_one_table_has_one_entry_and_no_summary(profile26: AccessProfile) -> None:
    one = _profile({"t_cat_9": profile26["t_cat_9"]})
    fig = profile_figure(one)
    pooling = one["t_cat_9"].accesses_per_sample
    assert _legend_labels(fig) == [f"t_cat_9: 93.1k rows, {pooling:.3g} ids/sample"]
    assert not _other_lines(fig)
    hit_ax, policy_ax, skew_ax = fig.axes
    assert len(hit_ax.get_lines()) == len(skew_ax.get_lines()) == 1
    assert [line.get_gid() for line in policy_ax.get_lines()] == ["lru", "lfu", "min"]


def test_policy_lines_are_the_profile_curves(profile26: AccessProfile) -> None:
    table = profile26["t_cat_9"]
    curves = table.policy_curves
    assert curves is not None
    fig = profile_figure(_profile({"t_cat_9": table}))
    lines = {line.get_gid(): line for line in fig.axes[1].get_lines()}
    xs, ys = (np.asarray(v, dtype=float) for v in lines["min"].get_data())
    assert xs.tolist() == [x / table.num_rows for x, _ in curves.optimal]
    assert ys.tolist() == [y for _, y in curves.optimal]
    xs, ys = (np.asarray(v, dtype=float) for v in lines["lru"].get_data())
    assert xs[0] == curves.min_cache_rows / table.num_rows  # from where a window fits
    assert ys[0] == pytest.approx(table.hit_rate(curves.min_cache_rows))


def test_a_profile_without_policy_curves_has_two_panels(profile26: AccessProfile) -> None:
    old = dataclasses.replace(profile26["t_cat_9"], policy_curves=None)
    fig = profile_figure(_profile({"t_cat_9": old}))
    assert len(fig.axes) == 2 and all(len(ax.get_lines()) == 1 for ax in fig.axes)


def test_the_busiest_table_is_shown_though_small() -> None:
    tables = {
        f"big_{i}": uniform_profile(f"big_{i}", TableInfo(num_rows=10_000 * (i + 1), dim=8))
        for i in range(12)
    }
    tables["busy"] = uniform_profile("busy", TableInfo(num_rows=50, dim=8), accesses_per_sample=50)
    shown, rest = tables_to_show(_profile(tables), max_tables=3)
    assert [t.name for t in shown] == ["big_11", "big_10", "busy"]
    assert len(rest) == 10 and "busy" not in {t.name for t in rest}


@pytest.mark.parametrize("bad", [0, 10, True])
def test_max_tables_outside_the_palette_is_refused(profile26: AccessProfile, bad: int) -> None:
    with pytest.raises(ValueError, match=rf"max_tables must be an int in \[1, 9\], got {bad!r}"):
        tables_to_show(profile26, bad)


def test_coinciding_curves_share_one_line_and_entry() -> None:
    tables = {
        name: uniform_profile(name, TableInfo(num_rows=n, dim=8))
        for name, n in [("a", 1_000), ("b", 2_000), ("c", 3_000)]
    }
    fig = profile_figure(_profile(tables))
    assert _legend_labels(fig) == [
        "c, b, a (same curves): 1k-3k rows, 1 ids/sample (assumed uniform)"
    ]
    assert all(len(ax.get_lines()) == 1 for ax in fig.axes)
    assert fig.axes[0].get_lines()[0].get_linestyle() == "--"  # assumed: dashed


def test_the_summary_curve_is_the_access_weighted_mean(profile26: AccessProfile) -> None:
    measured = profile26["t_cat_0"]  # 1460 rows
    assumed = uniform_profile("u", TableInfo(num_rows=700, dim=8), accesses_per_sample=3.0)
    big = uniform_profile("big", TableInfo(num_rows=10**6, dim=8))
    fig = profile_figure(_profile({m.name: m for m in (measured, assumed, big)}), max_tables=1)
    assert _legend_labels(fig)[-1].startswith("other 2 tables, 700-1.46k rows, 1 assumed uniform")
    hit_line, skew_line = _other_lines(fig)
    xs, ys = (np.asarray(v, dtype=float) for v in skew_line.get_data())
    assert xs[-1] == pytest.approx(1.0) and ys[-1] == pytest.approx(1.0)
    for i in (0, 50, 120, 199):
        a_m = measured.accesses_per_sample
        want = (a_m * measured.access_share(xs[i]) + 3.0 * xs[i]) / (a_m + 3.0)
        assert ys[i] == pytest.approx(want)
    xs, ys = (np.asarray(v, dtype=float) for v in hit_line.get_data())
    w_m, w_u = measured.unique_per_sample, assumed.unique_per_sample
    for i in (0, 80, 199):
        want = (w_m * measured.hit_rate(xs[i] * 1460) + w_u * assumed.hit_rate(xs[i] * 700)) / (
            w_m + w_u
        )
        assert ys[i] == pytest.approx(want)


def test_plot_writes_a_valid_png_with_measured_and_assumed_tables(
    profile26: AccessProfile, tmp_path: Path
) -> None:
    tables = {name: profile26[name] for name in ("t_cat_2", "t_cat_3")}
    tables["cold"] = uniform_profile("cold", TableInfo(num_rows=10_000, dim=8))
    path = plot_profile(_profile(tables), tmp_path / "profile.png")
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n" and len(raw) > 10_000
    image = imread(path)
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 600
    assert float(image[..., :3].std()) > 0.05
    # A uniform profile has only its two end points; it is still drawn as a curve.
    fig = profile_figure(_profile(tables))
    cold = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"]
    assert len(cold) == 1 and np.asarray(cold[0].get_xdata()).size > 50
