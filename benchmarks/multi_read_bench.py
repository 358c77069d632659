"""A tier worker's reads of several tables' misses: one pass per table against shared passes.

The tier worker of a kernel reads every tiered table's misses of a batch. Table by table
(``alone``: ``store.read_rows`` per table, as the worker did), each table's reads are a pass of
their own whose queue drains to its last I/O before the next table starts; ``together``
(``read_rows_together``, what the worker does now) issues every table's reads in shared passes
across their files. ``--tables`` block-tier tables of ``--rows`` rows (W1's rows: dim 64 with
row-wise Adagrad state) are made under ``--dir`` with the ``local`` preset's block-tier options
(``store_options``: its queue depth, pass and block sizes), every row written, then each batch
reads ``--misses`` random distinct rows of every table, in both ways, alternately first.

Per way: ms per batch (wall), CPU ms per batch (this process, all threads), system calls per
batch, and the ratio together / alone; the rows both ways return for the same ids are compared
first (bit for bit).

Example::

    python benchmarks/multi_read_bench.py --out results/multi_read.json     # ~2 min here
    python benchmarks/multi_read_bench.py --smoke --out /tmp/multi_read.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from torchrec_mtrains.benchmark.measure import machine_info, write_json
from torchrec_mtrains.planner import load_topology
from torchrec_mtrains.planner.presets import store_options
from torchrec_mtrains.tiers import OpenMode, RowStore, open_store, read_rows_together
from torchrec_mtrains.tiers._blockio import BufferPool
from torchrec_mtrains.types import RowLayout

WAYS = ("alone", "together")
FILL_ROWS = 1 << 16


def open_tables(work: Path, args: argparse.Namespace) -> list[RowStore]:
    """``--tables`` block-tier stores with the preset's options, every row written, sharing
    one buffer pool as a tier worker's stores do."""
    host = load_topology("local", [f"hardware.block_scm.layout={args.layout}"])
    options = store_options(host)["block_scm"]
    pool = BufferPool()
    rng = np.random.default_rng(0)
    stores = []
    for t in range(args.tables):
        layout = RowLayout(num_rows=args.rows, dim=args.dim, state_width=1)
        store = open_store(
            "block_scm", work, f"t{t}", layout, mode=OpenMode.TRUNCATE, options=options
        )
        store.use_buffers(pool)  # type: ignore[attr-defined]
        for start in range(0, args.rows, FILL_ROWS):
            ids = np.arange(start, min(start + FILL_ROWS, args.rows))
            rows = rng.standard_normal((ids.size, layout.row_width)).astype(np.float32)
            store.write_rows(ids, rows)
        store.flush()
        stores.append(store)
    return stores


def draw(stores: list[RowStore], misses: int, rng: np.random.Generator) -> list[Any]:
    """One batch's misses: ``misses`` distinct random rows of every table."""
    return [(s, rng.choice(s.layout.num_rows, misses, replace=False)) for s in stores]


def read(way: str, requests: list[Any]) -> list[np.ndarray[Any, Any]]:
    if way == "alone":
        return [store.read_rows(ids) for store, ids in requests]
    return read_rows_together(requests)


def io_calls(stores: list[RowStore]) -> int:
    return sum(s.stats.io_calls for s in stores)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--tables", type=int, default=5, help="W1 tiers its 5 largest tables")
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--misses", type=int, default=800, help="rows per table and batch")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--layout", choices=["log", "flat"], default="log")
    parser.add_argument("--smoke", action="store_true", help="tiny tables, a few batches")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.smoke:
        args.rows, args.misses, args.batches = 5000, 100, 6
    work = Path(tempfile.mkdtemp(prefix="multi_read_bench_", dir=args.dir))
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    stores: list[RowStore] = []
    try:
        t0 = time.perf_counter()
        stores = open_tables(work, args)
        result["fill_s"] = time.perf_counter() - t0
        result["store_options"] = str(stores[0].options)
        rng = np.random.default_rng(1)
        # The same ids both ways: the same rows, bit for bit.
        for _ in range(3):
            requests = draw(stores, args.misses, rng)
            alone, together = read("alone", requests), read("together", requests)
            if not all(np.array_equal(a, b) for a, b in zip(alone, together)):
                raise SystemExit("read_rows_together returned other rows than read_rows")
        result["same_rows"] = True
        spent: dict[str, dict[str, list[float]]] = {w: {"wall": [], "cpu": []} for w in WAYS}
        calls = dict.fromkeys(WAYS, 0)
        for b in range(args.batches):
            for way in WAYS if b % 2 == 0 else WAYS[::-1]:
                requests = draw(stores, args.misses, rng)
                before_calls = io_calls(stores)
                w0, c0 = time.perf_counter(), time.process_time()
                read(way, requests)
                spent[way]["wall"].append(time.perf_counter() - w0)
                spent[way]["cpu"].append(time.process_time() - c0)
                calls[way] += io_calls(stores) - before_calls
        for way in WAYS:
            result[way] = {
                "ms_per_batch": statistics.median(spent[way]["wall"]) * 1e3,
                "cpu_ms_per_batch": statistics.mean(spent[way]["cpu"]) * 1e3,
                "io_calls_per_batch": calls[way] / args.batches,
            }
        a, t = result["alone"], result["together"]
        result["together_over_alone"] = {k: t[k] / a[k] if a[k] else None for k in a}
    finally:
        for s in stores:
            s.close()
        shutil.rmtree(work, ignore_errors=True)
    result["machine"] = machine_info()
    print(
        f"{args.tables} tables x {args.rows:,} rows ({args.layout} layout, {result['store_options']})"
        f", {args.misses} misses per table and batch, {args.batches} batches"
    )
    print(f"{'':10}{'ms/batch':>10}{'CPU ms/batch':>14}{'I/O calls/batch':>17}")
    for way in WAYS:
        r = result[way]
        print(
            f"{way:10}{r['ms_per_batch']:10.2f}{r['cpu_ms_per_batch']:14.2f}"
            f"{r['io_calls_per_batch']:17.1f}"
        )
    ratio = result["together_over_alone"]
    print(
        f"together / alone: {ratio['ms_per_batch']:.2f}x time, {ratio['cpu_ms_per_batch']:.2f}x "
        f"CPU, {ratio['io_calls_per_batch']:.2f}x calls (same rows: {result['same_rows']})"
    )
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
