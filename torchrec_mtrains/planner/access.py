"""What the planner knows of a table's accesses: ids per sample, distinct ids per step, and the
LRU hit rate of a cache of a given size.

Three sources, always labelled so a guess is never mistaken for a measurement:

* a measured profile (:class:`~torchrec_mtrains.profiler.TableProfile`, from
  ``python -m apps.dlrm.profile``);
* the profiler's uniform-access fallback when a table has no profile (pessimistic for the
  skewed traffic of real click logs);
* a Zipf law of a stated exponent (what-if studies of models nobody has profiled yet), with
  hit rates from Che's approximation adapted to batches (:func:`zipf_access`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property, lru_cache

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.profiler.types import (
    PolicyCurves,
    ProfileSource,
    ReplacementPolicy,
    TableInfo,
    TableProfile,
    uniform_profile,
)

__all__ = ["AccessSource", "TableAccess", "from_profile", "uniform_access", "zipf_access"]

_F64 = npt.NDArray[np.float64]


class AccessSource:
    """Labels of where a table's access numbers come from (shown in the plan printout)."""

    MEASURED = "measured"
    UNIFORM = "assumed uniform"

    @staticmethod
    def zipf(exponent: float) -> str:
        return f"assumed zipf({exponent:g})"


@dataclass(frozen=True)
class TableAccess:
    """Access statistics of one table as the planner uses them.

    Args:
        name: table name.
        num_rows: rows in the table.
        accesses_per_sample: ids looked up per sample (pooling factor).
        source: where the numbers come from (see :class:`AccessSource`).
        unique_fn: distinct ids per step for a step of ``samples`` samples.
        hit_fn: LRU hit rate among distinct ids of a cache of ``rows`` rows (whole-table
            equivalent) for steps of ``samples`` samples.
        policy_curves: a measured profile's MIN, MIN-seeing-ahead and LFU curves, for the
            plan's report only (caches are sized by ``hit_fn``); ``None`` without them.
    """

    name: str
    num_rows: int
    accesses_per_sample: float
    source: str
    unique_fn: Callable[[float], float]
    hit_fn: Callable[[float, float], float]
    policy_curves: PolicyCurves | None = None

    @property
    def measured(self) -> bool:
        return self.source == AccessSource.MEASURED

    def lookups(self, samples: float) -> float:
        return samples * self.accesses_per_sample

    def unique_rows(self, samples: float) -> float:
        """Distinct ids in one step of ``samples`` samples."""
        return min(self.unique_fn(samples), self.lookups(samples), float(self.num_rows))

    def hit_rate(self, cache_rows: float, samples: float) -> float:
        """Hit rate among distinct ids of an LRU cache of ``cache_rows`` rows."""
        if cache_rows <= 0:
            return 0.0
        return min(1.0, max(0.0, self.hit_fn(cache_rows, samples)))

    def policy_hit_rate(self, policy: ReplacementPolicy | str, cache_rows: float) -> float | None:
        """Hit rate of ``policy`` (``lfu``, ``min``, ``min_seen_ahead``) with ``cache_rows``
        rows (whole-table equivalent) on the profiled trace; ``None`` without the profile's
        policy curves or below the smallest cache that runs it."""
        if self.policy_curves is None:
            return None
        return self.policy_curves.hit_rate(policy, cache_rows)


def from_profile(profile: TableProfile) -> TableAccess:
    """Wraps a profile (measured, or the profiler's uniform fallback).

    The profile was taken at one batch size; distinct ids per step are scaled linearly with the
    step's samples, which overstates them (and so the misses) for steps larger than the
    profiled batches, the safe direction.
    """
    per_sample = profile.unique_per_sample
    source = (
        AccessSource.MEASURED if profile.source is ProfileSource.MEASURED else AccessSource.UNIFORM
    )
    return TableAccess(
        name=profile.name,
        num_rows=profile.num_rows,
        accesses_per_sample=profile.accesses_per_sample,
        source=source,
        unique_fn=lambda samples: samples * per_sample,
        hit_fn=lambda rows, samples: profile.hit_rate(rows),
        policy_curves=profile.policy_curves,
    )


def uniform_access(
    name: str, num_rows: int, dim: int, pooling: float, batch_size: int
) -> TableAccess:
    """The profiler's uniform-access assumption for a table without a profile."""
    return from_profile(
        uniform_profile(
            name,
            TableInfo(num_rows=num_rows, dim=dim),
            accesses_per_sample=pooling,
            batch_size=batch_size,
        )
    )


