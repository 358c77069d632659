"""Random-row read/write rates of every storage tier, against fio on the same file system.

For each tier a table of ``--rows`` x ``--dim`` is created under ``--dir``, filled sequentially
(so reads hit written blocks, not unwritten extents the file system answers with zeros), then
read and written in batches of ``--batch`` random rows for ``--seconds`` each. fio measures the
device's random 4 KiB read IOPS at queue depth 32 (libaio, O_DIRECT) just before and just
after the block tier's read phase (the mean is the reference: cloud disks drift), and the block
tier's efficiency is its random single-row reads/s over that IOPS (target: >= 70%).

A last phase replays a cache's write-back (W1: 260-byte rows with ``--dim 64 --state-width 1``):
batches of ``--batch`` random rows are read, then written back changed, with a flush every
``--flush-every`` batches (a checkpoint; 0: only at the end), drawn uniformly or Zipf(``--zipf``)
distributed. Per batch it reports the block I/Os and bytes the
medium saw (reads, writes, and for ``log_block_scm`` its compaction and checkpoints) and the
rows written back per second: the block tier patches each row's block in place, the log tier
appends the batch.

Example::

    python benchmarks/tier_bench.py --dir /tmp --rows 16777216 --dim 64 --out results.json
    python benchmarks/tier_bench.py --tiers block_scm log_block_scm --rows 4194304 \
        --dim 64 --state-width 1 --no-fio --out writeback.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

import torchrec_mtrains.tiers.log_block_scm  # noqa: F401  (registers the log tier)
from apps.dlrm.data import ZipfRankSampler
from torchrec_mtrains.benchmark.fio import run_fio
from torchrec_mtrains.tiers import TIERS, OpenMode, RowStore, open_store, resolve_options
from torchrec_mtrains.types import RowLayout

TARGET = 0.70
FILL_BYTES = 64 << 20  # rows per write_range call during the sequential fill


def timed(seconds: float, step: Any) -> tuple[int, float]:
    """Calls ``step()`` (returning rows handled) until ``seconds`` of its own time passed."""
    rows, spent = 0, 0.0
    while spent < seconds:
        t0 = time.perf_counter()
        rows += step()
        spent += time.perf_counter() - t0
    return rows, spent


def fill(store: RowStore, rng: np.random.Generator) -> float:
    """Writes every row once, sequentially; returns MB/s."""
    layout = store.layout
    chunk = max(1, FILL_BYTES // layout.row_bytes)
    block = rng.standard_normal((chunk, layout.row_width)).astype(np.float32)
    t0 = time.perf_counter()
    for start in range(0, layout.num_rows, chunk):
        count = min(chunk, layout.num_rows - start)
        store.write_range(start, block[:count])
    store.flush()
    return layout.total_bytes / (time.perf_counter() - t0) / 1e6


BLOCK_TIERS = ("block_scm", "log_block_scm")


def tier_options(tier: str, args: argparse.Namespace) -> dict[str, Any]:
    """The command line's settings for the options ``tier`` takes."""
    wanted = {
        "queue_depth": args.queue_depth,
        "engine": args.engine,
        "max_space_amplification": args.max_space_amplification,
    }
    names = TIERS[tier].options_type.option_names()
    return {k: v for k, v in wanted.items() if k in names}


