"""Streaming access profiler: turns a sample of training batches into an ``AccessProfile``.

Only a fraction of batches is profiled (``sampling_rate``, drawn from a seeded generator, so the
same seed and the same stream profile the same batches), which keeps the cost negligible next
to training. Everything runs on CPU with numpy.

Memory. Per table, id counts take 8 bytes per row for tables up to ``dense_count_limit`` rows
and ~16 bytes per distinct id seen otherwise. The stack-distance trace keeps each profiled
batch's unique ids (4 bytes each when ids fit in int32, else 8) - with the SHARDS method only
the sampled ones and the hot set - and ``finish``, which handles one table at a time, needs
~65 bytes per kept id on top (measured: 62). E.g. 1,000 profiled batches with 10k unique ids
each in the largest table: 40 MB of trace, ~0.7 GB transient at ``finish``.
``max_profiled_batches`` caps this; SHARDS at rate 0.1 cuts it ~5x (the hot rows stay). The
policy curves (below) need ~40 bytes per kept id more (measured: 41), after the LRU curve
has freed its own.

Batch sampling and reuse. The trace is the profiled batches back to back. With ``window=1``
(independent batches) it is statistically the same as a contiguous trace when batches are i.i.d.
(shuffled data), but it drops the locality between consecutive batches of unshuffled data;
``window > 1`` profiles runs of consecutive batches to keep it.

Policy curves. With exact stack distances the same trace also gives the hit rates of Belady's
optimal replacement (MIN), of MIN seeing only the next ``lookahead`` batches, and of the row
cache's LFU (:mod:`~torchrec_mtrains.profiler.replacement`), with the rows of the
``lookahead + 1`` batches in flight held resident as the look-ahead pipeline holds them. A
table without lookups in a profiled batch gets an empty batch in its trace, so the windows of
all tables span the same batches. Each curve point is one compiled pass over the trace per
policy: about half a second per point per million kept ids for the three, on one core (well
under a second for a profile of a few hundred small batches, a minute for a 4M-id table;
``policy_curves=False`` skips them).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.profiler import replacement
from torchrec_mtrains.profiler.stack_distance import (
    ShardsSampler,
    batch_stack_distances,
    hit_rate_curve,
    weighted_batch_stack_distances,
)
from torchrec_mtrains.profiler.types import (
    AccessProfile,
    HitRateMethod,
    PolicyCurves,
    ProfileSource,
    TableInfo,
    TableProfile,
)

logger = logging.getLogger(__name__)

__all__ = ["Batch", "Profiler", "ProfilerConfig", "profile_batches"]

_I64 = npt.NDArray[np.int64]
_F64 = npt.NDArray[np.float64]
IdArray: TypeAlias = "torch.Tensor | npt.ArrayLike"
_NO_IDS: _I64 = np.zeros(0, dtype=np.int64)


@runtime_checkable
class _HasSparseFeatures(Protocol):
    """A ``torchrec.datasets.utils.Batch`` or anything else carrying a KJT of sparse features."""

    @property
    def sparse_features(self) -> KeyedJaggedTensor: ...


Batch: TypeAlias = "KeyedJaggedTensor | _HasSparseFeatures | Mapping[str, IdArray]"
"""What ``Profiler.observe`` accepts: a KJT (features mapped to tables), an object with a
``sparse_features`` KJT, or a plain mapping table name -> 1-D ids."""


@dataclass(frozen=True)
class ProfilerConfig:
    """Knobs of a profiling run.

    Args:
        sampling_rate: fraction of batches (of windows, when ``window > 1``) profiled.
        seed: seeds the batch sampling and the SHARDS hash.
        window: consecutive batches profiled per sampling decision.
        top_k: hot rows reported per table.
        hit_rate_method: ``exact`` stack distances, or ``shards`` for traces too big to keep.
        shards_rate: SHARDS spatial sampling rate.
        shards_hot_rows: hottest rows of the warm-up batches always kept by SHARDS.
        shards_warmup_batches: profiled batches kept whole before SHARDS fixes its hot set.
        curve_points: points of each hit-rate curve.
        skew_points: points of each access-skew curve.
        max_profiled_batches: stop profiling after this many batches (bounds memory).
        dense_count_limit: tables with at most this many rows count ids in a dense array.
        policy_curves: with exact stack distances, also the MIN, MIN-seeing-ahead and LFU
            hit-rate curves (:class:`~torchrec_mtrains.profiler.types.PolicyCurves`).
        policy_curve_points: points of each of those curves (each point is a simulation).
        lookahead: batches the training loop prefetches ahead of the running one
            (``pipeline.lookahead``): the rows of ``lookahead + 1`` batches are resident at
            once in the policy curves' caches, and MIN-seeing-ahead sees that many batches.
    """

    sampling_rate: float = 0.05
    seed: int = 0
    window: int = 1
    top_k: int = 1024
    hit_rate_method: HitRateMethod = HitRateMethod.EXACT
    shards_rate: float = 0.1
    shards_hot_rows: int = 256
    shards_warmup_batches: int = 8
    curve_points: int = 256
    skew_points: int = 128
    max_profiled_batches: int | None = None
    dense_count_limit: int = 1 << 22
    policy_curves: bool = True
    policy_curve_points: int = 16
    lookahead: int = 2

    def __post_init__(self) -> None:
        object.__setattr__(self, "hit_rate_method", HitRateMethod(self.hit_rate_method))
        if self.hit_rate_method is HitRateMethod.UNIFORM:
            raise ValueError("hit_rate_method must be 'exact' or 'shards', got 'uniform'")
        for name in ("sampling_rate", "shards_rate"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        for name, low in (
            ("window", 1),
            ("top_k", 0),
            ("shards_hot_rows", 0),
            ("shards_warmup_batches", 0),
            ("curve_points", 3),
            ("skew_points", 2),
            ("dense_count_limit", 0),
            ("policy_curve_points", 2),
            ("lookahead", 0),
        ):
            if getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.max_profiled_batches is not None and self.max_profiled_batches < 1:
            raise ValueError(f"max_profiled_batches must be >= 1, got {self.max_profiled_batches}")


class _IdCounter:
    """Access count per id: a dense array for small tables, merged sorted arrays for big ones."""

    def __init__(self, num_rows: int, dense_limit: int) -> None:
        self._dense: _I64 | None = (
            np.zeros(num_rows, dtype=np.int64) if num_rows <= dense_limit else None
        )
        self._ids: _I64 = np.zeros(0, dtype=np.int64)
        self._counts: _I64 = np.zeros(0, dtype=np.int64)
        self._pending: list[tuple[_I64, _I64]] = []
        self._pending_len = 0

    def add(self, unique_ids: _I64, counts: _I64) -> None:
        if self._dense is not None:
            self._dense[unique_ids] += counts  # ids are unique, so no np.add.at needed
            return
        self._pending.append((unique_ids, counts))
        self._pending_len += len(unique_ids)
        if self._pending_len > max(1 << 20, len(self._ids)):
            self._ids, self._counts = self.result()
            self._pending, self._pending_len = [], 0

    def result(self) -> tuple[_I64, _I64]:
        """Distinct ids seen (sorted) and their counts."""
        if self._dense is not None:
            ids = np.flatnonzero(self._dense).astype(np.int64)
            return ids, self._dense[ids]
        if not self._pending:
            return self._ids, self._counts
        all_ids = np.concatenate([self._ids, *(p[0] for p in self._pending)])
        all_counts = np.concatenate([self._counts, *(p[1] for p in self._pending)])
        ids, inverse = np.unique(all_ids, return_inverse=True)
        counts = np.zeros(len(ids), dtype=np.int64)
        np.add.at(counts, inverse.reshape(-1), all_counts)
        return ids, counts


def _top_ids(ids: _I64, counts: _I64, k: int) -> tuple[_I64, _I64]:
    """The ``k`` most counted ids, hottest first, ties by ascending id (deterministic)."""
    k = min(k, len(ids))
    if k == 0:
        return ids[:0], counts[:0]
    idx = np.argpartition(-counts, k - 1)[:k] if k < len(ids) else np.arange(len(ids))
    # Ties at the partition boundary would make the choice arbitrary; resolve them by id.
    threshold = counts[idx].min()
    idx = np.flatnonzero(counts >= threshold)
    order = np.lexsort((ids[idx], -counts[idx]))[:k]
    return ids[idx][order], counts[idx][order]


class _TableStats:
    """Running statistics of one table."""

    def __init__(self, name: str, info: TableInfo, config: ProfilerConfig) -> None:
        self.name = name
        self.info = info
        self.config = config
        self.counter = _IdCounter(info.num_rows, config.dense_count_limit)
        self.total_ids = 0
        self.unique_total = 0
        self.ratio_sum = 0.0
        self.ratio_batches = 0
        self._id_dtype = np.int32 if info.num_rows <= np.iinfo(np.int32).max else np.int64
        self.trace: list[npt.NDArray[np.integer[Any]]] = []
        self.weights: list[_F64] = []
        self.warmup: list[_I64] = []
        self.sampler: ShardsSampler | None = None

    def check(self, ids: _I64) -> None:
        """Raises if an id is outside the table (before any statistic is touched)."""
        if ids.size == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.info.num_rows:
            bad = lo if lo < 0 else hi
            raise ValueError(
                f"table {self.name!r}: id {bad} outside [0, {self.info.num_rows}) rows"
            )

    def add(self, ids: _I64) -> None:
        if ids.size == 0:
            if self.config.hit_rate_method is HitRateMethod.EXACT:
                self.trace.append(np.zeros(0, dtype=self._id_dtype))  # keeps batches aligned
            return
        unique_ids, counts = np.unique(ids, return_counts=True)
        self.counter.add(unique_ids, counts.astype(np.int64, copy=False))
        self.total_ids += int(ids.size)
        self.unique_total += int(unique_ids.size)
        self.ratio_sum += unique_ids.size / ids.size
        self.ratio_batches += 1
        if self.config.hit_rate_method is HitRateMethod.EXACT:
            self.trace.append(unique_ids.astype(self._id_dtype))
        elif self.sampler is None:
            self.warmup.append(unique_ids)
            if len(self.warmup) >= self.config.shards_warmup_batches:
                self.sampler = self._make_sampler()
                for batch in self.warmup:
                    self._add_sampled(self.sampler, batch)
                self.warmup = []
        else:
            self._add_sampled(self.sampler, unique_ids)

    def _make_sampler(self) -> ShardsSampler:
        ids, counts = self.counter.result()
        hot, _ = _top_ids(ids, counts, self.config.shards_hot_rows)
        return ShardsSampler(self.config.shards_rate, self.config.seed, hot)

    def _add_sampled(self, sampler: ShardsSampler, unique_ids: _I64) -> None:
        kept, weights = sampler.sample(unique_ids)
        self.trace.append(kept.astype(self._id_dtype))
        self.weights.append(weights)

    def _policy_curves(self) -> PolicyCurves | None:
        if not self.config.policy_curves:
            return None
        if self.config.hit_rate_method is not HitRateMethod.EXACT:
            logger.debug("table %s: policy curves need the exact trace, not SHARDS", self.name)
            return None
        trace = replacement.BatchTrace.from_batches(self.trace)
        return replacement.policy_curves(
            trace, self.config.lookahead, self.config.policy_curve_points
        )

    def _curve(self) -> tuple[tuple[int, float], ...]:
        points = self.config.curve_points
        if self.config.hit_rate_method is HitRateMethod.EXACT:
            dists = batch_stack_distances(self.trace)
            return hit_rate_curve(np.concatenate(dists) if dists else [], points=points)
        trace, weights = list(self.trace), list(self.weights)
        if self.warmup:  # fewer batches than the warm-up: sample them now, without mutating
            sampler = self._make_sampler()
            for batch in self.warmup:
                kept, w = sampler.sample(batch)
                trace.append(kept)
                weights.append(w)
        wdists = weighted_batch_stack_distances(trace, weights)
        if not wdists:
            return ((0, 0.0),)
        return hit_rate_curve(np.concatenate(wdists), np.concatenate(weights), points=points)

    def _skew(self, counts: _I64) -> tuple[tuple[float, float], ...]:
        if self.total_ids == 0:
            return ((0.0, 0.0), (1.0, 0.0))
        cum = np.cumsum(np.sort(counts)[::-1]) / float(self.total_ids)
        ranks = np.unique(np.rint(np.geomspace(1, len(cum), self.config.skew_points)))
        points = [(0.0, 0.0)]
        points += [(int(r) / self.info.num_rows, float(cum[int(r) - 1])) for r in ranks]
        if points[-1][0] < 1.0:
            points.append((1.0, 1.0))
        return tuple(points)

    def profile(self, samples: int) -> TableProfile:
        ids, counts = self.counter.result()
        hot, hot_counts = _top_ids(ids, counts, self.config.top_k)
        accesses = self.total_ids / samples
        return TableProfile(
            name=self.name,
            num_rows=self.info.num_rows,
            dim=self.info.dim,
            element_bytes=self.info.element_bytes,
            source=ProfileSource.MEASURED,
            samples=samples,
            accesses_per_sample=accesses,
            bytes_per_sample=accesses * self.info.row_bytes,
            unique_ratio=self.ratio_sum / self.ratio_batches if self.ratio_batches else 1.0,
            unique_per_sample=self.unique_total / samples,
            distinct_rows=len(ids),
            hot_rows=tuple(int(i) for i in hot),
            hot_row_shares=tuple(float(c) / self.total_ids for c in hot_counts),
            access_skew=self._skew(counts),
            hit_rate_curve=self._curve(),
            hit_rate_method=self.config.hit_rate_method,
            policy_curves=self._policy_curves(),
        )


def _to_numpy_ids(ids: IdArray, what: str) -> _I64:
    arr = ids.detach().cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{what}: ids must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what}: ids must be integers, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


class Profiler:
    """Samples batches and accumulates per-table access statistics.

    Args:
        tables: shape of every table to profile, by table name.
        feature_to_table: for KJT batches, the table each feature looks up; features named
            like a table map to it by default.
        config: sampling and output knobs.
        batch_size: samples per batch for mapping batches, which do not carry it.

    Example::

        profiler = Profiler({"t0": TableInfo(num_rows=1000, dim=16)}, {"f0": "t0"})
        for batch in loader:
            profiler.observe(batch.sparse_features)
        profile = profiler.finish()
    """

    def __init__(
        self,
        tables: Mapping[str, TableInfo],
        feature_to_table: Mapping[str, str] | None = None,
        config: ProfilerConfig | None = None,
        batch_size: int | None = None,
    ) -> None:
        if not tables:
            raise ValueError("no tables to profile")
        self.config = config or ProfilerConfig()
        self.tables = dict(tables)
        self.feature_to_table = dict(feature_to_table or {})
        unknown = sorted(set(self.feature_to_table.values()) - set(self.tables))
        if unknown:
            raise ValueError(
                f"feature_to_table names unknown tables {unknown}; have {sorted(self.tables)}"
            )
        if batch_size is not None and batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self._stats = {
            name: _TableStats(name, info, self.config) for name, info in self.tables.items()
        }
        self._rng = np.random.default_rng(self.config.seed)
        self._in_window = False
        self.batches_seen = 0
        self.batches_profiled = 0
        self.samples = 0
        self._batch_sizes: collections.Counter[int] = collections.Counter()

    def _take_next(self) -> bool:
        """Sampling decision for the next batch; depends only on the seed and the batch index."""
        if self.batches_seen % self.config.window == 0:
            self._in_window = bool(self._rng.random() < self.config.sampling_rate)
        limit = self.config.max_profiled_batches
        return self._in_window and (limit is None or self.batches_profiled < limit)

    def observe(self, batch: Batch, batch_size: int | None = None) -> bool:
        """Offers one batch; profiles it if the sampling picks it.

        Args:
            batch: a KJT, an object with a ``sparse_features`` KJT, or a mapping table name ->
                1-D ids (tables left out had no lookups in this batch).
            batch_size: samples in a mapping batch (default: the constructor's); for a KJT it
                must match ``stride()`` if given.

        Returns:
            Whether the batch was profiled.
        """
        take = self._take_next()
        self.batches_seen += 1
        if not take:
            return False
        ids_by_table, size = self._split(batch, batch_size)
        for name, ids in ids_by_table.items():
            self._stats[name].check(ids)  # a bad batch must leave no partial trace
        for name, stats in self._stats.items():
            stats.add(ids_by_table.get(name, _NO_IDS))
        self.batches_profiled += 1
        self.samples += size
        self._batch_sizes[size] += 1
        return True

    def _split(self, batch: Batch, batch_size: int | None) -> tuple[dict[str, _I64], int]:
        if isinstance(batch, _HasSparseFeatures) and not isinstance(batch, Mapping):
            batch = batch.sparse_features
        if isinstance(batch, KeyedJaggedTensor):
            return self._split_kjt(batch, batch_size)
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"a batch must be a KeyedJaggedTensor, have .sparse_features, or map table "
                f"names to ids; got {type(batch).__name__}"
            )
        size = batch_size if batch_size is not None else self.batch_size
        if size is None or size <= 0:
            raise ValueError(
                f"a mapping batch needs a positive batch_size (argument or constructor), got {size}"
            )
        unknown = sorted(set(batch) - set(self.tables))
        if unknown:
            raise ValueError(f"batch names unknown tables {unknown}; have {sorted(self.tables)}")
        return {name: _to_numpy_ids(ids, f"table {name!r}") for name, ids in batch.items()}, size

    def _split_kjt(
        self, kjt: KeyedJaggedTensor, batch_size: int | None
    ) -> tuple[dict[str, _I64], int]:
        if kjt.variable_stride_per_key():
            raise ValueError("variable-batch (VBE) KJTs are not supported: samples are ambiguous")
        size = int(kjt.stride())
        if batch_size is not None and batch_size != size:
            raise ValueError(f"batch_size {batch_size} does not match the KJT's stride {size}")
        values = _to_numpy_ids(kjt.values(), "KJT values")
        bounds = np.cumsum([0, *kjt.length_per_key()])
        parts: dict[str, list[_I64]] = {}
        for i, key in enumerate(kjt.keys()):
            table = self.feature_to_table.get(key, key)
            if table not in self.tables:
                raise ValueError(
                    f"feature {key!r} maps to no known table; pass feature_to_table "
                    f"(tables: {sorted(self.tables)})"
                )
            parts.setdefault(table, []).append(values[bounds[i] : bounds[i + 1]])
        return {t: np.concatenate(p) for t, p in parts.items()}, size

    def finish(self) -> AccessProfile:
        """Computes the profile of everything observed so far.

        Raises:
            ValueError: if no batch was profiled (too few batches for the sampling rate).
        """
        if self.batches_profiled == 0:
            raise ValueError(
                f"no batch was profiled out of {self.batches_seen} at sampling_rate "
                f"{self.config.sampling_rate}; offer more batches or raise the rate"
            )
        tables = {name: s.profile(self.samples) for name, s in self._stats.items()}
        for t in tables.values():
            logger.debug(
                "table %s: %.2f accesses/sample, unique ratio %.3f, %d distinct rows, "
                "max hit rate %.3f",
                t.name,
                t.accesses_per_sample,
                t.unique_ratio,
                t.distinct_rows,
                t.max_hit_rate,
            )
        logger.info(
            "profiled %d of %d batches (%d samples) over %d tables",
            self.batches_profiled,
            self.batches_seen,
            self.samples,
            len(tables),
        )
        return AccessProfile(
            tables=tables,
            sampling_rate=self.config.sampling_rate,
            seed=self.config.seed,
            batches_seen=self.batches_seen,
            batches_profiled=self.batches_profiled,
            batch_size=self._batch_sizes.most_common(1)[0][0],
        )


def profile_batches(
    batches: Iterable[Batch],
    tables: Mapping[str, TableInfo],
    sampling_rate: float = 0.05,
    seed: int = 0,
    *,
    feature_to_table: Mapping[str, str] | None = None,
    batch_size: int | None = None,
    config: ProfilerConfig | None = None,
) -> AccessProfile:
    """Profiles a stream of batches in one call (the entry point for a CLI).

    Args:
        batches: training batches in order (see :class:`Profiler.observe`).
        tables: shape of every table, by name.
        sampling_rate: fraction of batches profiled.
        seed: sampling seed.
        feature_to_table: KJT feature -> table name, where they differ.
        batch_size: samples per batch for mapping batches.
        config: further knobs; its ``sampling_rate`` and ``seed`` are replaced by the
            arguments.
    """
    cfg = dataclasses.replace(config or ProfilerConfig(), sampling_rate=sampling_rate, seed=seed)
    profiler = Profiler(tables, feature_to_table, cfg, batch_size)
    for batch in batches:
        profiler.observe(batch)
    return profiler.finish()