# ------------------------------------------------------------------------------ Zipf / Che

_EXACT_RANKS = 2048
_BINS = 1536


@lru_cache(maxsize=256)
def _zipf_mass(num_rows: int, exponent: float) -> tuple[_F64, _F64]:
    """Rank groups of a Zipf law over ``num_rows`` rows: (rows per group, probability of one row
    of the group). The hottest ranks are exact; the tail is log-spaced bins whose per-row
    probability is the bin's mean, so sums over a billion rows take a few thousand terms."""
    exact = min(num_rows, _EXACT_RANKS)
    counts = [np.ones(exact)]
    centers = [np.arange(1, exact + 1, dtype=np.float64)]
    if num_rows > exact:
        edges = np.unique(np.geomspace(exact + 0.5, num_rows + 0.5, _BINS + 1))
        lo, hi = edges[:-1], edges[1:]
        width = hi - lo
        if abs(exponent - 1.0) < 1e-9:
            mean = (np.log(hi) - np.log(lo)) / width
        else:
            mean = (hi ** (1 - exponent) - lo ** (1 - exponent)) / ((1 - exponent) * width)
        counts.append(width)
        centers.append(mean ** (-1.0 / exponent) if exponent > 0 else np.ones_like(mean))
    n = np.concatenate(counts)
    rank = np.concatenate(centers)
    weight = rank ** (-exponent)
    p = weight / float((n * weight).sum())
    return n, p


@dataclass(frozen=True)
class _ZipfStep:
    """Che's approximation for an LRU cache fed with each step's distinct ids."""

    counts: _F64
    p: _F64
    draws: float

    @property
    def present(self) -> _F64:
        """Probability that a row appears in a step (Poisson draws)."""
        return -np.expm1(-self.draws * self.p)

    def unique(self) -> float:
        return float((self.counts * self.present).sum())

    @cached_property
    def curve(self) -> tuple[_F64, _F64]:
        """(cache rows, hit rate) at log-spaced characteristic times, for interpolation."""
        times = np.geomspace(1e-4, 1e12, 481)
        decay = np.exp(-np.outer(times, self.draws * self.p))  # (times, groups)
        held = (self.counts * (1.0 - decay)).sum(axis=1)
        q = self.present
        hits = (self.counts * q * (1.0 - decay)).sum(axis=1) / max((self.counts * q).sum(), 1e-300)
        sizes = np.concatenate(([0.0], held))
        rates = np.concatenate(([0.0], hits))
        return np.maximum.accumulate(sizes), np.maximum.accumulate(rates)

    def hit_rate(self, cache_rows: float) -> float:
        sizes, rates = self.curve
        return float(np.interp(cache_rows, sizes, rates))


def zipf_access(name: str, num_rows: int, pooling: float, exponent: float) -> TableAccess:
    """Accesses drawn i.i.d. from a Zipf law ``P(rank k) ~ k**-exponent`` (0 = uniform).

    Distinct ids per step are the expected number of rows drawn at least once among
    ``samples * pooling`` draws. The hit rate is Che's approximation for an LRU cache fed with
    each step's distinct ids: a cache of ``C`` rows holds the rows seen in the last ``t`` steps,
    ``sum_r 1 - exp(-t n p_r) = C``, and a row present in a step hits with probability
    ``1 - exp(-t n p_r)``. Steady state: there are no cold misses.
    """
    if exponent < 0 or not math.isfinite(exponent):
        raise ValueError(f"table {name!r}: zipf exponent must be finite and >= 0, got {exponent}")
    if pooling <= 0:
        raise ValueError(f"table {name!r}: pooling must be positive, got {pooling}")
    counts, p = _zipf_mass(num_rows, float(exponent))

    @lru_cache(maxsize=64)
    def step(samples: float) -> _ZipfStep:
        return _ZipfStep(counts, p, samples * pooling)

    return TableAccess(
        name=name,
        num_rows=num_rows,
        accesses_per_sample=float(pooling),
        source=AccessSource.zipf(exponent),
        unique_fn=lambda samples: step(float(samples)).unique(),
        hit_fn=lambda rows, samples: step(float(samples)).hit_rate(rows),
    )
