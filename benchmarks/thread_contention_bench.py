"""What a busy second thread costs a training step, by what that thread runs.

The tiered tables' I/O worker plans and moves rows beside the training thread. On a host with
few cores the two share the CPU and, above all, one interpreter: every torch call of the
training thread gives up the GIL and has to take it back. This benchmark trains W3's A' (two
hashed FUSED tables and a small dense part, :mod:`w3_bench`) for ``--steps`` steps at a time:

* ``alone``: nothing beside it;
* ``compiled``: beside a thread spinning in a numba loop that holds no GIL (a busy core);
* ``rows``: beside a thread moving rows as the tier worker moves them on W3 (the stores'
  compiled copies, no GIL: 6,400 random rows of 65 float32 out of a cache of 52,429 slots into
  a table of 262,144 rows and back, over and over): a busy core that also loads the memory;
* ``numpy``: beside a thread calling numpy's unique, argsort and a gather on 8,192 ids in a loop
  (the kind of calls the worker makes: numpy gives up the GIL inside them);
* ``python``: beside a thread running a plain Python loop (the interpreter holds the GIL; the
  training thread gets it back only when the interpreter's switch interval, 5 ms by default or
  ``--switch-interval``, forces a handover).

The four take turns ``--rounds`` times (the order turning each round) on the same model, so
all meet the same moments of a shared machine; the report gives each one's median ms a step and
its ratio to ``alone``. Before timing, a fresh model trained ``--check-steps`` steps beside each
load must give the losses a fresh model gives alone (the builds are identical: a load changes
when a step runs, never what it computes).

Run it::

    python benchmarks/thread_contention_bench.py --out results/thread_contention.json
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrec_mtrains.benchmark.measure import write_json
from torchrec_mtrains.cache.kernels import NUMBA_AVAILABLE
from torchrec_mtrains.distributed.runtime import process_group
from torchrec_mtrains.tiers.base import copy_columns_to_rows, copy_rows_to_columns

LOADS = ("alone", "compiled", "rows", "numpy", "python")


def _load_w3() -> Any:
    """``benchmarks/w3_bench.py`` (a script beside this one, not a package module)."""
    spec = importlib.util.spec_from_file_location(
        "w3_bench", Path(__file__).with_name("w3_bench.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


w3_bench = _load_w3()


def _spin_python(stop: threading.Event) -> None:
    while not stop.is_set():
        total = 0
        for i in range(100_000):
            total += i


def _spin_numpy(stop: threading.Event) -> None:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 2**40, 8192)
    positions = rng.integers(0, 8192, 4096)
    while not stop.is_set():
        np.unique(ids, return_inverse=True)
        np.argsort(ids)
        ids.take(positions)


def _compiled_spin() -> Callable[[threading.Event], None] | None:
    if not NUMBA_AVAILABLE:  # (the GPU host's stack has no numba)
        return None
    import numba

    @numba.njit(nogil=True, cache=False)
    def spin(values: np.ndarray[Any, Any]) -> float:
        total = 0.0
        for _ in range(200):
            for i in range(values.size):
                total += values[i] * 1.0000001
        return total

    values = np.random.default_rng(0).random(100_000)
    spin(values[:10])  # compiled here, not in a timed window

    def run(stop: threading.Event) -> None:
        while not stop.is_set():
            spin(values)

    return run


def _compiled_rows() -> Callable[[threading.Event], None] | None:
    if not NUMBA_AVAILABLE:
        return None
    rng = np.random.default_rng(0)
    slots = [rng.random((52_429, 64), np.float32), rng.random((52_429, 1), np.float32)]
    table = rng.random((262_144, 65), np.float32)
    moves = [(rng.permutation(52_429)[:6_400], rng.permutation(262_144)[:6_400]) for _ in range(8)]
    copy_columns_to_rows(slots, moves[0][0], table, moves[0][1])  # compiled here
    copy_rows_to_columns(table, moves[0][1], slots, moves[0][0])

    def run(stop: threading.Event) -> None:
        while not stop.is_set():
            for at, ids in moves:
                copy_columns_to_rows(slots, at, table, ids)
                copy_rows_to_columns(table, ids[::-1].copy(), slots, at)

    return run


class Beside:
    """Runs ``load`` in a daemon thread for the ``with`` block (nothing for ``None``)."""

    def __init__(self, load: Callable[[threading.Event], None] | None) -> None:
        self.load = load
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None

    def __enter__(self) -> Beside:
        if self.load is not None:
            self.thread = threading.Thread(target=self.load, args=(self.stop,), daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()


def _train(w3_args: argparse.Namespace, batches: Sequence[Any], model: Any = None) -> Any:
    """Trains W3's A' (a fresh one unless ``model``, a (model, optimizer) pair) on ``batches``;
    returns the pair and the losses."""
    if model is None:
        built = w3_bench.build(w3_args, "A'", Path("."))  # (no tier: nothing written)
        model = (built, w3_bench.dense_optimizer(built))
    losses = [float(w3_bench.step(*model, raw, w3_args.hash_rows)) for raw in batches]
    return model, losses


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=100, help="timed steps per load and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--hash-rows", type=int, default=2**17)
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval, seconds"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    w3_args = w3_bench._parser().parse_args(
        ["--batch-size", str(args.batch_size), "--hash-rows", str(args.hash_rows)]
    )
    loads: dict[str, Callable[[threading.Event], None] | None] = {
        "alone": None,
        "compiled": _compiled_spin(),
        "rows": _compiled_rows(),
        "numpy": _spin_numpy,
        "python": _spin_python,
    }
    names = [n for n in LOADS if n == "alone" or loads[n] is not None]
    per_step: dict[str, list[float]] = {n: [] for n in names}
    with process_group(torch.device("cpu"), backend="gloo"):
        stream = w3_bench.Stream(w3_args, seed=1)
        check = [stream.batch() for _ in range(args.check_steps)]
        _, want = _train(w3_args, check)
        for name in names[1:]:
            with Beside(loads[name]):
                _, got = _train(w3_args, check)
            if got != want:
                raise SystemExit(f"check failed beside {name}: losses {got} != alone {want}")
        model, _ = _train(w3_args, [stream.batch() for _ in range(args.warmup)])
        batches = [stream.batch() for _ in range(args.steps)]
        for r in range(args.rounds):
            turn = names[r % len(names) :] + names[: r % len(names)]
            for name in turn:
                with Beside(loads[name]):
                    started = time.perf_counter()
                    _train(w3_args, batches, model)
                    per_step[name].append((time.perf_counter() - started) / args.steps)
    alone = statistics.median(per_step["alone"])
    result: dict[str, Any] = {
        "args": vars(args),
        "switch_interval_s": sys.getswitchinterval(),
        "ms_per_step": {n: [1e3 * s for s in v] for n, v in per_step.items()},
        "median_ms_per_step": {n: 1e3 * statistics.median(v) for n, v in per_step.items()},
        "vs_alone": {n: statistics.median(v) / alone for n, v in per_step.items()},
        "missing": [n for n in LOADS if n not in names],
    }
    print(
        f"check: {args.check_steps} steps beside each load from the same weights: losses equal "
        "to the steps alone"
    )
    print(
        f"W3's A' (batch {args.batch_size}), {args.steps} steps x {args.rounds} rounds per load, "
        f"switch interval {1e3 * result['switch_interval_s']:g} ms"
    )
    print(f"{'beside':10} {'ms a step':>10} {'/ alone':>8}")
    for name in names:
        print(
            f"{name:10} {result['median_ms_per_step'][name]:10.2f} {result['vs_alone'][name]:8.2f}"
        )
    for name in result["missing"]:
        print(f"{name:10} not run (numba is not installed)")
    if args.out:
        write_json(args.out, result)
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
