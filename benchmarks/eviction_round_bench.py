"""What one eviction round of a virtual table costs the tier worker, part by part.

A round of TorchRec's score rule (``FeatureScoreBasedEvictionPolicy``) runs on the tier worker
while batches wait for it: it decays every live row's score, picks the rows to evict (the
lowest scores, ties to the least lately used, then to the lowest id) and frees their ids in the
id map. On W3 (262,144 live rows a table, a quarter evicted a round) the worker runs one round
per table every ~40 steps, and the look-ahead must absorb it. This benchmark builds one table's
statistics and id map at ``--live-rows`` and times, ``--repeats`` times each in turns:

* ``candidates``: :func:`eviction_candidates`, which live rows may go (not the batch's, not
  those of the batches just before it, not those the cache holds for batches in flight), one
  compiled pass; ``candidates_numpy``: the same by numpy's steps (the path without numba);
* ``select``: :meth:`ShardEviction.select`, the round's choice (scores decayed, compiled radix
  selections); ``select_numpy``: the same with numpy's partitions (the path without numba);
* ``sort``: the same choice by a full lexicographic sort (``np.lexsort``), the baseline;
* ``remove``: :meth:`VirtualRowMap.remove` of the chosen ids (a fresh copy of the map each time).

Scores and last uses are drawn with many ties, as a round meets them (most ids are used once or
twice); the cache holds a fifth of the rows, three batches' worth of them held. Before timing,
``select`` must choose exactly the rows the sort chooses, and each numpy path must give what its
compiled path gives.

Run it::

    python benchmarks/eviction_round_bench.py --out results/eviction_round/after_1.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from torchrec.modules.embedding_configs import FeatureScoreBasedEvictionPolicy

from torchrec_mtrains.benchmark.measure import write_json
from torchrec_mtrains.cache.id_map import VirtualRowMap
from torchrec_mtrains.cache.table_cache import TableCache
from torchrec_mtrains.distributed import virtual_eviction, virtual_rows
from torchrec_mtrains.distributed.virtual_eviction import EvictionRule, ShardEviction
from torchrec_mtrains.distributed.virtual_rows import eviction_candidates

I64 = np.ndarray[Any, np.dtype[np.int64]]


def build(args: argparse.Namespace) -> tuple[ShardEviction, VirtualRowMap, I64, I64]:
    """One table's statistics and id map, full to ``--live-rows`` with random 40-bit ids."""
    rng = np.random.default_rng(args.seed)
    live = args.live_rows
    policy = FeatureScoreBasedEvictionPolicy(
        training_id_eviction_trigger_count=0,
        training_id_keep_count=int(live * args.keep_share),
        decay_rate=args.decay_rate,
        enable_auto_feature_score_collection=True,
        feature_score_mapping={"f": 1.0},
    )
    shard = ShardEviction(EvictionRule.from_policy("t", policy, ["f"]), capacity=live)
    # Mostly ids used once or twice, some many times; decayed over a few rounds.
    uses = np.minimum(rng.zipf(2.0, live), 50)
    shard.count[:] = uses * args.decay_rate ** rng.integers(0, 4, live)
    shard.last_batch[:] = rng.integers(1, 60, live)
    shard.batches = 60
    id_map = VirtualRowMap("t", live)
    ids = np.unique(rng.integers(0, 2**40, 2 * live))[:live]
    given = rng.permutation(ids)
    rows, _ = id_map.assign(given)
    order = np.argsort(rows)  # live rows in row order, as the id map gives them a round
    return shard, id_map, rows[order], given[order]


def by_sort(shard: ShardEviction, rows: I64, ids: I64, room: int) -> I64:
    """The round's choice by a full sort: the baseline ``select`` must match."""
    rule = shard.rule
    count = shard.count[rows] * rule.decay_rate
    n = max(len(rows) - rule.keep_count, room)
    order = np.lexsort((ids, shard.last_batch[rows], count))
    return np.sort(rows[order[:n]])


