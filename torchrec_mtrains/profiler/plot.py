"""PNG summary of an access profile: hit-rate curves and access skew of the tables that matter.

A model can have dozens of tables, most of them small enough to sit in the fastest tier whatever
their access pattern. The plot draws the few that decide a tiered plan, each in its own colour,
and folds the rest into one access-weighted curve with their range shaded, so the picture stays
readable for 1 table and for 26. Where the profile has policy curves, a middle panel sets each
drawn table's LRU, LFU and MIN (Belady's optimal) curves side by side.

Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it is safe on
headless machines and inside processes that use another backend.
"""

from __future__ import annotations

import logging
import os
import re
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from matplotlib.artist import Artist
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.lines import Line2D

from torchrec_mtrains.profiler.types import (
    AccessProfile,
    PolicyCurves,
    ProfileSource,
    ReplacementPolicy,
    TableProfile,
)

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_TABLES", "plot_profile", "profile_figure", "tables_to_show"]

# tab10 without its grey, which is kept for the summary of the other tables.
_COLORS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
)
_OTHER_COLOR = "#555555"
DEFAULT_MAX_TABLES = 8
"""Tables drawn one by one; more lines than this cannot be told apart by colour."""
_SAME_CURVE_TOLERANCE = 0.01
"""Curves closer than this everywhere look like one line, so they get one legend entry."""
_POLICY_STYLES: tuple[tuple[ReplacementPolicy, Literal["-", "-.", ":"], str], ...] = (
    (ReplacementPolicy.LRU, "-", "LRU"),
    (ReplacementPolicy.LFU, "-.", "LFU"),
    (ReplacementPolicy.MIN, ":", "MIN (Belady's optimal)"),
)
"""The policy panel's line style of each policy, and its name in the panel's key."""


def _footprint(table: TableProfile) -> int:
    return table.num_rows * table.row_bytes


def _name_key(name: str) -> tuple[str | int, ...]:
    """``t_cat_2`` before ``t_cat_11``."""
    return tuple(int(p) if i % 2 else p for i, p in enumerate(re.split(r"(\d+)", name)))


def tables_to_show(
    profile: AccessProfile, max_tables: int = DEFAULT_MAX_TABLES
) -> tuple[list[TableProfile], list[TableProfile]]:
    """Splits the tables into those drawn one by one and the rest, summarized.

    Picks alternately the largest remaining table (bytes of weights) and the most accessed
    one (bytes looked up per sample): the large tables are the ones a plan must spread over
    slower tiers, the busy ones those whose caches carry the most traffic. When every table
    is accessed alike, this is simply the largest ``max_tables``.

    Args:
        profile: the profile.
        max_tables: most tables to draw one by one, 1 to 9 (one distinct colour each).

    Returns:
        ``(shown, rest)``: the shown tables largest first, the rest in name order.

    Raises:
        ValueError: if ``max_tables`` is outside ``[1, 9]``.
    """
    if isinstance(max_tables, bool) or not 1 <= max_tables <= len(_COLORS):
        raise ValueError(f"max_tables must be an int in [1, {len(_COLORS)}], got {max_tables!r}")
    tables = list(profile.tables.values())
    by_size = sorted(tables, key=lambda t: (-_footprint(t), -t.bytes_per_sample, _name_key(t.name)))
    by_traffic = sorted(
        tables, key=lambda t: (-t.bytes_per_sample, -_footprint(t), _name_key(t.name))
    )
    chosen: dict[str, TableProfile] = {}
    for pair in zip(by_size, by_traffic):
        for table in pair:
            if len(chosen) < max_tables:
                chosen.setdefault(table.name, table)
    shown = sorted(chosen.values(), key=lambda t: (-_footprint(t), _name_key(t.name)))
    rest = [t for t in tables if t.name not in chosen]
    return shown, rest


