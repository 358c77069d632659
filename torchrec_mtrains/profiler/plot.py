"""PNG summary of an access profile: hit-rate curves and access skew of every table.

Uses matplotlib's Agg canvas directly (no pyplot, no global backend switch), so it is safe on
headless machines and inside processes that use another backend.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from torchrec_mtrains.profiler.types import AccessProfile, ProfileSource

logger = logging.getLogger(__name__)

__all__ = ["plot_profile"]


def plot_profile(profile: AccessProfile, path: str | os.PathLike[str], *, dpi: int = 120) -> Path:
    """Writes a two-panel PNG: LRU hit rate vs cache size, and access skew, one line per table.

    Cache size is shown as a fraction of the table's rows on a log axis, so tables of very
    different sizes share one panel. Assumed (uniform) profiles are drawn dashed.

    Args:
        profile: the profile to draw.
        path: where the PNG goes.
        dpi: resolution.

    Returns:
        The path written.
    """
    fig = Figure(figsize=(12, 5), layout="constrained")
    FigureCanvasAgg(fig)
    hit_ax, skew_ax = fig.subplots(1, 2)
    for table in profile.tables.values():
        assumed = table.source is ProfileSource.ASSUMED_UNIFORM
        style = "--" if assumed else "-"
        label = f"{table.name} (assumed)" if assumed else table.name
        # Log x axis: the (0, 0) point cannot be drawn.
        curve = [(rows / table.num_rows, rate) for rows, rate in table.hit_rate_curve if rows > 0]
        if curve:
            hit_ax.plot(*zip(*curve), style, label=label)
        skew = [(frac, share) for frac, share in table.access_skew if frac > 0]
        if skew:
            skew_ax.plot(*zip(*skew), style, label=label)
    hit_ax.set(
        xscale="log",
        xlabel="cache size (fraction of table rows)",
        ylabel="LRU hit rate",
        ylim=(0.0, 1.02),
        title="hit rate vs cache size",
    )
    skew_ax.set(
        xscale="log",
        xlabel="hottest rows (fraction of table rows)",
        ylabel="cumulative share of accesses",
        ylim=(0.0, 1.02),
        title="access skew",
    )
    for ax in (hit_ax, skew_ax):
        ax.grid(True, which="both", alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize="small")
    fig.suptitle(
        f"access profile: {profile.batches_profiled} of {profile.batches_seen} batches "
        f"(sampling rate {profile.sampling_rate:g}, batch size {profile.batch_size})"
    )
    out = Path(path)
    fig.savefig(out, format="png", dpi=dpi)
    logger.info("wrote access profile plot to %s", out)
    return out
