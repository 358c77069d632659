"""Per-batch cost of the row caches' bookkeeping, and how much of it holds the GIL.

The tier-I/O worker plans each batch (dedup, ``check_fits``, ``plan``, ``hold``) while the
training thread runs Python; both only get a core each if planning releases the GIL. This plays
the per-batch cache work of ``TieredTableGroup`` (``distributed/tiered_tables.py``) on W1-like
batches, without any row movement:

* ``--tables`` tables with row counts log-spaced over ``--min-rows`` .. ``--max-rows``, Zipf(s)
  ids scattered by a fixed random permutation per table, ``--batch`` ids per table and batch;
* a cache of ``--cache-frac`` of each table's rows (at least ``lookahead + 2`` batches of ids,
  at most the table), ``--lookahead`` batches held in flight as the look-ahead pipeline does;
* per batch and table: ``torch.unique(ids, return_inverse=True)``, ``check_fits``, ``plan``,
  ``hold``, the remap ``plan.slots[inverse]``, ``mark_dirty``, and the release of the batch that
  left the pipeline.

Three timed passes over the same batches, each on fresh caches after ``--warmup`` batches:

1. ``alone``: ms per batch with nothing else running.
2. ``idle``: a second thread (``_Counter``, a stand-in for the training thread) alternates short
   bursts of Python with small GIL-free torch ops while the main thread sleeps.
3. ``contended``: the same thread runs during planning.

Reported: ``gil_share``, the share of the planning time the planner held the GIL while the
other thread wanted it (the extra time that thread's torch ops took to get the GIL back, per
second of planning, over its idle figure): about 0 for planning that never holds the GIL, about
40% for a pure-Python loop in its place (CPython makes the two take turns); ``counter_share``, that
thread's speed beside planning / idle (on a machine with other busy processes this also counts
the core they take); and ``slowdown``, contended / alone planning time.

``--backend`` picks ``TableCache``'s implementation: ``numba`` (compiled kernels that release the
GIL, on CPU bookkeeping) or ``torch`` (vectorized torch ops, the same-run baseline). ``all`` (the
default) runs each in turn on the same batches. The planning code before both is measured in
``docs/benchmarks.md`` (its ``legacy`` row, from git history), not kept here.

Example::

    .venv/bin/python benchmarks/cache_bench.py                        # W1-like, ~1-2 min
    .venv/bin/python benchmarks/cache_bench.py --policy lfu --out /tmp/cache.json
    .venv/bin/python benchmarks/cache_bench.py --smoke                # seconds; the tests
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrec_mtrains.cache import kernels
from torchrec_mtrains.cache.table_cache import TableCache

_BACKENDS = ("torch", "numba")


def zipf_ids(rows: int, n: int, exponent: float, rng: np.random.Generator) -> np.ndarray:
    """``n`` ids of a bounded Zipf law over ``rows`` ranks, scattered by a fixed permutation
    (hot ids are not the low ids, as in ``SyntheticCriteoDataset``)."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights)
    cdf /= cdf[-1]
    ranks = np.searchsorted(cdf, rng.random(n), side="right")
    np.minimum(ranks, rows - 1, out=ranks)
    return rng.permutation(rows)[ranks].astype(np.int64)


@dataclass
class Workload:
    rows: list[int]
    slots: list[int]
    batches: list[list[torch.Tensor]]  # [batch][table]


def make_workload(args: argparse.Namespace) -> Workload:
    rows = [
        round(v)
        for v in np.logspace(math.log10(args.min_rows), math.log10(args.max_rows), args.tables)
    ]
    floor = (args.lookahead + 2) * args.batch
    slots = [min(r, max(math.ceil(args.cache_frac * r), floor)) for r in rows]
    total = args.warmup + args.batches
    per_table = []
    for t, r in enumerate(rows):
        rng = np.random.default_rng(1000 + t)
        per_table.append(zipf_ids(r, total * args.batch, args.zipf, rng).reshape(total, -1))
    batches = [[torch.from_numpy(per_table[t][b]) for t in range(len(rows))] for b in range(total)]
    return Workload(rows, slots, batches)


def _new_caches(w: Workload, policy: str, backend: str) -> list[TableCache]:
    tables = enumerate(zip(w.rows, w.slots))
    return [TableCache(f"t{i}", r, s, policy, backend=backend) for i, (r, s) in tables]