def writeback(
    store: RowStore, args: argparse.Namespace, rng: np.random.Generator
) -> dict[str, Any]:
    """Batches of random rows (uniform, or Zipf(``--zipf``) through a fixed permutation, as a
    cache's evictions under skewed training) read then written back changed, flushing every
    ``--flush-every`` batches (0: only at the end, as training between checkpoints); the
    medium's I/O per batch, the rows written back per s and the CPU per batch."""
    block = int(getattr(store, "block_size", 0)) or 4096  # memory tiers: 4 KiB pages
    log_stats = getattr(store, "log_stats", None)
    before, log_before = store.stats.as_dict(), log_stats.as_dict() if log_stats else {}
    sampler = ZipfRankSampler(args.rows, args.zipf)
    row_of_rank = rng.permutation(args.rows)
    batches = 0

    def step() -> int:
        nonlocal batches
        ids = np.unique(row_of_rank[sampler.sample(rng, args.batch)])
        store.write_rows(ids, store.read_rows(ids) + 1.0)
        batches += 1
        if args.flush_every and batches % args.flush_every == 0:
            store.flush()
        return int(ids.size)

    cpu0 = time.process_time()
    rows, spent = timed(args.seconds, step)
    t0 = time.perf_counter()
    store.flush()  # the last checkpoint is part of the work
    spent += time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    after = store.stats.as_dict()
    delta = {k: after[k] - before[k] for k in after}
    out: dict[str, Any] = {
        "batches": batches,
        "rows_per_batch": rows / batches,
        "rows_s": rows / spent,
        "cpu_ms_per_batch": cpu / batches * 1e3,
        "block_bytes": block,
        "block_reads_per_batch": delta["bytes_read"] / block / batches,
        "block_writes_per_batch": delta["bytes_written"] / block / batches,
        "io_calls_per_batch": delta["io_calls"] / batches,
        "mb_read_per_batch": delta["bytes_read"] / batches / 1e6,
        "mb_written_per_batch": delta["bytes_written"] / batches / 1e6,
    }
    if log_stats is not None:
        log_delta = {k: v - log_before[k] for k, v in log_stats.as_dict().items()}
        out["log"] = {
            **log_delta,
            "file_data_over_row_bytes": store.file_data_bytes / store.layout.total_bytes,  # type: ignore[attr-defined]
        }
    return out


def bench_tier(
    tier: str, directory: Path, args: argparse.Namespace, fio: dict[str, Any]
) -> dict[str, Any]:
    layout = RowLayout(args.rows, args.dim, args.state_width, args.dtype)
    options = resolve_options(tier, tier_options(tier, args))
    rng = np.random.default_rng(0)
    store = open_store(tier, directory, "bench", layout, mode=OpenMode.TRUNCATE, options=options)
    result: dict[str, Any] = {
        "file_gib": layout.total_bytes / 2**30,
        "options": store.options.as_dict(),  # what the store ran with
    }
    try:
        result["seq_fill_mb_s"] = fill(store, rng)
        if tier == "block_scm" and args.fio:
            fio["before"] = run_fio(directory, args.fio_seconds, args.fio_size)
        before = store.stats.as_dict()

        def read_step() -> int:
            return int(store.read_rows(rng.integers(0, args.rows, args.batch)).shape[0])

        n, spent = timed(args.seconds, read_step)
        after = store.stats.as_dict()
        result["read_rows_s"] = n / spent
        result["read_mb_s"] = n * layout.row_bytes / spent / 1e6
        result["read_medium_mb_s"] = (after["bytes_read"] - before["bytes_read"]) / spent / 1e6
        if tier == "block_scm" and args.fio:
            fio["after"] = run_fio(directory, args.fio_seconds, args.fio_size)
        rows = rng.standard_normal((args.batch, layout.row_width)).astype(np.float32)

        def write_step() -> int:
            ids = np.unique(rng.integers(0, args.rows, args.batch))
            store.write_rows(ids, rows[: ids.size])
            return int(ids.size)

        n, spent = timed(args.seconds, write_step)
        t0 = time.perf_counter()
        store.flush()
        spent += time.perf_counter() - t0
        result["write_rows_s"] = n / spent
        result["write_mb_s"] = n * layout.row_bytes / spent / 1e6
        result["writeback"] = writeback(store, args, rng)
        if tier in BLOCK_TIERS:
            result["direct_io"] = store.direct  # type: ignore[attr-defined]
            result["engine"] = store.engine  # type: ignore[attr-defined]
        result["stats"] = store.stats.as_dict()
    finally:
        store.close()
        store.path.unlink(missing_ok=True)
    return result


