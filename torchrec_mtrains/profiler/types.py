"""Typed access profiles: what the planner reads to size per-table caches and choose tiers.

Every type here is a frozen value made of ints, floats, strings and tuples, so a profile
round-trips through JSON unchanged (``AccessProfile.to_json`` / ``from_json``) and can be built
by hand in tests. A table that was never profiled gets an explicitly labelled uniform-access
assumption from :func:`uniform_profile`, so the planner never mistakes a guess for a measurement.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_VERSION",
    "AccessProfile",
    "HitRateMethod",
    "PolicyCurves",
    "ProfileFormatError",
    "ProfileSource",
    "ReplacementPolicy",
    "TableInfo",
    "TableProfile",
    "uniform_profile",
]

PROFILE_FORMAT = "torchrec_mtrains.access_profile"
PROFILE_VERSION = 1


class ProfileSource(str, enum.Enum):
    """Whether a table's numbers were measured or assumed for lack of a profile."""

    MEASURED = "measured"
    ASSUMED_UNIFORM = "assumed_uniform"


class HitRateMethod(str, enum.Enum):
    """How a hit-rate curve was obtained (see ``profiler.stack_distance``)."""

    EXACT = "exact"
    SHARDS = "shards"
    UNIFORM = "uniform"


class ReplacementPolicy(str, enum.Enum):
    """A cache replacement policy whose hit rates a profile holds (see
    ``profiler.replacement``): the row cache's own ``lru`` and ``lfu``, Belady's optimal
    ``min`` (it knows the whole future: the bound), and ``min_seen_ahead``, MIN that sees only
    the next batches' ids (a policy a pipeline reading that far ahead could run)."""

    LRU = "lru"
    LFU = "lfu"
    MIN = "min"
    MIN_SEEN_AHEAD = "min_seen_ahead"


class ProfileFormatError(ValueError):
    """A profile file is unreadable, malformed, or of a version this code does not know."""