def in_flight_cache(args: argparse.Namespace, rows: I64) -> tuple[TableCache, I64]:
    """A cache of a fifth of the rows, full, three batches' rows held in it (the look-ahead's),
    and the rows of the batch being planned."""
    rng = np.random.default_rng(args.seed + 1)
    cache = TableCache("t", len(rows), max(1, len(rows) // 5))
    plan = cache.plan(torch.from_numpy(rng.permutation(rows)[: cache.num_slots]))
    batch = max(1, cache.num_slots // 8)
    cache.hold(plan.slots[: 3 * batch])
    return cache, rng.permutation(rows)[:batch]


@contextlib.contextmanager
def numpy_paths() -> Iterator[None]:
    """The round's paths without numba (numpy's), as a process without numba runs them."""
    with (
        mock.patch.object(virtual_eviction, "NUMBA_AVAILABLE", False),
        mock.patch.object(virtual_rows, "NUMBA_AVAILABLE", False),
    ):
        yield


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def run(args: argparse.Namespace) -> dict[str, Any]:
    shard, id_map, rows, ids = build(args)
    may_go = np.ones(len(rows), dtype=np.bool_)
    room = 0

    cache, batch_rows = in_flight_cache(args, rows)

    def timed(
        name: str,
        fn: Callable[[Any], Any],
        fresh: Callable[[], Any] = lambda: None,
        numpy: bool = False,
    ) -> Callable[[], Any]:
        """``fn(fresh())`` timed as ``name``, ``fresh()`` (a copy of what ``fn`` changes) not;
        with ``numpy=True``, on numpy's paths."""

        def part() -> Any:
            given = fresh()
            with numpy_paths() if numpy else contextlib.nullcontext():
                started = time.perf_counter()
                out = fn(given)
                times[name].append(time.perf_counter() - started)
            return out

        return part

    def choose(fresh: ShardEviction) -> I64:  # (a round decays the scores: a copy each time)
        return fresh.select(rows, may_go, lambda r: np.zeros(len(r)), room, ids)

    def candidates(_: None) -> tuple[I64, I64, Any]:
        return eviction_candidates(id_map, shard, batch_rows, cache)

    def shard_copy() -> ShardEviction:
        return copy.deepcopy(shard)

    names = ("candidates", "candidates_numpy", "select", "select_numpy", "sort", "remove")
    times: dict[str, list[float]] = {name: [] for name in names}
    chosen = timed("select", choose, shard_copy)()
    if not np.array_equal(np.sort(chosen), by_sort(shard, rows, ids, room)):
        raise SystemExit("select chose other rows than the full sort: not timed")
    print(f"check: select chose the {len(chosen):,} rows the full sort chose")
    if not np.array_equal(timed("select_numpy", choose, shard_copy, numpy=True)(), chosen):
        raise SystemExit("select's numpy path chose other rows than its compiled one: not timed")
    compiled = timed("candidates", candidates)()
    numpy_ = timed("candidates", candidates, numpy=True)()
    if not all(np.array_equal(a, b) for a, b in zip(compiled, numpy_)):
        raise SystemExit("the candidates' numpy path differs from the compiled one: not timed")
    print(
        f"check: numpy's paths give the compiled ones' results ({int(compiled[2].sum()):,} of "
        f"{len(compiled[2]):,} live rows may go)"
    )
    gone_ids = id_map.row_ids[chosen].copy()

    def remove(fresh: VirtualRowMap) -> None:
        fresh.remove(gone_ids)

    def map_copy() -> VirtualRowMap:
        return copy.deepcopy(id_map)

    timed("remove", remove, map_copy)()  # compiles (or loads) the map's kernel
    for t in times.values():
        t.clear()
    parts: list[Callable[[], Any]] = [
        timed("candidates", candidates),
        timed("candidates_numpy", candidates, numpy=True),
        timed("select", choose, shard_copy),
        timed("select_numpy", choose, shard_copy, numpy=True),
        timed("sort", lambda _: by_sort(shard, rows, ids, room)),
        timed("remove", remove, map_copy),
    ]
    for i in range(args.repeats):
        k = i % len(parts)
        for part in parts[k:] + parts[:k]:
            part()
    medians = {name: _median_ms(t) for name, t in times.items()}
    result = {
        "args": vars(args),
        "rows_evicted": len(chosen),
        "median_ms": medians,
        "ms": {name: [x * 1e3 for x in t] for name, t in times.items()},
        "select_vs_sort": medians["select"] / medians["sort"],
        "select_vs_numpy": medians["select"] / medians["select_numpy"],
        "candidates_vs_numpy": medians["candidates"] / medians["candidates_numpy"],
    }
    print(f"{'part':16} {'median ms':>10}  ({args.repeats} each, in turns)")
    for name, ms in medians.items():
        print(f"{name:16} {ms:10.2f}")
    print(
        f"a round ({len(rows):,} live rows, {len(chosen):,} evicted): candidates + select + "
        f"remove {medians['candidates'] + medians['select'] + medians['remove']:.2f} ms "
        f"(numpy's paths: {medians['candidates_numpy'] + medians['select_numpy'] + medians['remove']:.2f}"
        f" ms); select / sort {result['select_vs_sort']:.2f}, select / numpy's "
        f"{result['select_vs_numpy']:.2f}, candidates / numpy's {result['candidates_vs_numpy']:.2f}"
    )
    return result


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--live-rows", type=int, default=262_144)
    parser.add_argument("--keep-share", type=float, default=0.75)
    parser.add_argument("--decay-rate", type=float, default=0.9)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    result = run(args)
    if args.out is not None:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
