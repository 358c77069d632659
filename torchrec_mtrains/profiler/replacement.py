"""Hit rates of replacement policies on a batched trace with a look-ahead window: Belady's
optimal (MIN), MIN that sees only the next batches, and the row cache's own LRU and LFU.

Model: what :class:`~torchrec_mtrains.cache.table_cache.TableCache` and the look-ahead pipeline
do. A batch's unique ids are looked up together (repeats within a batch count once), in
ascending id order, each a hit iff its row is resident when the batch is planned. With
look-ahead ``k`` (``pipeline.lookahead``; 0 for the plain loop) batch ``t`` is planned while
batches ``t-k .. t-1`` are in flight and hold their rows, so the rows of the ``k + 1`` batches
``t-k .. t`` (the *window* of batch ``t``) must all be resident at once: they are never
evicted, and a cache smaller than a window's distinct rows cannot run the trace (the cache
raises ``CacheTooSmallError``; here the hit rate is NaN, or ``None`` for one size).

Policies:
    * ``min``: Belady's MIN, which knows the whole future. Within the window constraint the
      optimal choice is still to evict the rows used furthest in the future (an exchange
      argument, as for single accesses), so it bounds every policy at every cache size.
      Computed as interval packing: a row used in batches ``j`` and then ``i`` (next) is a hit
      at ``i`` for free when ``i <= j + k + 1`` (it is held until it is used again); otherwise
      keeping it costs a slot in every batch ``j + k + 1 .. i - 1``, where the window's rows
      use ``|window(s)|`` of the ``C`` slots. Taking the reuse intervals in order of their end
      (their next use) and keeping each one that still fits everywhere is optimal, and is what
      MIN does (it drops the interval that ends last). A segment tree over batches (range
      add, range max) checks and books each interval in O(log T), so the whole trace takes
      O(N log T) for N unique lookups in T batches, at one cache size. To bound the hits of
      the batches from ``first`` on only (a measured window after a warm-up), the intervals
      that end before ``first`` are never kept: they would take room and count for nothing.
    * ``min_seen_ahead``: a realizable policy that sees only the ids of the ``horizon``
      batches after the one it plans (MIN restricted to what a pipeline reading the data that
      far ahead knows): it evicts first, least recently used first, the rows it sees no use
      of, then those it sees used, furthest first. With ``horizon`` 0 it is LRU; with a
      horizon past the end of the trace it is MIN. A heap keyed by next use and a FIFO of
      last uses: O(N log N).
    * ``lru`` / ``lfu``: the row cache's policies replayed exactly (victims in ascending
      ``(count, last use, slot)`` order among rows not in the window, misses taking free slots
      first, LFU's counts restarting at each load and halved every ``decay_interval``
      batches): LFU with a heap keyed by that order, O(N log N); LRU with a FIFO (rows leave
      the window in order of last use), O(N) but for sorting each batch's slots. The tests
      hold both to ``TableCache`` batch by batch.

Next uses come from one backward pass and previous uses from one forward pass over the
trace; every pass is compiled with numba (without the GIL) when it is installed.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.cache.policies import LFUPolicy
from torchrec_mtrains.profiler.types import PolicyCurves, ReplacementPolicy

logger = logging.getLogger(__name__)

__all__ = [
    "LFU_DECAY_INTERVAL",
    "BatchTrace",
    "ReplacementPolicy",
    "batch_hits",
    "curve_sizes",
    "policy_curve",
    "policy_curves",
    "policy_hit_rates",
]

_I32 = npt.NDArray[np.int32]
_I64 = npt.NDArray[np.int64]
_F64 = npt.NDArray[np.float64]
_F = TypeVar("_F", bound=Callable[..., Any])

numba: Any
try:
    numba = importlib.import_module("numba")  # no type stubs: kept as Any, used only in _jit
except ImportError:  # pragma: no cover - numba is pinned in requirements/*.txt
    numba = None

LFU_DECAY_INTERVAL: int = int(inspect.signature(LFUPolicy).parameters["decay_interval"].default)
"""Batches between two halvings of the row cache's LFU counts (its default, read from it)."""


