"""Instruments on a running tiered model: how long its block tier's calls took and how busy
it was, what its caches did between two snapshots, and its miss service with nothing else
running. Timing wraps the stores' calls in place; nothing else about the model changes.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from torchrec_mtrains.distributed import tier_io
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup

__all__ = ["TierClock", "caches_full", "isolated_block_reads", "tier_delta", "tier_snapshot"]


class TierClock:
    """Times the tiers' work: each read (a worker's reads of a batch's misses, all its tables
    together: ``read_rows_together`` as the tier worker calls it, or one in-memory store's
    ``read_rows_into``) and each store's write call (``write_rows``, ``write_rows_from``),
    and the time at least one read (write) was in flight, which is what a rate over several
    concurrent workers must divide by; the CPU time the calling threads spent in those calls,
    and how much of it in the kernel (``getrusage`` of the thread: the block I/O's system
    calls, copies and faults); plus the kernel's own counters
    (``TieredTableGroup.io_counters``): the training thread's stall and the workers' I/O time.
    Timing wraps those calls in place (in this process, for good); nothing else changes."""

    def __init__(self, groups: list[TieredTableGroup]) -> None:
        self.groups = groups
        self._lock = threading.Lock()
        self.calls_s = {"read": 0.0, "write": 0.0}
        self.busy_s = {"read": 0.0, "write": 0.0}
        self.rows = {"read": 0, "write": 0}
        self.cpu_s = {"read": 0.0, "write": 0.0}
        self.kernel_s = {"read": 0.0, "write": 0.0}
        self._active = {"read": 0, "write": 0}
        self._since = {"read": 0.0, "write": 0.0}
        worker = vars(tier_io)  # the tier worker's module: its reads go through this name
        worker["read_rows_together"] = self._timed(
            worker["read_rows_together"], "read", lambda reqs: sum(len(i) for _, i in reqs)
        )
        for group in groups:
            for shard in group.shards:
                store = shard.store  # (instrumented in place)
                store.write_rows = self._timed(store.write_rows, "write", len)  # type: ignore[method-assign]
                store.write_rows_from = self._timed(store.write_rows_from, "write", len)  # type: ignore[method-assign]
                store.read_rows_into = self._timed(store.read_rows_into, "read", len)  # type: ignore[method-assign]

    def _timed(self, fn: Any, key: str, rows_of: Callable[[Any], int]) -> Any:
        def wrapped(ids: Any, *args: Any, **kwargs: Any) -> Any:
            with self._lock:
                t0 = time.perf_counter()
                if self._active[key] == 0:
                    self._since[key] = t0
                self._active[key] += 1
            used0 = _thread_cpu()
            try:
                return fn(ids, *args, **kwargs)
            finally:
                used1 = _thread_cpu()
                with self._lock:
                    self.cpu_s[key] += used1[0] - used0[0]
                    self.kernel_s[key] += used1[1] - used0[1]
                    t1 = time.perf_counter()
                    self._active[key] -= 1
                    if self._active[key] == 0:
                        self.busy_s[key] += t1 - self._since[key]
                    self.calls_s[key] += t1 - t0
                    self.rows[key] += rows_of(ids)

        return wrapped

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out = {f"{k}_calls_s": v for k, v in self.calls_s.items()}
            out.update({f"{k}_busy_s": v for k, v in self.busy_s.items()})
            out.update({f"rows_{k}": float(v) for k, v in self.rows.items()})
            out.update({f"{k}_cpu_s": v for k, v in self.cpu_s.items()})
            out.update({f"{k}_kernel_s": v for k, v in self.kernel_s.items()})
        counters = [g.io_counters() for g in self.groups]
        out["stall_s"] = sum(c.stall_seconds for c in counters)
        out["io_s"] = sum(c.io_seconds for c in counters)
        return out


def _thread_cpu() -> tuple[float, float]:
    """The calling thread's CPU seconds so far, all and in the kernel."""
    used = resource.getrusage(resource.RUSAGE_THREAD)
    return used.ru_utime + used.ru_stime, used.ru_stime


def caches_full(groups: list[TieredTableGroup]) -> bool:
    """Whether every tiered table's cache holds a row in each of its slots: from then on a
    step evicts as many rows as it loads (a benchmark's steady state)."""
    return all(
        shard.cache.num_resident == shard.cache.num_slots for g in groups for shard in g.shards
    )


def tier_snapshot(groups: list[TieredTableGroup]) -> dict[str, dict[str, float]]:
    """Every tiered table's counters now (lookups, hits, write-backs, tier bytes, ...)."""
    out: dict[str, dict[str, float]] = {}
    for group in groups:
        out.update(group.stats())
    return out


def tier_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """What the tables did between two :func:`tier_snapshot`: per table and summed."""
    tables: dict[str, dict[str, float]] = {}
    for name, stats in after.items():
        d = {k: v - before[name].get(k, 0.0) for k, v in stats.items() if k != "hit_rate"}
        d["hit_rate"] = d["hits"] / d["lookups"] if d["lookups"] else 0.0
        tables[name] = d
    lookups = sum(t["lookups"] for t in tables.values())
    hits = sum(t["hits"] for t in tables.values())
    return {
        "hit_rate": hits / lookups if lookups else None,
        "lookups": lookups,
        "misses": lookups - hits,
        "writebacks": sum(t["writebacks"] for t in tables.values()),
        "tier_bytes_read": sum(t["tier_bytes_read"] for t in tables.values()),
        "tier_rows_read": sum(t.get("tier_rows_read", 0.0) for t in tables.values()),
        "tier_bytes_written": sum(t["tier_bytes_written"] for t in tables.values()),
        "tier_io_calls": sum(t.get("tier_io_calls", 0.0) for t in tables.values()),
        "tables": tables,
    }


def isolated_block_reads(groups: list[TieredTableGroup], rows: int, calls: int = 20) -> Any:
    """Random single-row reads from the largest block-tier table alone (no training running),
    in calls of ``rows`` ids, the size of a step's misses: the tier's miss service without
    competition for the CPU."""
    shards = [sh for g in groups for sh in g.shards if sh.store.serves_tier == "block_scm"]
    if not shards or rows <= 0:
        return None
    store = max(shards, key=lambda sh: sh.local_rows).store
    rng = np.random.default_rng(1)
    n, spent = 0, 0.0
    for _ in range(calls):
        ids = np.unique(rng.integers(0, store.layout.num_rows, rows))
        t0 = time.perf_counter()
        store.read_rows(ids)
        spent += time.perf_counter() - t0
        n += ids.size
    return {"table_rows": store.layout.num_rows, "rows_per_call": rows, "rows_per_s": n / spent}
