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

With ``--depths``, the I/O engines (``--engine``, comma-separated: ``uring``, ``aio``,
``threads``, ``auto``) are compared first, on one file of ``--engine-gib`` GiB of 4 KiB rows
(one block each) opened with O_DIRECT (the page cache hides nothing). At each queue depth of
``--depths`` each engine reads random 4 KiB blocks for ``--seconds`` twice: alone, a pass of
1,024 reads at a time (the store's default pass), which is the I/O path the engines differ in,
and under the flat block store's ``read_rows`` of ``--batch`` random rows, which adds the rows'
own work. It does so ``--repeats`` times, interleaved, so that a noisy neighbour slows every
engine alike. Each figure is the process's CPU time (user and system, all its threads) over the
4 KiB reads made, and the reads per second; the table gives the minimum and median CPU of the
repeats and the median IOPS. Every engine must read the same blocks and rows (checked on a
fixed sample). The tiers' phases run with the first engine listed; ``--tiers`` with no name
skips them.

Example::

    python benchmarks/tier_bench.py --dir /tmp --rows 16777216 --dim 64 --out results.json
    python benchmarks/tier_bench.py --tiers block_scm log_block_scm --rows 4194304 \
        --dim 64 --state-width 1 --no-fio --out writeback.json
    python benchmarks/tier_bench.py --dir /work/tb --tiers --engine aio,uring,threads \
        --depths 32,64,128,256 --engine-gib 8 --seconds 5 --repeats 3 --out engines.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import torchrec_mtrains.tiers.log_block_scm  # noqa: F401  (registers the log tier)
from apps.dlrm.data import ZipfRankSampler
from torchrec_mtrains.benchmark.fio import run_fio
from torchrec_mtrains.benchmark.measure import machine_info
from torchrec_mtrains.tiers import (
    TIERS,
    IOEngineKind,
    OpenMode,
    RowStore,
    open_store,
    resolve_options,
)
from torchrec_mtrains.tiers._blockio import AlignedBuffer, IOEngine, make_engine, open_block_file
from torchrec_mtrains.tiers.options import PASS_BYTES
from torchrec_mtrains.types import RowLayout

TARGET = 0.70
CPU_TARGET_US = 3.0  # CPU per 4 KiB random read of the engine alone, user + system
FILL_BYTES = 64 << 20  # rows per write_range call during the sequential fill
BLOCK = 4096  # the engine comparison's rows: 1,024 fp32, block-aligned after the header block
PASS_READS = PASS_BYTES // BLOCK  # the engine alone reads a store's default pass at a time


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
        "engine": args.engine[0],
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


def _cpu() -> tuple[float, float]:
    ru = resource.getrusage(resource.RUSAGE_SELF)  # every thread: the thread engine's too
    return ru.ru_utime, ru.ru_stime


def _measure(step: Callable[[], int], seconds: float) -> dict[str, float]:
    """Calls ``step()`` (returning the 4 KiB reads it made) for ``seconds``: reads/s and the
    process's CPU microseconds (user, system, both) per read."""
    step()  # warm: the engine's ring and registered buffer, its threads, the pass buffers
    user0, sys0 = _cpu()
    t0 = time.perf_counter()
    reads, elapsed = 0, 0.0
    while elapsed < seconds:
        reads += step()
        elapsed = time.perf_counter() - t0
    user1, sys1 = _cpu()
    return {
        "iops": reads / elapsed,
        "user_us": (user1 - user0) / reads * 1e6,
        "sys_us": (sys1 - sys0) / reads * 1e6,
        "cpu_us": (user1 - user0 + sys1 - sys0) / reads * 1e6,
    }


def _engine_alone(
    path: Path, rows: int, kind: str, depth: int, probe: np.ndarray
) -> tuple[IOEngine, int, Callable[[], int], bytes]:
    """The engine ``kind`` on ``path`` opened as the block store opens it: the probe's blocks
    as it reads them, and a step reading a pass of random 4 KiB blocks (``PASS_READS``)."""
    fd, direct = open_block_file(path, BLOCK, BLOCK, True, "block_scm")
    try:
        engine = make_engine(IOEngineKind(kind), depth, direct)
    except BaseException:
        os.close(fd)
        raise
    buf = AlignedBuffer(PASS_READS * BLOCK)
    slots = np.arange(PASS_READS, dtype=np.int64) * BLOCK
    lengths = np.full(PASS_READS, BLOCK, dtype=np.int64)
    rng = np.random.default_rng(4)
    n = probe.size
    engine.run(fd, False, buf, slots[:n], (1 + probe) * BLOCK, lengths[:n])
    seen = buf.array[: n * BLOCK].tobytes()

    def step() -> int:
        offsets = (1 + rng.integers(0, rows, PASS_READS)) * BLOCK  # past the header block
        engine.run(fd, False, buf, slots, offsets, lengths)
        return PASS_READS

    return engine, fd, step, seen


def bench_engines(directory: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The engines of ``--engine`` compared at each of ``--depths`` on one file of 4 KiB rows
    (see the module docstring): alone, a pass of random block reads at a time, and under the
    block store's ``read_rows``."""
    layout = RowLayout(max(1, int(args.engine_gib * 2**30) // BLOCK), BLOCK // 4)
    out: dict[str, Any] = {"file_gib": layout.total_bytes / 2**30, "depths": args.depths}
    runs: dict[str, dict[str, dict[str, Any]]] = {
        engine: {str(d): {"engine": [], "store": []} for d in args.depths} for engine in args.engine
    }
    flat = {"layout": "flat"}
    mode = OpenMode.TRUNCATE
    with open_store("block_scm", directory, "engines", layout, mode=mode, options=flat) as store:
        out["seq_fill_mb_s"] = fill(store, np.random.default_rng(1))
        out["direct_io"] = store.direct  # type: ignore[attr-defined]
        path = store.path
        assert store.data_offset == BLOCK  # row i is block 1 + i
    probe = np.random.default_rng(2).integers(0, layout.num_rows, 64)
    seen: dict[str, list[Any]] = {"engine": [], "store": []}  # the probe as each engine read it
    rng = np.random.default_rng(3)

    def store_step(store: RowStore) -> Callable[[], int]:
        def step() -> int:
            before = store.stats.bytes_read
            store.read_rows(rng.integers(0, layout.num_rows, args.batch))
            return (store.stats.bytes_read - before) // BLOCK  # repeated ids: read once

        return step

    try:
        for _ in range(args.repeats):
            for depth in args.depths:
                for kind in args.engine:
                    run = runs[kind][str(depth)]
                    if "not_run" in run:
                        continue
                    try:
                        engine, fd, step, blocks = _engine_alone(
                            path, layout.num_rows, kind, depth, probe
                        )
                    except OSError as e:
                        run["not_run"] = f"the kernel refuses the {kind} engine: {e}"
                        continue
                    try:
                        run["engine_used"] = engine.kind.value
                        run["ring"] = getattr(engine, "setup", None)  # io_uring's flags
                        seen["engine"].append(blocks)
                        run["engine"].append(_measure(step, args.seconds))
                    finally:
                        engine.close()
                        os.close(fd)
                    options = {**flat, "engine": kind, "queue_depth": depth}
                    with open_store(
                        "block_scm", directory, "engines", layout, options=options
                    ) as s:
                        seen["store"].append(s.read_rows(probe))
                        run["store"].append(_measure(store_step(s), args.seconds))
    finally:
        path.unlink(missing_ok=True)
    out["same_rows"] = all(all(np.array_equal(a, seen[way][0]) for a in seen[way]) for way in seen)
    for by_depth in runs.values():
        for run in by_depth.values():
            for way in ("engine", "store"):
                if run[way]:
                    run[way] = {"repeats": run[way], **_summary(run[way])}
    out["runs"] = runs
    out["cpu_target_us"] = CPU_TARGET_US
    return out


def _summary(repeats: list[dict[str, float]]) -> dict[str, float]:
    """The repeats' minimum and (lower) median CPU per read, and their median IOPS."""
    by_cpu = sorted(repeats, key=lambda r: r["cpu_us"])
    mid = by_cpu[(len(by_cpu) - 1) // 2]  # a repeat that ran, with its user/system split
    return {
        "cpu_us_min": by_cpu[0]["cpu_us"],
        "cpu_us_median": mid["cpu_us"],
        "user_us_median": mid["user_us"],
        "sys_us_median": mid["sys_us"],
        "iops_median": statistics.median(r["iops"] for r in repeats),
    }


def print_engines(r: dict[str, Any], repeats: int) -> None:
    print(
        f"random 4 KiB reads, {r['file_gib']:.1f} GiB file, O_DIRECT {r['direct_io']}, "
        f"{repeats} repeat(s); CPU = the process's user + system time per 4 KiB read, "
        f"min and median (user / sys) of the repeats; IOPS: median"
    )
    print(
        "| engine | QD | alone: IOPS | CPU µs min | median (user / sys) "
        "| store: IOPS | CPU µs min | median (user / sys) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for depth in r["depths"]:
        for kind, by_depth in r["runs"].items():
            run = by_depth[str(depth)]
            used = run.get("engine_used", kind)
            name = kind if used == kind else f"{kind} ({used})"
            if "not_run" in run:
                print(f"| {name} | {depth} | not run: {run['not_run']} | | | | | |")
                continue
            cells = [
                f"{w['iops_median']:,.0f} | {w['cpu_us_min']:.2f} | {w['cpu_us_median']:.2f} "
                f"({w['user_us_median']:.2f} / {w['sys_us_median']:.2f})"
                for w in (run["engine"], run["store"])
            ]
            print(f"| {name} | {depth} | {cells[0]} | {cells[1]} |")
    if not r["direct_io"]:
        print("(buffered: the file system refuses O_DIRECT; the page cache may serve reads)")
    print(f"every engine read the same blocks and rows: {r['same_rows']}", flush=True)


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
    parser.add_argument(
        "--engine",
        type=_engines,
        default=[IOEngineKind.AUTO.value],
        help="I/O engines, comma-separated (" + ", ".join(k.value for k in IOEngineKind) + "): "
        "all are compared at --depths; the tiers' phases use the first",
    )
    parser.add_argument(
        "--depths",
        type=_ints,
        default=[],
        help="queue depths to compare the engines at, e.g. 32,64,128,256 (none: no comparison)",
    )
    parser.add_argument("--engine-gib", type=float, default=4.0, help="engine comparison file")
    parser.add_argument("--repeats", type=int, default=3, help="engine comparison's repeats")
    parser.add_argument(
        "--tiers",
        nargs="*",
        default=sorted(TIERS),
        choices=sorted(TIERS),
        help="none: engines only",
    )
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
    results: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine_info(),
        "date": time.strftime("%Y-%m-%d"),
        "tiers": {},
    }
    try:
        if args.depths:
            print(f"[engines] {', '.join(args.engine)} at queue depths {args.depths} ...")
            engines = bench_engines(work, args)
            results["engines"] = engines
            print_engines(engines, args.repeats)
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


def _engines(text: str) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    allowed = [k.value for k in IOEngineKind]
    if not names:
        raise argparse.ArgumentTypeError(f"name at least one of {', '.join(allowed)}")
    for name in names:
        if name not in allowed:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(allowed)}")
    return names


def _ints(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None


if __name__ == "__main__":
    main(sys.argv[1:])