def _jit(fn: _F) -> _F:
    """``numba.njit(nogil=True, cache=True)``, typed for mypy; the plain function without
    numba (correct, but slow on long traces)."""
    if numba is None:  # pragma: no cover
        return fn
    return cast(_F, numba.njit(nogil=True, cache=True)(fn))


# ------------------------------------------------------------------------------- the trace


@_jit
def _prev_next(ids: _I32, offsets: _I64, distinct: int) -> tuple[_I32, _I32]:
    """For each lookup, the batch of the same id's previous lookup (-1 for none) and of its
    next one (the number of batches for none): one forward and one backward pass."""
    n = ids.size
    num_batches = offsets.size - 1
    prev = np.empty(n, np.int32)
    nxt = np.empty(n, np.int32)
    last = np.full(distinct, -1, np.int32)
    for b in range(num_batches):
        for a in range(offsets[b], offsets[b + 1]):
            prev[a] = last[ids[a]]
            last[ids[a]] = b
    last[:] = num_batches
    for b in range(num_batches - 1, -1, -1):
        for a in range(offsets[b], offsets[b + 1]):
            nxt[a] = last[ids[a]]
            last[ids[a]] = b
    return prev, nxt


@_jit
def _window_rows(offsets: _I64, nxt: _I32, lookahead: int) -> _I64:
    """Distinct ids of batches ``t - lookahead .. t`` for each batch ``t``: a lookup in batch
    ``b`` covers the windows ``b .. b + lookahead`` up to the id's next lookup."""
    num_batches = offsets.size - 1
    diff = np.zeros(num_batches + 1, np.int64)
    for b in range(num_batches):
        for a in range(offsets[b], offsets[b + 1]):
            end = min(b + lookahead, nxt[a] - 1, num_batches - 1)
            diff[b] += 1
            diff[end + 1] -= 1
    return np.cumsum(diff[:num_batches])


@dataclass(frozen=True, eq=False)
class BatchTrace:
    """A table's trace as its cache sees it: each batch's unique ids, batches back to back.

    Ids are renumbered ``0 .. distinct - 1`` in their own order, so a batch's ids stay in
    ascending order (the order the cache takes them in) and per-id state costs the distinct
    ids, not the table's rows.

    Attributes:
        ids: the renumbered unique ids of every batch, batch after batch (int32).
        offsets: batch ``b`` is ``ids[offsets[b]:offsets[b + 1]]``.
        distinct: distinct ids in the trace.
        prev_batch / next_batch: per lookup, the batch of its id's previous lookup (-1 for
            none) and next one (``num_batches`` for none).

    Example::

        trace = BatchTrace.from_batches([[3, 1, 3], [1, 2], [3]])
        policy_hit_rates(trace, ReplacementPolicy.MIN, [2, 3], lookahead=0)  # [0.2, 0.4]
    """

    ids: _I32
    offsets: _I64
    distinct: int
    prev_batch: _I32
    next_batch: _I32

    @classmethod
    def from_batches(cls, batches: Iterable[npt.ArrayLike]) -> BatchTrace:
        """The trace of ``batches`` (1-D integer ids each, repeats allowed), in order."""
        uniques: list[_I64] = []
        for i, batch in enumerate(batches):
            ids = np.asarray(batch)
            if ids.ndim != 1:
                raise ValueError(f"batch {i}: ids must be 1-D, got shape {ids.shape}")
            if ids.size and not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"batch {i}: ids must be integers, got dtype {ids.dtype}")
            uniques.append(np.unique(ids.astype(np.int64, copy=False)))
        offsets = np.zeros(len(uniques) + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(u) for u in uniques], dtype=np.int64)
        if len(uniques) >= np.iinfo(np.int32).max:
            raise ValueError(f"a trace of {len(uniques)} batches is too long (at most 2**31 - 2)")
        flat = np.concatenate(uniques) if uniques else np.zeros(0, dtype=np.int64)
        compact, distinct = _renumber(flat)
        prev, nxt = _prev_next(compact, offsets, distinct)
        return cls(compact, offsets, distinct, prev, nxt)

    @property
    def num_batches(self) -> int:
        return len(self.offsets) - 1

    @property
    def lookups(self) -> int:
        """Unique ids summed over batches: the lookups a cache serves."""
        return int(self.ids.size)

    def batch_lookups(self) -> _I64:
        """Lookups per batch."""
        return np.diff(self.offsets)

    @property
    def compulsory_misses(self) -> int:
        """First lookups of each id: misses whatever the cache."""
        return int(np.count_nonzero(self.prev_batch < 0))

    def window_rows(self, lookahead: int) -> _I64:
        """Per batch, the distinct ids its window (it and the ``lookahead`` before it) holds."""
        _check_lookahead(lookahead)
        return _window_rows(self.offsets, self.next_batch, lookahead)

    def min_cache_rows(self, lookahead: int) -> int:
        """The smallest cache that can run the trace: the largest window."""
        windows = self.window_rows(lookahead)
        return int(windows.max()) if windows.size else 0