def _run_batches(
    caches: list[TableCache],
    batches: list[list[torch.Tensor]],
    lookahead: int,
    stages: dict[str, float] | None = None,
) -> None:
    """The per-batch cache work of ``TieredTableGroup._plan`` and ``remap``, in its order;
    adds each stage's seconds to ``stages`` if given."""
    held: deque[list[torch.Tensor]] = deque()
    clock = time.perf_counter
    spent = stages if stages is not None else {}
    for tables in batches:
        t = clock()
        uniques = [torch.unique(ids, return_inverse=True) for ids in tables]
        t, spent["unique"] = clock(), spent.get("unique", 0.0) + clock() - t
        for cache, (uniq, _) in zip(caches, uniques):
            cache.check_fits(uniq)
        t, spent["check_fits"] = clock(), spent.get("check_fits", 0.0) + clock() - t
        plans = [cache.plan(uniq) for cache, (uniq, _) in zip(caches, uniques)]
        t, spent["plan"] = clock(), spent.get("plan", 0.0) + clock() - t
        for cache, plan in zip(caches, plans):
            cache.hold(plan.slots)
        t, spent["hold"] = clock(), spent.get("hold", 0.0) + clock() - t
        for plan, (_, inverse) in zip(plans, uniques):
            plan.slots[inverse]  # the remap of the batch's ids to slots
        t, spent["remap"] = clock(), spent.get("remap", 0.0) + clock() - t
        for cache, plan in zip(caches, plans):
            cache.mark_dirty(plan.slots)
        t, spent["mark_dirty"] = clock(), spent.get("mark_dirty", 0.0) + clock() - t
        held.append([plan.slots for plan in plans])
        if len(held) > lookahead + 1:
            for cache, slots in zip(caches, held.popleft()):
                cache.release(slots)
        spent["release"] = spent.get("release", 0.0) + clock() - t
    for batch_slots in held:  # the batches still in flight finish (untimed)
        for cache, slots in zip(caches, batch_slots):
            cache.release(slots)


class _Counter(threading.Thread):
    """A stand-in for the training thread: runs Python (counting loop iterations) in bursts of
    ``burst`` iterations, each followed by a small torch op that releases the GIL (tens of
    microseconds each), as a training loop alternates Python with tensor ops. It adds up how long
    those ops took: beyond their idle time, that is the time it waited to get the GIL back, i.e.
    the time another thread held it (a direct measure, unlike its speed, which also drops when
    other processes on a busy machine take its core).

    (A neighbour that never lets the GIL go, or lets it go and takes it straight back, is worse
    than any training loop: a thread coming back from a GIL-free call then waits for CPython's
    switch interval, 5 ms, so planning in many short calls would crawl beside it.)"""

    def __init__(self, burst: int = 1024) -> None:
        super().__init__(daemon=True)
        self.count = 0
        self.waited = 0.0
        self._burst = burst
        self._stop_flag = False

    def run(self) -> None:
        n, waited, burst, clock = 0, 0.0, self._burst, time.perf_counter
        x = torch.ones(1 << 20)  # (4 MB: each op ~0.1 ms)
        while not self._stop_flag:
            n += 1
            if n % burst == 0:
                self.count, self.waited = n, waited
                t = clock()
                torch.mul(x, 1.0, out=x)  # releases the GIL; back once the other one lets it go
                waited += clock() - t
        self.count, self.waited = n, waited

    def stop(self) -> tuple[int, float]:
        self._stop_flag = True
        self.join()
        return self.count, self.waited


def _timed(w: Workload, args: argparse.Namespace, backend: str, counter: bool) -> dict[str, float]:
    caches = _new_caches(w, args.policy, backend)
    _run_batches(caches, w.batches[: args.warmup], args.lookahead)
    timed = w.batches[args.warmup :]
    thread = _Counter() if counter else None
    if thread is not None:
        thread.start()
        time.sleep(0.05)
        c0, w0 = thread.count, thread.waited
    stages: dict[str, float] = {}
    start = time.perf_counter()
    _run_batches(caches, timed, args.lookahead, stages)
    elapsed = time.perf_counter() - start
    out = {"ms_per_batch": 1e3 * elapsed / len(timed), "seconds": elapsed}
    out.update({f"ms_{k}": 1e3 * v / len(timed) for k, v in stages.items()})
    if thread is not None:
        count, waited = thread.stop()
        out["count"], out["waited"] = float(count - c0), waited - w0
    hits = sum(c.stats.hits for c in caches)
    lookups = sum(c.stats.lookups for c in caches)
    out["hit_rate"] = hits / lookups if lookups else 0.0
    out["evictions_per_batch"] = sum(c.stats.evictions for c in caches) / (args.warmup + len(timed))
    return out