def print_writeback(r: dict[str, Any]) -> None:
    w = r["writeback"]
    line = (
        f"  write-back ({w['rows_per_batch']:.0f} rows/batch): {w['rows_s']:10.0f} rows/s | "
        f"per batch {w['block_reads_per_batch']:8.1f} block reads, "
        f"{w['block_writes_per_batch']:8.1f} block writes ({w['block_bytes']} B), "
        f"{w['io_calls_per_batch']:8.1f} I/O calls, {w['mb_read_per_batch']:.2f} MB read, "
        f"{w['mb_written_per_batch']:.2f} MB written, {w['cpu_ms_per_batch']:.2f} ms of CPU"
    )
    if "log" in w:
        log = w["log"]
        line += (
            f"\n  log: compacted {log['compacted_rows'] / w['batches']:.0f} rows/batch, "
            f"{log['checkpoints']} checkpoints, file data {log['file_data_over_row_bytes']:.2f}x "
            f"the row bytes, grew {log['grown_segments']} segments past the bound"
        )
    print(line, flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--rows", type=int, default=1 << 24, help="rows per table (4 GiB at 64)")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--state-width", type=int, default=0, help="1: row-wise Adagrad (W1)")
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32")
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--engine", choices=["auto", "aio", "threads"], default="auto")
    parser.add_argument("--tiers", nargs="+", default=sorted(TIERS), choices=sorted(TIERS))
    parser.add_argument(
        "--flush-every", type=int, default=16, help="write-back batches (0: at the end only)"
    )
    parser.add_argument(
        "--zipf", type=float, default=0.0, help="write-back ids' Zipf exponent (0: uniform)"
    )
    parser.add_argument("--max-space-amplification", type=float, default=2.0, help="log tier")
    parser.add_argument("--fio-seconds", type=int, default=10)
    parser.add_argument("--fio-size", default="2G")
    parser.add_argument("--no-fio", dest="fio", action="store_false")
    parser.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="tier_bench_", dir=args.dir))
    if args.fio and shutil.which("fio") is None:
        print("fio not found: install it with `apt-get install -y fio`; skipping the ratio")
        args.fio = False
    fio: dict[str, Any] = {}
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "tiers": {}}
    try:
        for tier in args.tiers:
            print(f"[{tier}] {args.rows} rows x {args.dim} {args.dtype} ...", flush=True)
            r = bench_tier(tier, work, args, fio)
            results["tiers"][tier] = r
            note = ""
            if tier in BLOCK_TIERS and not r["direct_io"]:
                note = "  (buffered fallback: the page cache may inflate these numbers)"
            elif tier not in BLOCK_TIERS:
                note = "  (served from memory / the page cache)"
            print(
                f"  fill {r['seq_fill_mb_s']:8.0f} MB/s | random read {r['read_rows_s']:10.0f} "
                f"rows/s {r['read_mb_s']:8.1f} MB/s | random write {r['write_rows_s']:10.0f} "
                f"rows/s {r['write_mb_s']:8.1f} MB/s{note}",
                flush=True,
            )
            print_writeback(r)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if fio.get("before") and fio.get("after"):
        iops = (fio["before"]["iops"] + fio["after"]["iops"]) / 2
        block = results["tiers"]["block_scm"]
        ratio = block["read_rows_s"] / iops
        results["fio"] = {**fio, "iops_mean": iops}
        results["block_efficiency"] = ratio
        results["block_efficiency_target"] = TARGET
        print(
            f"fio randread 4k QD32 libaio direct: {fio['before']['iops']:.0f} IOPS before, "
            f"{fio['after']['iops']:.0f} after (mean {iops:.0f})"
        )
        print(
            f"block_scm random single-row reads: {block['read_rows_s']:.0f} rows/s "
            f"(engine {block['engine']}, O_DIRECT {block['direct_io']}, "
            f"QD {args.queue_depth})"
        )
        verdict = "meets" if ratio >= TARGET else "MISSES"
        print(f"block_scm efficiency: {ratio:.1%} of fio IOPS ({verdict} the {TARGET:.0%} target)")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