def _renumber(flat: _I64) -> tuple[_I32, int]:
    """Ids renumbered densely in ascending order, and how many distinct ids there are."""
    if flat.size == 0:
        return np.zeros(0, dtype=np.int32), 0
    lo, hi = int(flat.min()), int(flat.max())
    if lo >= 0 and hi < max(1 << 22, 4 * flat.size):
        present = np.zeros(hi + 1, dtype=np.bool_)
        present[flat] = True
        rank = np.cumsum(present, dtype=np.int64) - 1
        return rank[flat].astype(np.int32), int(rank[-1]) + 1
    uniq, inverse = np.unique(flat, return_inverse=True)
    return inverse.reshape(-1).astype(np.int32), len(uniq)


def _check_lookahead(lookahead: int) -> None:
    if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 0:
        raise ValueError(f"lookahead must be an int >= 0 (batches in flight), got {lookahead!r}")


# ------------------------------------------------------------------------------------ MIN


@_jit
def _tree_apply(t: _I64, d: _I64, size: int, p: int, v: int) -> None:
    t[p] += v
    if p < size:
        d[p] += v


@_jit
def _tree_build(t: _I64, d: _I64, p: int) -> None:
    """Recomputes the ancestors of node ``p`` (pending adds of each node kept in ``d``)."""
    while p > 1:
        p >>= 1
        t[p] = max(t[2 * p], t[2 * p + 1]) + d[p]


@_jit
def _tree_push(t: _I64, d: _I64, size: int, height: int, p: int) -> None:
    """Moves the pending adds of the ancestors of node ``p`` down to their children."""
    for s in range(height, 0, -1):
        i = p >> s
        if d[i] != 0:
            _tree_apply(t, d, size, 2 * i, d[i])
            _tree_apply(t, d, size, 2 * i + 1, d[i])
            d[i] = 0


@_jit
def _tree_add(t: _I64, d: _I64, size: int, lo: int, hi: int, v: int) -> None:
    """Adds ``v`` to leaves ``lo .. hi - 1``."""
    lo += size
    hi += size
    lo0, hi0 = lo, hi
    while lo < hi:
        if lo & 1:
            _tree_apply(t, d, size, lo, v)
            lo += 1
        if hi & 1:
            hi -= 1
            _tree_apply(t, d, size, hi, v)
        lo >>= 1
        hi >>= 1
    _tree_build(t, d, lo0)
    _tree_build(t, d, hi0 - 1)


@_jit
def _tree_max(t: _I64, d: _I64, size: int, height: int, lo: int, hi: int) -> int:
    """The largest of leaves ``lo .. hi - 1``."""
    lo += size
    hi += size
    _tree_push(t, d, size, height, lo)
    _tree_push(t, d, size, height, hi - 1)
    best = -(1 << 62)
    while lo < hi:
        if lo & 1:
            best = max(best, t[lo])
            lo += 1
        if hi & 1:
            hi -= 1
            best = max(best, t[hi])
        lo >>= 1
        hi >>= 1
    return best


