"""Deliberately naive references for ``profiler.replacement``: the optimum by exhaustive search,
the seen-ahead policy with Python sets, and the row cache itself (``TableCache``) replayed.

Each takes the trace as lists of ids and returns hits per batch, or ``None`` when some batch's
window (it and the ``lookahead`` batches before it) does not fit the cache.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from torchrec_mtrains.cache.policies import LFUPolicy, LRUPolicy
from torchrec_mtrains.cache.table_cache import CacheTooSmallError, TableCache

Trace = list[list[int]]


def unique_batches(batches: Sequence[Sequence[int]]) -> Trace:
    return [sorted(set(b)) for b in batches]


def windows(trace: Trace, lookahead: int) -> list[frozenset[int]]:
    """The rows each batch's window holds."""
    return [
        frozenset(i for b in trace[max(0, t - lookahead) : t + 1] for i in b)
        for t in range(len(trace))
    ]


def optimal_hits(trace: Trace, cache_rows: int, lookahead: int, first: int = 0) -> int | None:
    """The most hits any cache of ``cache_rows`` rows can have in the batches from ``first``
    on: every set of rows it may hold after each batch (the window's rows, plus any of what it
    held or loaded), searched."""
    need = windows(trace, lookahead)
    if any(len(w) > cache_rows for w in need):
        return None

    @functools.cache
    def best(t: int, cache: frozenset[int]) -> int:
        if t == len(trace):
            return 0
        hits = len(cache.intersection(trace[t])) if t >= first else 0
        pool = cache | set(trace[t])
        optional = sorted(pool - need[t])
        room = cache_rows - len(need[t])
        most = 0
        for n in range(min(room, len(optional)) + 1):
            for keep in itertools.combinations(optional, n):
                most = max(most, best(t + 1, need[t] | frozenset(keep)))
        return hits + most

    return best(0, frozenset())


def seen_ahead_hits(
    trace: Trace, cache_rows: int, lookahead: int, horizon: int
) -> list[int] | None:
    """The policy that sees the next ``horizon`` batches: evicts the rows outside the window it
    sees no use of, least recently used first (ties by id), then those it sees, furthest next
    use first (ties by id)."""
    need = windows(trace, lookahead)
    cache: set[int] = set()
    last: dict[int, int] = {}
    out = []
    for t, batch in enumerate(trace):
        out.append(len(cache.intersection(batch)))
        for i in batch:
            last[i] = t
        misses = [i for i in batch if i not in cache]
        excess = len(cache) + len(misses) - cache_rows
        if excess > 0:
            seen: dict[int, int] = {}
            for u in range(t + horizon, t, -1):
                if u < len(trace):
                    seen.update(dict.fromkeys(trace[u], u))
            free = [i for i in cache if i not in need[t]]
            unseen = sorted((i for i in free if i not in seen), key=lambda i: (last[i], i))
            ahead = sorted((i for i in free if i in seen), key=lambda i: (-seen[i], i))
            victims = (unseen + ahead)[:excess]
            if len(victims) < excess:
                return None
            cache.difference_update(victims)
        cache.update(misses)
    return out


def cache_hits(
    trace: Trace, cache_rows: int, lookahead: int, policy: str, decay_interval: int = 1_000
) -> list[int] | None:
    """The row cache replaying the trace as the look-ahead pipeline drives it: batch ``t`` is
    planned while batches ``t - lookahead .. t - 1`` hold their slots."""
    if cache_rows == 0:
        return None if any(trace) else [0] * len(trace)
    num_rows = max((max(b) for b in trace if b), default=0) + 1
    kind = LFUPolicy(cache_rows, decay_interval=decay_interval) if policy == "lfu" else None
    cache = TableCache("replay", num_rows, cache_rows, kind or LRUPolicy(cache_rows))
    held: list[torch.Tensor] = []
    out = []
    for batch in trace:
        if len(held) > lookahead:
            cache.release(held.pop(0))
        ids = torch.tensor(batch, dtype=torch.int64)
        try:
            plan = cache.plan(ids)
        except CacheTooSmallError:
            return None
        cache.hold(plan.slots)
        held.append(plan.slots)
        out.append(int(ids.numel()) - int(plan.load_ids.numel()))
    return out


def random_trace(rng: np.random.Generator, batches: int, ids: int, per_batch: int) -> Trace:
    """Zipf-ish ids: a few hot rows and a tail."""
    out = []
    for _ in range(batches):
        draw = (rng.zipf(1.3, size=per_batch) - 1) % ids
        out.append(sorted({int(i) for i in draw}))
    return out