def _rows(n: int) -> str:
    for unit, scale in (("M", 1_000_000), ("k", 1_000)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def _span(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    low, high = fmt(min(values)), fmt(max(values))
    return low if low == high else f"{low}-{high}"


def _label(group: Sequence[TableProfile]) -> str:
    names = textwrap.fill(", ".join(t.name for t in group), width=48)
    label = (
        f"{names}{' (same curves)' if len(group) > 1 else ''}: "
        f"{_span([t.num_rows for t in group], lambda n: _rows(int(n)))} rows, "
        f"{_span([t.accesses_per_sample for t in group], lambda a: f'{a:.3g}')} ids/sample"
    )
    if group[0].source is ProfileSource.ASSUMED_UNIFORM:
        label += " (assumed uniform)"
    return label


def _coincide(a: TableProfile, b: TableProfile) -> bool:
    """Whether the two tables' curves would be drawn on top of each other."""
    if a.source is not b.source:
        return False
    fractions = np.logspace(-np.log10(max(a.num_rows, b.num_rows)), 0.0, 64)
    return all(
        abs(curve(a, float(f)) - curve(b, float(f))) <= _SAME_CURVE_TOLERANCE
        for curve in (_hit_rate_at_fraction, _share_at_fraction)
        for f in fractions
    )


def _groups(shown: Sequence[TableProfile]) -> list[list[TableProfile]]:
    """The shown tables, those with coinciding curves together (one line, one legend entry)."""
    groups: list[list[TableProfile]] = []
    for table in shown:
        for group in groups:
            if _coincide(group[0], table):
                group.append(table)
                break
        else:
            groups.append([table])
    return groups


def _combined(
    rest: Sequence[TableProfile],
    fractions: np.ndarray[Any, np.dtype[np.float64]],
    curve: Callable[[TableProfile, float], float],
    weight: Callable[[TableProfile], float],
) -> tuple[np.ndarray[Any, np.dtype[np.float64]], ...]:
    """Weighted mean, minimum and maximum over ``rest`` of ``curve(table, fraction)``."""
    ys = np.array([[curve(t, float(f)) for f in fractions] for t in rest])
    weights = np.array([weight(t) for t in rest], dtype=np.float64)
    if weights.sum() <= 0.0:
        weights = np.ones_like(weights)
    return (weights @ ys) / weights.sum(), ys.min(axis=0), ys.max(axis=0)


def _hit_rate_at_fraction(table: TableProfile, fraction: float) -> float:
    return table.hit_rate(fraction * table.num_rows)


def _share_at_fraction(table: TableProfile, fraction: float) -> float:
    return table.access_share(fraction)


def _on_log_axis(
    table: TableProfile,
    points: Sequence[tuple[float, float]],
    curve: Callable[[TableProfile, float], float],
) -> tuple[np.ndarray[Any, np.dtype[np.float64]], list[float]]:
    """``curve(table, fraction)`` on a log x axis, from one row to the last of ``points``.

    The profile's curves are interpolated linearly between their points (what the planner
    reads); far-apart points, such as the two ends of a uniform profile, need points between
    them to be drawn as that on a log axis, and ``(0, 0)`` cannot be drawn at all.
    """
    last = points[-1][0]
    if last <= 0.0:
        return np.empty(0), []
    grid = np.logspace(np.log10(min(1.0 / table.num_rows, last)), np.log10(last), 100)
    xs = np.union1d([x for x, _ in points if x > 0.0], grid)
    return xs, [curve(table, float(x)) for x in xs]


def _draw_rest(
    ax: Axes,
    rest: Sequence[TableProfile],
    curve: Callable[[TableProfile, float], float],
    weight: Callable[[TableProfile], float],
) -> tuple[Artist, Artist]:
    smallest = min(1.0 / t.num_rows for t in rest)
    fractions = np.logspace(np.log10(smallest), 0.0, 200)
    mean, low, high = _combined(rest, fractions, curve, weight)
    band = ax.fill_between(fractions, low, high, color=_OTHER_COLOR, alpha=0.15, linewidth=0)
    (line,) = ax.plot(fractions, mean, color=_OTHER_COLOR, linewidth=2.2, linestyle="-.")
    line.set_gid("other")
    return band, line


def _draw_policies(ax: Axes, table: TableProfile, curves: PolicyCurves, color: str) -> None:
    """``table``'s LRU, LFU and MIN curves against the cache size as a fraction of its rows,
    from the smallest cache that holds a look-ahead window on (below it no policy runs)."""
    start = curves.min_cache_rows
    for policy, style, _ in _POLICY_STYLES:
        if policy is ReplacementPolicy.LRU:
            points = [(x, y) for x, y in table.hit_rate_curve if x > start]
            points.insert(0, (start, table.hit_rate(start)))
        else:
            points = list(curves.curve(policy))
        if start > 0 and points:
            xs = [x / table.num_rows for x, _ in points]
            line = ax.plot(xs, [y for _, y in points], style, color=color, linewidth=1.4)[0]
            line.set_gid(policy.value)


def profile_figure(profile: AccessProfile, *, max_tables: int = DEFAULT_MAX_TABLES) -> Figure:
    """The figure :func:`plot_profile` writes: two or three panels and one legend below them.

    Left, the LRU hit rate against the cache size as a fraction of the table's rows; right,
    the share of accesses that go to the hottest fraction of the rows. Both x axes are
    logarithmic, so tables of very different sizes share a panel. Between them, when the
    drawn tables have policy curves, the same hit rate for LRU, LFU and MIN, each table in
    its colour and each policy in its line style, from the smallest cache that holds the
    rows of the look-ahead pipeline's batches in flight. The tables of
    :func:`tables_to_show` get a line each (dashed where the profile is an assumption;
    tables whose curves coincide share one line and one legend entry). The others are one
    dash-dotted grey line, their mean weighted by lookups (hit rate) or ids (skew) per
    sample, that is the hit rate or share of all of them together when each caches the same
    fraction of its rows, with the band from their lowest to their highest.

    Args:
        profile: the profile to draw.
        max_tables: most tables drawn one by one (see :func:`tables_to_show`).

    Returns:
        A figure on an Agg canvas.
    """
    shown, rest = tables_to_show(profile, max_tables)
    groups = _groups(shown)
    policies = [g[0].policy_curves for g in groups if g[0].policy_curves is not None]
    fig = Figure(figsize=(18 if policies else 12, 6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = list(fig.subplots(1, 3 if policies else 2))
    hit_ax, skew_ax = axes[0], axes[-1]
    # Artists, and (band, line) pairs that HandlerTuple draws as one entry.
    handles: list[Any] = []
    labels: list[str] = []
    for group, color in zip(groups, _COLORS):
        table = group[0]
        if table.policy_curves is not None:
            _draw_policies(axes[1], table, table.policy_curves, color)
        style: Literal["--", "-"] = "--" if table.source is ProfileSource.ASSUMED_UNIFORM else "-"
        curve = [(rows / table.num_rows, rate) for rows, rate in table.hit_rate_curve]
        for ax, points, at in (
            (hit_ax, curve, _hit_rate_at_fraction),
            (skew_ax, table.access_skew, _share_at_fraction),
        ):
            xs, ys = _on_log_axis(table, points, at)
            if len(xs):
                ax.plot(xs, ys, style, color=color, linewidth=1.8)
        handles.append(Line2D([], [], color=color, linestyle=style, linewidth=1.8))
        labels.append(_label(group))
    if rest:
        _draw_rest(hit_ax, rest, _hit_rate_at_fraction, lambda t: t.unique_per_sample)
        band, line = _draw_rest(skew_ax, rest, _share_at_fraction, lambda t: t.accesses_per_sample)
        assumed = sum(t.source is ProfileSource.ASSUMED_UNIFORM for t in rest)
        sizes = sorted(t.num_rows for t in rest)
        label = (
            f"other {len(rest)} tables, {_rows(sizes[0])}-{_rows(sizes[-1])} rows"
            + (f", {assumed} assumed uniform" if assumed else "")
            + ":\naccess-weighted mean, band = min to max"
        )
        handles.append((band, line))
        labels.append(label)
    hit_ax.set(
        xscale="log",
        xlabel="cache size (fraction of the table's rows)",
        ylabel="LRU hit rate",
        ylim=(0.0, 1.02),
        title="hit rate vs cache size",
    )
    skew_ax.set(
        xscale="log",
        xlabel="hottest rows (fraction of the table's rows)",
        ylabel="cumulative share of accesses",
        ylim=(0.0, 1.02),
        title="access skew",
    )
    if policies:
        lookaheads = "/".join(str(k) for k in sorted({c.lookahead for c in policies}))
        axes[1].set(
            xscale="log",
            xlabel="cache size (fraction of the table's rows)",
            ylabel="hit rate",
            ylim=(0.0, 1.02),
            title=f"hit rate by replacement policy (look-ahead {lookaheads})",
        )
        axes[1].legend(
            [Line2D([], [], color="black", linestyle=style) for _, style, _ in _POLICY_STYLES],
            [name for _, _, name in _POLICY_STYLES],
            loc="lower right",
            fontsize="small",
        )
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
    if handles:
        title = (
            f"{len(shown)} of {len(profile.tables)} tables: largest and most accessed"
            if rest
            else f"{len(shown)} table{'s' if len(shown) > 1 else ''}"
        )
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncols=min(2, len(handles)),
            title=title,
            fontsize="small",
            title_fontsize="small",
            handler_map={tuple: HandlerTuple(ndivide=1)},
        )
    fig.suptitle(
        f"access profile: {profile.batches_profiled} of {profile.batches_seen} batches "
        f"(sampling rate {profile.sampling_rate:g}, batch size {profile.batch_size})"
    )
    return fig


def plot_profile(
    profile: AccessProfile,
    path: str | os.PathLike[str],
    *,
    max_tables: int = DEFAULT_MAX_TABLES,
    dpi: int = 120,
) -> Path:
    """Writes :func:`profile_figure` as a PNG.

    Args:
        profile: the profile to draw.
        path: where the PNG goes.
        max_tables: most tables drawn one by one; the others are summarized in one curve.
        dpi: resolution.

    Returns:
        The path written.
    """
    out = Path(path)
    profile_figure(profile, max_tables=max_tables).savefig(out, format="png", dpi=dpi)
    logger.info("wrote access profile plot to %s", out)
    return out