@_jit
def _min_hits(
    offsets: _I64, prev: _I32, windows: _I64, cache_rows: int, lookahead: int, first: int
) -> tuple[bool, _I64]:
    """Belady's MIN by interval packing (see the module docstring), the most hits of the
    batches from ``first`` on: ``(feasible, hits per batch)``; not feasible when a window
    does not fit the cache."""
    num_batches = offsets.size - 1
    hits = np.zeros(num_batches, np.int64)
    if num_batches == 0:
        return True, hits
    if windows.max() > cache_rows:
        return False, hits
    size = 1
    height = 0
    while size < num_batches:
        size *= 2
        height += 1
    # Leaf s: slots batch s uses, its window's rows plus the reuse intervals kept across it.
    t = np.zeros(2 * size, np.int64)
    d = np.zeros(size, np.int64)
    t[size : size + num_batches] = windows
    for p in range(size - 1, 0, -1):
        t[p] = max(t[2 * p], t[2 * p + 1])
    for b in range(num_batches):
        for a in range(offsets[b], offsets[b + 1]):
            j = prev[a]
            if j < 0:
                continue  # compulsory miss
            if b - j <= lookahead + 1:
                hits[b] += 1  # held until its next use: no choice to make
                continue
            lo = j + lookahead + 1
            if b >= first and _tree_max(t, d, size, height, lo, b) < cache_rows:
                _tree_add(t, d, size, lo, b, 1)
                hits[b] += 1
    return True, hits


# ------------------------------------------------------------------------ heaps for policies


@_jit
def _heap_less(k1: _I64, k2: _I64, i: int, j: int) -> bool:
    return k1[i] < k1[j] or (k1[i] == k1[j] and k2[i] < k2[j])


@_jit
def _heap_push(k1: _I64, k2: _I64, n: int, a: int, b: int) -> int:
    """Pushes ``(a, b)`` on the min-heap of ``n`` entries; returns its new size."""
    i = n
    k1[i] = a
    k2[i] = b
    while i > 0:
        parent = (i - 1) >> 1
        if not _heap_less(k1, k2, i, parent):
            break
        k1[i], k1[parent] = k1[parent], k1[i]
        k2[i], k2[parent] = k2[parent], k2[i]
        i = parent
    return n + 1


@_jit
def _heap_pop(k1: _I64, k2: _I64, n: int) -> int:
    """Removes the smallest entry (moved to index ``n - 1``); returns the new size."""
    n -= 1
    k1[0], k1[n] = k1[n], k1[0]
    k2[0], k2[n] = k2[n], k2[0]
    i = 0
    while True:
        left = 2 * i + 1
        if left >= n:
            break
        child = left
        if left + 1 < n and _heap_less(k1, k2, left + 1, left):
            child = left + 1
        if not _heap_less(k1, k2, child, i):
            break
        k1[i], k1[child] = k1[child], k1[i]
        k2[i], k2[child] = k2[child], k2[i]
        i = child
    return n


# ----------------------------------------------------------------------- MIN seeing ahead


