"""A deliberately naive LRU cache simulator, the reference the stack-distance code must match.

It replays the documented trace: each batch's unique ids, previously seen ids most recently
used first, then new ids in ascending order, one access at a time through an OrderedDict.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


def batch_trace(batches: Sequence[npt.ArrayLike]) -> list[list[int]]:
    """Each batch's unique ids in the documented replay order."""
    last_use: dict[int, int] = {}
    clock = 0
    out: list[list[int]] = []
    for batch in batches:
        ids = sorted({int(i) for i in np.asarray(batch).reshape(-1)})
        warm = sorted((i for i in ids if i in last_use), key=lambda i: -last_use[i])
        cold = [i for i in ids if i not in last_use]
        ordered = warm + cold
        for i in ordered:
            last_use[i] = clock
            clock += 1
        out.append(ordered)
    return out


def simulate_lru(batches: Sequence[npt.ArrayLike], cache_rows: int) -> list[dict[int, bool]]:
    """Per batch, id -> hit in an LRU cache of ``cache_rows`` rows (cold accesses miss)."""
    cache: OrderedDict[int, None] = OrderedDict()
    result: list[dict[int, bool]] = []
    for ordered in batch_trace(batches):
        resident_at_start = {i for i in ordered if i in cache}
        hits: dict[int, bool] = {}
        for i in ordered:
            if i in cache:
                hits[i] = True
                cache.move_to_end(i)
            else:
                hits[i] = False
                if cache_rows > 0:
                    cache[i] = None
                    if len(cache) > cache_rows:
                        cache.popitem(last=False)
        # The batch rule the profiler documents: a hit is a row resident when the batch began.
        assert {i for i, h in hits.items() if h} == resident_at_start
        result.append(hits)
    return result


def lru_hit_rate(batches: Sequence[npt.ArrayLike], cache_rows: int) -> float:
    flags = [h for batch in simulate_lru(batches, cache_rows) for h in batch.values()]
    return sum(flags) / len(flags) if flags else 0.0


def zipf_batches(
    seed: int, num_rows: int, alpha: float, batch_ids: int, num_batches: int
) -> list[npt.NDArray[np.int64]]:
    """Zipf-distributed ids, hot ranks scattered over the table by a fixed permutation."""
    rng = np.random.default_rng(seed)
    perm = rng.permutation(num_rows)
    return [
        perm[(rng.zipf(alpha, size=batch_ids) - 1) % num_rows].astype(np.int64)
        for _ in range(num_batches)
    ]