@dataclass(frozen=True)
class TableInfo:
    """What the profiler must know of a table besides its ids.

    Args:
        num_rows: rows in the table; ids must lie in ``[0, num_rows)``.
        dim: embedding dimension.
        element_bytes: bytes per stored weight (4 for fp32, 2 for fp16).
    """

    num_rows: int
    dim: int
    element_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("num_rows", "dim", "element_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"TableInfo.{name} must be a positive int, got {value!r}")

    @property
    def row_bytes(self) -> int:
        """Bytes of one row's weights (optimizer state not included)."""
        return self.dim * self.element_bytes


def _points(raw: Any, what: str, x_type: type[int] | type[float]) -> tuple[tuple[Any, float], ...]:
    pts = tuple((x_type(x), float(y)) for x, y in raw)
    if not pts or pts[0] != (0, 0.0):
        raise ValueError(f"{what} must start at (0, 0.0), got {pts[:1]}")
    xs = np.array([p[0] for p in pts], dtype=np.float64)
    ys = np.array([p[1] for p in pts], dtype=np.float64)
    if np.any(np.diff(xs) <= 0):
        raise ValueError(f"{what} x values must be strictly increasing")
    if np.any(np.diff(ys) < 0) or ys.min() < 0.0 or ys.max() > 1.0:
        raise ValueError(f"{what} y values must be non-decreasing and within [0, 1]")
    return pts


Curve = tuple[tuple[int, float], ...]


def _policy_points(raw: Any, what: str, smallest: int, monotone: bool) -> Curve:
    """A policy curve: ints from ``smallest`` up, strictly increasing, rates in [0, 1]
    (non-decreasing when ``monotone``); empty for a trace without lookups."""
    pts = tuple((int(x), float(y)) for x, y in raw)
    xs = np.array([p[0] for p in pts], dtype=np.float64)
    ys = np.array([p[1] for p in pts], dtype=np.float64)
    if pts and (xs[0] < smallest or np.any(np.diff(xs) <= 0)):
        raise ValueError(f"{what} x values must increase strictly from {smallest} (min_cache_rows)")
    if pts and (ys.min() < 0.0 or ys.max() > 1.0 or (monotone and np.any(np.diff(ys) < 0))):
        order = "non-decreasing and " if monotone else ""
        raise ValueError(f"{what} y values must be {order}within [0, 1]")
    return pts


@dataclass(frozen=True)
class PolicyCurves:
    """Hit-rate curves of the other replacement policies on a table's profiled trace, beside
    its LRU curve, under the look-ahead pipeline's constraint: the rows of the ``lookahead + 1``
    batches in flight stay resident, so no cache smaller than ``min_cache_rows`` can run the
    trace and every curve starts there (see ``profiler.replacement``).

    Args:
        lookahead: batches in flight while one is planned (``pipeline.lookahead``).
        min_cache_rows: the largest window's distinct rows: the smallest cache that runs.
        lfu_decay_interval: batches between two halvings of LFU's counts.
        optimal: sorted ``(cache_rows, hit_rate)`` points of Belady's MIN: the bound.
        seen_ahead: of MIN seeing only the next ``lookahead`` batches.
        lfu: of the row cache's LFU.

    Each curve's last point is a cache holding every row of the trace, where every policy
    reaches the hit rate of the cold misses alone.
    """

    lookahead: int
    min_cache_rows: int
    lfu_decay_interval: int
    optimal: Curve
    seen_ahead: Curve
    lfu: Curve

    def __post_init__(self) -> None:
        for name in ("lookahead", "min_cache_rows", "lfu_decay_interval"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"PolicyCurves.{name} must be an int >= 0, got {value!r}")
        set_ = object.__setattr__
        for name, monotone in (("optimal", True), ("seen_ahead", False), ("lfu", False)):
            points = _policy_points(getattr(self, name), name, self.min_cache_rows, monotone)
            set_(self, name, points)

    def curve(self, policy: ReplacementPolicy | str) -> Curve:
        """The points of ``policy`` (``lru`` is the profile's own curve, not here)."""
        policy = ReplacementPolicy(policy)
        if policy is ReplacementPolicy.LRU:
            raise ValueError("the LRU curve is the profile's hit_rate_curve")
        return {
            ReplacementPolicy.MIN: self.optimal,
            ReplacementPolicy.MIN_SEEN_AHEAD: self.seen_ahead,
            ReplacementPolicy.LFU: self.lfu,
        }[policy]

    def hit_rate(self, policy: ReplacementPolicy | str, cache_rows: float) -> float | None:
        """``policy``'s hit rate with ``cache_rows`` rows, linearly interpolated between points;
        ``None`` below ``min_cache_rows`` (or without points), where the trace cannot run."""
        points = self.curve(policy)
        if not points or cache_rows < points[0][0]:
            return None
        return float(np.interp(float(cache_rows), [p[0] for p in points], [p[1] for p in points]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "lookahead": self.lookahead,
            "min_cache_rows": self.min_cache_rows,
            "lfu_decay_interval": self.lfu_decay_interval,
            "min": [list(p) for p in self.optimal],
            "min_seen_ahead": [list(p) for p in self.seen_ahead],
            "lfu": [list(p) for p in self.lfu],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyCurves:
        return cls(
            lookahead=int(data["lookahead"]),
            min_cache_rows=int(data["min_cache_rows"]),
            lfu_decay_interval=int(data["lfu_decay_interval"]),
            optimal=tuple(tuple(p) for p in data["min"]),
            seen_ahead=tuple(tuple(p) for p in data["min_seen_ahead"]),
            lfu=tuple(tuple(p) for p in data["lfu"]),
        )


@dataclass(frozen=True)
class TableProfile:
    """Access statistics of one table, measured or assumed.

    Args:
        name: table name.
        num_rows: rows in the table.
        dim: embedding dimension.
        element_bytes: bytes per stored weight.
        source: ``measured`` or ``assumed_uniform``.
        samples: training samples the numbers come from (0 when assumed).
        accesses_per_sample: ids looked up per sample, all features of the table together
            (the pooling factor).
        bytes_per_sample: ``accesses_per_sample * dim * element_bytes``: the table's bandwidth
            need per trained sample.
        unique_ratio: mean over batches of unique ids / ids, i.e. how much the cache's
            per-batch dedup saves.
        unique_per_sample: unique ids per batch, summed over batches, per sample: the rows the
            cache looks up per sample.
        distinct_rows: distinct ids seen in the profiled batches.
        hot_rows: the most accessed ids, hottest first (FAE's pinned hot set).
        hot_row_shares: each hot row's share of all accesses.
        access_skew: sorted ``(row_fraction, access_share)`` points: the share of accesses that
            go to the hottest ``row_fraction`` of the table's rows.
        hit_rate_curve: sorted ``(cache_rows, hit_rate)`` points of an LRU cache fed with each
            batch's unique ids; cold misses count as misses.
        hit_rate_method: how the curve was computed.
        policy_curves: the MIN, MIN-seeing-ahead and LFU curves on the same trace (exact
            profiles only; ``None`` otherwise and in profiles written before they existed).

    Example::

        profile = uniform_profile("t0", TableInfo(num_rows=1000, dim=64))
        profile.hit_rate(250)  # 0.25
    """

    name: str
    num_rows: int
    dim: int
    element_bytes: int
    source: ProfileSource
    samples: int
    accesses_per_sample: float
    bytes_per_sample: float
    unique_ratio: float
    unique_per_sample: float
    distinct_rows: int
    hot_rows: tuple[int, ...]
    hot_row_shares: tuple[float, ...]
    access_skew: tuple[tuple[float, float], ...]
    hit_rate_curve: tuple[tuple[int, float], ...]
    hit_rate_method: HitRateMethod
    policy_curves: PolicyCurves | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "source", ProfileSource(self.source))
        set_(self, "hit_rate_method", HitRateMethod(self.hit_rate_method))
        TableInfo(self.num_rows, self.dim, self.element_bytes)  # validates the shape fields
        set_(self, "hot_rows", tuple(int(i) for i in self.hot_rows))
        set_(self, "hot_row_shares", tuple(float(s) for s in self.hot_row_shares))
        set_(self, "access_skew", _points(self.access_skew, "access_skew", float))
        set_(self, "hit_rate_curve", _points(self.hit_rate_curve, "hit_rate_curve", int))
        if len(self.hot_rows) != len(self.hot_row_shares):
            raise ValueError(
                f"table {self.name!r}: {len(self.hot_rows)} hot rows but "
                f"{len(self.hot_row_shares)} shares"
            )
        if any(not 0.0 <= s <= 1.0 for s in self.hot_row_shares):
            raise ValueError(f"table {self.name!r}: hot row shares must lie in [0, 1]")
        if any(not 0 <= i < self.num_rows for i in self.hot_rows):
            raise ValueError(f"table {self.name!r}: hot row ids must lie in [0, {self.num_rows})")
        if not 0.0 <= self.unique_ratio <= 1.0:
            raise ValueError(f"table {self.name!r}: unique_ratio {self.unique_ratio} not in [0, 1]")
        for name in ("samples", "distinct_rows"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"table {self.name!r}: {name} must be >= 0")
        for name in ("accesses_per_sample", "bytes_per_sample", "unique_per_sample"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0.0:
                raise ValueError(f"table {self.name!r}: {name} must be finite and >= 0")

    @property
    def row_bytes(self) -> int:
        return self.dim * self.element_bytes

    @property
    def max_hit_rate(self) -> float:
        """Hit rate of a cache holding every row seen (below 1 by the cold misses)."""
        return self.hit_rate_curve[-1][1]

    def hit_rate(self, cache_rows: float) -> float:
        """LRU hit rate of a cache of ``cache_rows`` rows, linearly interpolated between points.

        Monotone non-decreasing; 0 for an empty cache and the curve's maximum from the size
        that holds every reused row on.
        """
        if cache_rows < 0:
            raise ValueError(f"cache_rows must be >= 0, got {cache_rows}")
        xs = [p[0] for p in self.hit_rate_curve]
        ys = [p[1] for p in self.hit_rate_curve]
        return float(np.interp(float(cache_rows), xs, ys))

    def policy_hit_rate(self, policy: ReplacementPolicy | str, cache_rows: float) -> float | None:
        """The hit rate of ``policy`` with ``cache_rows`` rows: LRU's from :meth:`hit_rate`,
        the others' from :attr:`policy_curves`; ``None`` where the profile has no such curve
        or the cache is below its ``min_cache_rows``."""
        if ReplacementPolicy(policy) is ReplacementPolicy.LRU:
            return self.hit_rate(cache_rows)
        if self.policy_curves is None:
            return None
        return self.policy_curves.hit_rate(policy, cache_rows)

    def miss_rows_per_sample(self, cache_rows: float) -> float:
        """Rows the cache must fetch from the backing tier per trained sample."""
        return self.unique_per_sample * (1.0 - self.hit_rate(cache_rows))

    def access_share(self, row_fraction: float) -> float:
        """Share of accesses that go to the hottest ``row_fraction`` of the table's rows."""
        if not 0.0 <= row_fraction <= 1.0:
            raise ValueError(f"row_fraction must be in [0, 1], got {row_fraction}")
        xs = [p[0] for p in self.access_skew]
        ys = [p[1] for p in self.access_skew]
        return float(np.interp(row_fraction, xs, ys))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (tuples become lists, enums their string values)."""
        return {
            "name": self.name,
            "num_rows": self.num_rows,
            "dim": self.dim,
            "element_bytes": self.element_bytes,
            "source": self.source.value,
            "samples": self.samples,
            "accesses_per_sample": self.accesses_per_sample,
            "bytes_per_sample": self.bytes_per_sample,
            "unique_ratio": self.unique_ratio,
            "unique_per_sample": self.unique_per_sample,
            "distinct_rows": self.distinct_rows,
            "hot_rows": list(self.hot_rows),
            "hot_row_shares": list(self.hot_row_shares),
            "access_skew": [list(p) for p in self.access_skew],
            "hit_rate_curve": [list(p) for p in self.hit_rate_curve],
            "hit_rate_method": self.hit_rate_method.value,
            "policy_curves": None if self.policy_curves is None else self.policy_curves.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TableProfile:
        """Inverse of :meth:`to_dict`; raises ``KeyError`` / ``ValueError`` on bad input. A
        profile written before policy curves existed has none."""
        curves = data.get("policy_curves")
        return cls(
            name=str(data["name"]),
            num_rows=int(data["num_rows"]),
            dim=int(data["dim"]),
            element_bytes=int(data["element_bytes"]),
            source=ProfileSource(data["source"]),
            samples=int(data["samples"]),
            accesses_per_sample=float(data["accesses_per_sample"]),
            bytes_per_sample=float(data["bytes_per_sample"]),
            unique_ratio=float(data["unique_ratio"]),
            unique_per_sample=float(data["unique_per_sample"]),
            distinct_rows=int(data["distinct_rows"]),
            hot_rows=tuple(data["hot_rows"]),
            hot_row_shares=tuple(data["hot_row_shares"]),
            access_skew=tuple(tuple(p) for p in data["access_skew"]),
            hit_rate_curve=tuple(tuple(p) for p in data["hit_rate_curve"]),
            hit_rate_method=HitRateMethod(data["hit_rate_method"]),
            policy_curves=None if curves is None else PolicyCurves.from_dict(curves),
        )


def uniform_profile(
    name: str,
    table: TableInfo,
    *,
    accesses_per_sample: float = 1.0,
    batch_size: int | None = None,
) -> TableProfile:
    """The profile a table would have if every row were equally likely to be accessed.

    A fallback for tables without a measured profile; it is pessimistic for real (skewed)
    embedding traffic. Steady state is assumed, so there are no cold misses: an LRU cache of
    ``C`` rows hits with probability ``C / num_rows``.

    Args:
        name: table name.
        table: its shape.
        accesses_per_sample: assumed pooling factor.
        batch_size: when given, the unique ratio is the expected one for ``batch_size *
            accesses_per_sample`` uniform draws; otherwise 1.
    """
    if accesses_per_sample < 0 or not math.isfinite(accesses_per_sample):
        raise ValueError(f"accesses_per_sample must be finite and >= 0, got {accesses_per_sample}")
    unique_ratio = 1.0
    if batch_size is not None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        draws = accesses_per_sample * batch_size
        if draws > 0:
            # E[distinct] of n uniform draws from R rows = R * (1 - (1 - 1/R)^n).
            miss_all = (
                math.exp(draws * math.log1p(-1.0 / table.num_rows)) if table.num_rows > 1 else 0.0
            )
            unique_ratio = min(1.0, table.num_rows * (1.0 - miss_all) / draws)
    return TableProfile(
        name=name,
        num_rows=table.num_rows,
        dim=table.dim,
        element_bytes=table.element_bytes,
        source=ProfileSource.ASSUMED_UNIFORM,
        samples=0,
        accesses_per_sample=float(accesses_per_sample),
        bytes_per_sample=float(accesses_per_sample * table.row_bytes),
        unique_ratio=unique_ratio,
        unique_per_sample=float(accesses_per_sample * unique_ratio),
        distinct_rows=table.num_rows,
        hot_rows=(),
        hot_row_shares=(),
        access_skew=((0.0, 0.0), (1.0, 1.0)),
        hit_rate_curve=((0, 0.0), (table.num_rows, 1.0)),
        hit_rate_method=HitRateMethod.UNIFORM,
    )


@dataclass(frozen=True)
class AccessProfile:
    """Profiles of all tables of a model from one profiling run.

    Args:
        tables: profile per table name.
        sampling_rate: fraction of batches (or windows of batches) profiled.
        seed: seed of the batch sampling.
        batches_seen: batches offered to the profiler.
        batches_profiled: batches actually profiled.
        batch_size: most common batch size among the profiled batches.

    Example::

        profile = profile_batches(loader, tables, sampling_rate=0.05, seed=0)
        profile.to_json("profile.json")
        AccessProfile.from_json("profile.json")["t0"].hit_rate(10_000)
    """

    tables: Mapping[str, TableProfile]
    sampling_rate: float
    seed: int
    batches_seen: int
    batches_profiled: int
    batch_size: int
    version: int = field(default=PROFILE_VERSION, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tables", dict(sorted(self.tables.items())))
        for key, table in self.tables.items():
            if key != table.name:
                raise ValueError(f"table profile {table.name!r} is stored under key {key!r}")
        if not 0.0 < self.sampling_rate <= 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1], got {self.sampling_rate}")
        if not 0 <= self.batches_profiled <= self.batches_seen:
            raise ValueError(
                f"batches_profiled ({self.batches_profiled}) must lie in [0, batches_seen "
                f"({self.batches_seen})]"
            )

    def __getitem__(self, name: str) -> TableProfile:
        try:
            return self.tables[name]
        except KeyError:
            raise KeyError(f"no profile for table {name!r}; have: {sorted(self.tables)}") from None

    def __contains__(self, name: object) -> bool:
        return name in self.tables

    def table_or_uniform(
        self, name: str, table: TableInfo, *, accesses_per_sample: float = 1.0
    ) -> TableProfile:
        """The measured profile of ``name``, or a labelled uniform assumption if there is none."""
        if name in self.tables:
            return self.tables[name]
        logger.info("no profile for table %r; assuming uniform access", name)
        return uniform_profile(
            name, table, accesses_per_sample=accesses_per_sample, batch_size=self.batch_size
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PROFILE_FORMAT,
            "version": self.version,
            "sampling_rate": self.sampling_rate,
            "seed": self.seed,
            "batches_seen": self.batches_seen,
            "batches_profiled": self.batches_profiled,
            "batch_size": self.batch_size,
            "tables": {name: t.to_dict() for name, t in self.tables.items()},
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], origin: str = "<dict>") -> AccessProfile:
        """Builds a profile from :meth:`to_dict` output.

        Raises:
            ProfileFormatError: naming ``origin``, if the format or version is not ours or a
                field is missing or invalid.
        """
        if not isinstance(data, Mapping) or data.get("format") != PROFILE_FORMAT:
            raise ProfileFormatError(f"{origin}: not a {PROFILE_FORMAT} file")
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ProfileFormatError(
                f"{origin}: access profile version {version!r} is not supported "
                f"(this torchrec_mtrains reads version {PROFILE_VERSION})"
            )
        try:
            return cls(
                tables={n: TableProfile.from_dict(t) for n, t in data["tables"].items()},
                sampling_rate=float(data["sampling_rate"]),
                seed=int(data["seed"]),
                batches_seen=int(data["batches_seen"]),
                batches_profiled=int(data["batches_profiled"]),
                batch_size=int(data["batch_size"]),
            )
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ProfileFormatError(f"{origin}: invalid access profile: {e!r}") from e

    def to_json(self, path: str | os.PathLike[str]) -> Path:
        """Writes the profile as JSON (atomically: a reader never sees half a file)."""
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")
        tmp.replace(out)
        logger.info("wrote access profile of %d tables to %s", len(self.tables), out)
        return out

    @classmethod
    def from_json(cls, path: str | os.PathLike[str]) -> AccessProfile:
        """Reads a profile written by :meth:`to_json`.

        Raises:
            ProfileFormatError: naming the file, if it is not valid JSON, not a profile, or of
                an unknown version.
        """
        src = Path(path)
        try:
            data = json.loads(src.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ProfileFormatError(f"{src}: not valid JSON: {e}") from e
        return cls.from_dict(data, origin=str(src))