@_jit
def _seen_ahead_hits(
    ids: _I32,
    offsets: _I64,
    prev: _I32,
    nxt: _I32,
    distinct: int,
    cache_rows: int,
    lookahead: int,
    horizon: int,
) -> tuple[bool, _I64]:
    """The look-ahead-aware policy (see the module docstring): ``(feasible, hits per batch)``.

    Rows leave the window of protected rows ``lookahead + 1`` batches after their last use.
    An evictable row whose next use lies within the horizon is *known* and sits in a heap
    keyed by (minus) its next use; the others are evicted in order of last use from a FIFO
    whose stale entries (the row used again, evicted or known since) are skipped."""
    num_batches = offsets.size - 1
    n = ids.size
    hits = np.zeros(num_batches, np.int64)
    resident = np.zeros(distinct, np.bool_)
    known = np.zeros(distinct, np.bool_)
    last = np.full(distinct, -1, np.int64)
    next_use = np.full(distinct, num_batches, np.int64)
    fifo = np.empty(n, np.int32)  # ids in order of use; an entry is live iff last matches
    fifo_at = np.empty(n, np.int64)
    head = 0
    tail = 0
    k1 = np.empty(2 * n + 1, np.int64)  # -next use: the furthest first
    k2 = np.empty(2 * n + 1, np.int64)  # id
    heap = 0
    num_resident = 0
    for t in range(num_batches):
        r = t - lookahead - 1
        if r >= 0:  # batch r leaves the window: its rows not used since become evictable
            for a in range(offsets[r], offsets[r + 1]):
                x = ids[a]
                seen = t <= nxt[a] <= t + horizon and nxt[a] < num_batches
                if seen and not known[x]:
                    known[x] = True
                    heap = _heap_push(k1, k2, heap, -nxt[a], x)
        e = t + horizon
        if horizon > 0 and e < num_batches:  # batch e comes into view
            for a in range(offsets[e], offsets[e + 1]):
                x = ids[a]
                p = prev[a]
                # Rows still in the window are taken in when they leave it (above).
                if 0 <= p < t - lookahead and resident[x] and not known[x]:
                    known[x] = True
                    heap = _heap_push(k1, k2, heap, -e, x)
        misses = 0
        for a in range(offsets[t], offsets[t + 1]):
            x = ids[a]
            last[x] = t
            known[x] = False
            next_use[x] = nxt[a]
            if resident[x]:
                hits[t] += 1
            else:
                misses += 1
        need = num_resident + misses - cache_rows
        while need > 0 and head < tail and fifo_at[head] < t - lookahead:
            x = fifo[head]
            if last[x] == fifo_at[head] and resident[x] and not known[x]:
                resident[x] = False
                num_resident -= 1
                need -= 1
            head += 1
        while need > 0 and heap > 0:
            heap = _heap_pop(k1, k2, heap)
            x = k2[heap]
            if known[x] and resident[x] and next_use[x] == -k1[heap]:
                known[x] = False
                resident[x] = False
                num_resident -= 1
                need -= 1
        if need > 0:
            return False, hits
        for a in range(offsets[t], offsets[t + 1]):
            x = ids[a]
            if not resident[x]:
                resident[x] = True
                num_resident += 1
            fifo[tail] = x
            fifo_at[tail] = t
            tail += 1
    return True, hits


# ------------------------------------------------------------------ the cache's LRU and LFU