def _idle_counter(seconds: float) -> tuple[float, float]:
    """The counter's iterations per second, and share of time spent waiting for the GIL, when
    the main thread only sleeps."""
    thread = _Counter()
    thread.start()
    time.sleep(0.05)
    c0, w0 = thread.count, thread.waited
    time.sleep(seconds)
    count, waited = thread.stop()
    return (count - c0) / seconds, (waited - w0) / seconds


def bench_backend(w: Workload, args: argparse.Namespace, backend: str) -> dict[str, Any]:
    alone = _timed(w, args, backend, counter=False)
    idle_rate, idle_wait = _idle_counter(max(1.0, min(alone["seconds"], 5.0)))
    contended = _timed(w, args, backend, counter=True)
    return {
        "backend": backend,
        "ms_per_batch": alone["ms_per_batch"],
        "contended_ms_per_batch": contended["ms_per_batch"],
        "counter_share": contended["count"] / contended["seconds"] / idle_rate,
        "slowdown": contended["seconds"] / alone["seconds"],
        "gil_share": max(0.0, contended["waited"] / contended["seconds"] - idle_wait),
        "hit_rate": alone["hit_rate"],
        "evictions_per_batch": alone["evictions_per_batch"],
        "ms_per_stage": {
            k[3:]: v for k, v in alone.items() if k.startswith("ms_") and k != "ms_per_batch"
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tables", type=int, default=26)
    p.add_argument("--min-rows", type=float, default=1e3)
    p.add_argument("--max-rows", type=float, default=1e7)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--cache-frac", type=float, default=0.15)
    p.add_argument("--lookahead", type=int, default=1)
    p.add_argument("--policy", default="lru")
    p.add_argument("--backend", default="all", help="torch, numba, or all (each available)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (seconds)")
    p.add_argument("--out", type=Path, default=None, help="also write the results as JSON")
    args = p.parse_args(argv)
    if args.smoke:
        args.tables, args.max_rows, args.batch, args.batches, args.warmup = 3, 1e5, 512, 10, 3
    torch.set_num_threads(args.threads)

    if args.backend == "all":
        backends = [b for b in _BACKENDS if b != "numba" or kernels.NUMBA_AVAILABLE]
    else:
        backends = args.backend.split(",")

    t0 = time.perf_counter()
    w = make_workload(args)
    print(
        f"workload: {args.tables} tables, {min(w.rows):,}..{max(w.rows):,} rows "
        f"({sum(w.rows):,} in all), cache {sum(w.slots):,} slots, batch {args.batch}, "
        f"Zipf {args.zipf}, policy {args.policy}, {args.batches} batches after {args.warmup} "
        f"warm-up (made in {time.perf_counter() - t0:.1f}s)",
        flush=True,
    )
    if "numba" in backends:  # compile (or load the cached kernels) before timing
        _run_batches(_new_caches(w, args.policy, "numba"), w.batches[:2], args.lookahead)
    results = []
    for backend in backends:
        r = bench_backend(w, args, backend)
        results.append(r)
        print(
            f"{r['backend']:>8}: {r['ms_per_batch']:8.2f} ms/batch alone, "
            f"{r['contended_ms_per_batch']:8.2f} beside a Python thread (x{r['slowdown']:.2f}); "
            f"that thread kept {100 * r['counter_share']:5.1f}% of its speed; "
            f"GIL held ~{100 * r['gil_share']:5.1f}% of planning "
            f"(hit rate {r['hit_rate']:.3f}, {r['evictions_per_batch']:.0f} evictions/batch)\n"
            f"          alone, ms/batch by stage: "
            + ", ".join(f"{k} {v:.2f}" for k, v in r["ms_per_stage"].items()),
            flush=True,
        )
    if args.out is not None:
        args.out.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results})
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