@_jit
def _replay_hits(
    ids: _I32,
    offsets: _I64,
    nxt: _I32,
    distinct: int,
    cache_rows: int,
    lookahead: int,
    counting: bool,
    decay_interval: int,
) -> tuple[bool, _I64]:
    """The row cache's LRU (``counting`` false) or LFU replayed: ``(feasible, hits per
    batch)``. LFU keeps the rows outside the window in a min-heap keyed ``(count << 32 | last
    use, slot)``; an entry is live iff its slot still holds a row of that count and last use.
    LRU's rows leave the window in order of last use, so a FIFO of each released batch's
    slots, sorted, is already its victim order."""
    num_batches = offsets.size - 1
    n = ids.size
    hits = np.zeros(num_batches, np.int64)
    slot_of = np.full(distinct, -1, np.int64)
    id_of = np.full(max(cache_rows, 1), -1, np.int64)
    count = np.zeros(distinct, np.int64)
    last = np.full(distinct, -1, np.int64)
    k1 = np.empty(n + max(cache_rows, 1) + 1, np.int64)
    k2 = np.empty(n + max(cache_rows, 1) + 1, np.int64)
    heap = 0  # LFU: entries in the heap; LRU: the FIFO's tail
    head = 0  # LRU: the FIFO's head
    num_free = cache_rows
    plans = 0
    misses = np.empty(n, np.int64)
    for t in range(num_batches):
        r = t - lookahead - 1
        if r >= 0:  # batch r's holds are released
            start = heap
            for a in range(offsets[r], offsets[r + 1]):
                if nxt[a] >= t:
                    x = ids[a]
                    if counting:
                        heap = _heap_push(k1, k2, heap, (count[x] << 32) | last[x], slot_of[x])
                    else:
                        k1[heap] = r
                        k2[heap] = slot_of[x]
                        heap += 1
            if not counting:
                k2[start:heap] = np.sort(k2[start:heap])
        num_miss = 0
        for a in range(offsets[t], offsets[t + 1]):
            x = ids[a]
            if slot_of[x] >= 0:
                hits[t] += 1
                if counting:
                    count[x] += 1
                last[x] = t
            else:
                misses[num_miss] = x
                num_miss += 1
        first_free = cache_rows - num_free
        from_free = min(num_miss, num_free)
        for m in range(num_miss):
            if m < from_free:
                s = first_free + m
                num_free -= 1
            else:
                s = -1
                while not counting and head < heap:
                    v = k2[head]
                    y = id_of[v]
                    head += 1
                    if y >= 0 and last[y] == k1[head - 1]:
                        s = v
                        slot_of[y] = -1
                        break
                while counting and heap > 0:
                    heap = _heap_pop(k1, k2, heap)
                    v = k2[heap]
                    y = id_of[v]
                    if (
                        y >= 0
                        and last[y] < t - lookahead
                        and k1[heap] == (count[y] << 32) | last[y]
                    ):
                        s = v
                        slot_of[y] = -1
                        break
                if s < 0:
                    return False, hits
            x = misses[m]
            id_of[s] = x
            slot_of[x] = s
            count[x] = 1 if counting else 0
            last[x] = t
        if counting:
            plans += 1
            if plans >= decay_interval:
                plans = 0
                heap = 0
                for s in range(cache_rows):
                    y = id_of[s]
                    if y >= 0:
                        count[y] //= 2
                        if last[y] < t - lookahead:
                            heap = _heap_push(k1, k2, heap, (count[y] << 32) | last[y], s)
    return True, hits


# -------------------------------------------------------------------------------- the API


def batch_hits(
    trace: BatchTrace,
    policy: ReplacementPolicy | str,
    cache_rows: int,
    lookahead: int,
    *,
    horizon: int | None = None,
    decay_interval: int = LFU_DECAY_INTERVAL,
    first: int = 0,
) -> _I64 | None:
    """Hits per batch of ``policy`` with a cache of ``cache_rows`` rows.

    Args:
        trace: the table's trace.
        policy: which policy (see :class:`ReplacementPolicy`).
        cache_rows: cache capacity in rows.
        lookahead: batches in flight while one is planned (``pipeline.lookahead``).
        horizon: batches after the planned one that ``min_seen_ahead`` sees (default
            ``lookahead``).
        decay_interval: batches between LFU's halvings of its counts.
        first: MIN maximizes the hits of the batches from this one on (its hits of earlier
            batches are then not MIN's); the other policies do not look at it.

    Returns:
        Hits per batch, or ``None`` when some window does not fit the cache.
    """
    policy = ReplacementPolicy(policy)
    _check_lookahead(lookahead)
    if isinstance(cache_rows, bool) or int(cache_rows) != cache_rows or cache_rows < 0:
        raise ValueError(f"cache_rows must be an int >= 0, got {cache_rows!r}")
    rows = int(cache_rows)
    if policy is ReplacementPolicy.MIN:
        windows = trace.window_rows(lookahead)
        ok, hits = _min_hits(trace.offsets, trace.prev_batch, windows, rows, lookahead, first)
    elif policy is ReplacementPolicy.MIN_SEEN_AHEAD:
        ahead = lookahead if horizon is None else horizon
        if ahead < 0:
            raise ValueError(f"horizon must be >= 0 batches, got {ahead}")
        ok, hits = _seen_ahead_hits(
            trace.ids,
            trace.offsets,
            trace.prev_batch,
            trace.next_batch,
            trace.distinct,
            rows,
            lookahead,
            min(ahead, trace.num_batches),
        )
    else:
        if decay_interval < 1:
            raise ValueError(f"decay_interval must be >= 1, got {decay_interval}")
        ok, hits = _replay_hits(
            trace.ids,
            trace.offsets,
            trace.next_batch,
            trace.distinct,
            rows,
            lookahead,
            policy is ReplacementPolicy.LFU,
            decay_interval,
        )
    return hits if ok else None


def policy_hit_rates(
    trace: BatchTrace,
    policy: ReplacementPolicy | str,
    cache_rows: Sequence[int] | npt.ArrayLike,
    lookahead: int,
    *,
    horizon: int | None = None,
    decay_interval: int = LFU_DECAY_INTERVAL,
    first: int = 0,
) -> _F64:
    """Hit rate of ``policy`` at each cache size: hits / unique lookups of the batches from
    ``first`` on (all by default; the cache runs the whole trace either way, and MIN bounds
    the hits of those batches). NaN where a window does not fit; 0 for a trace without
    lookups. See :func:`batch_hits` for the arguments."""
    sizes = np.asarray(cache_rows).reshape(-1)
    lookups = int(trace.batch_lookups()[first:].sum())
    out = np.full(sizes.shape, np.nan, dtype=np.float64)
    for i, rows in enumerate(sizes.tolist()):
        hits = batch_hits(
            trace,
            policy,
            rows,
            lookahead,
            horizon=horizon,
            decay_interval=decay_interval,
            first=first,
        )
        if hits is not None:
            out[i] = float(hits[first:].sum()) / lookups if lookups else 0.0
    return out


def policy_curve(
    trace: BatchTrace,
    policy: ReplacementPolicy | str,
    sizes: Sequence[int] | npt.ArrayLike,
    lookahead: int,
    *,
    decay_interval: int = LFU_DECAY_INTERVAL,
) -> tuple[tuple[int, float], ...]:
    """``(cache_rows, hit_rate)`` points of ``policy`` at the sizes a window fits, ascending."""
    grid = np.unique(np.asarray(sizes, dtype=np.int64))
    rates = policy_hit_rates(trace, policy, grid, lookahead, decay_interval=decay_interval)
    return tuple((int(s), float(r)) for s, r in zip(grid, rates) if not np.isnan(r))


def curve_sizes(trace: BatchTrace, lookahead: int, points: int) -> _I64:
    """``points`` cache sizes spaced geometrically from the smallest that runs the trace to one
    holding every row it uses (beyond which no policy evicts); none for a trace without
    lookups."""
    if points < 2:
        raise ValueError(f"points must be >= 2, got {points}")
    low = trace.min_cache_rows(lookahead)
    if low == 0:
        return np.zeros(0, dtype=np.int64)
    high = max(low, trace.distinct)
    return np.unique(np.rint(np.geomspace(low, high, points)).astype(np.int64))


def policy_curves(
    trace: BatchTrace,
    lookahead: int,
    points: int,
    *,
    decay_interval: int = LFU_DECAY_INTERVAL,
) -> PolicyCurves:
    """The MIN, MIN-seeing-``lookahead``-ahead and LFU curves of a trace at
    :func:`curve_sizes`."""
    sizes = curve_sizes(trace, lookahead, points)

    def curve(policy: ReplacementPolicy) -> tuple[tuple[int, float], ...]:
        return policy_curve(trace, policy, sizes, lookahead, decay_interval=decay_interval)

    return PolicyCurves(
        lookahead=lookahead,
        min_cache_rows=trace.min_cache_rows(lookahead),
        lfu_decay_interval=decay_interval,
        optimal=curve(ReplacementPolicy.MIN),
        seen_ahead=curve(ReplacementPolicy.MIN_SEEN_AHEAD),
        lfu=curve(ReplacementPolicy.LFU),
    )
