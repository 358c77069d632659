"""Step time and tier stall of the DLRM app's model with and without look-ahead prefetch.

The app's model and data (``conf/``, synthetic Zipf-skewed ids) with ``--big-tables`` tables of
``--rows`` rows on the block tier (O_DIRECT, so the page cache cannot hide it) behind caches of
``--cache-load-factor`` of their rows, plus small DRAM tables. The same model (same initial
weights, same batches) trains ``--steps`` timed steps after ``--warmup`` untimed ones, first
with the plain loop (lookahead 0: every batch waits for its rows), then with the look-ahead
pipeline (lookahead ``--lookahead``). Each run gets a fresh model and tier files, so both start
from a cold cache.

For each run it prints the mean step time, the time the training thread stalled on tier I/O,
the stall share of step time (the project's target with look-ahead: <= 10%), the tier I/O time,
rows fetched and rows written back per step, and the cache hit rate; then the ratios of plain
to look-ahead. Look-ahead can hide tier I/O up to the step's compute time: when a step's I/O
takes longer than its compute, the I/O sets the pace and stall remains.

Example::

    python benchmarks/lookahead_bench.py --rows 4000000 --lookahead 2 --out lookahead.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from torchrec.datasets.utils import Batch

from apps.dlrm.config import CONF_DIR, AppConfig, to_app_config
from apps.dlrm.data import build_dataloader
from apps.dlrm.model import build_model
from torchrec_mtrains.distributed.runtime import init_process_group, resolve_device
from torchrec_mtrains.pipeline import (
    LookaheadTrainPipeline,
    StepStats,
    snapshot,
    tiered_groups,
)

SMALL_ROWS = 1000


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rows", type=int, default=4_000_000, help="rows of each big table")
    p.add_argument("--big-tables", type=int, default=2, help="tables on the block tier")
    p.add_argument("--small-tables", type=int, default=6, help="tables in DRAM (FUSED)")
    p.add_argument("--dim", type=int, default=32, help="embedding dimension")
    p.add_argument("--batch-size", type=int, default=2048)
    p.add_argument("--pooling", type=int, default=1, help="ids per sample and table")
    p.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    p.add_argument("--cache-load-factor", type=float, default=0.03, help="cache rows / table rows")
    p.add_argument("--steps", type=int, default=100, help="timed steps per run")
    p.add_argument(
        "--warmup",
        type=int,
        default=150,
        help="untimed steps first (enough to fill the caches: a cold cache only misses)",
    )
    p.add_argument("--lookahead", type=int, default=2, help="k of the look-ahead run")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="auto", help="auto (CUDA when visible), cpu or cuda")
    p.add_argument(
        "--dir",
        type=Path,
        default=Path("."),
        help="where tier files go (a real disk: O_DIRECT fails on tmpfs); removed after",
    )
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.lookahead < 1:
        p.error(f"--lookahead={args.lookahead}: the look-ahead run needs k >= 1")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def make_config(args: argparse.Namespace, run_dir: Path) -> AppConfig:
    """The app's config for this run, composed from ``conf/`` and typed, as the app's ``main``
    makes it."""
    sizes = [args.rows] * args.big_tables + [SMALL_ROWS] * args.small_tables
    # Small tables (SMALL_ROWS x dim, with row-wise optimizer state) fit the DRAM budget; the
    # big ones are far above the block tier's threshold.
    small_bytes = SMALL_ROWS * (args.dim + 1) * 4
    overrides = [
        f"run.dir={run_dir}",
        f"model.num_embeddings_per_feature=[{','.join(map(str, sizes))}]",
        f"model.embedding_dim={args.dim}",
        f"model.dense_arch_layer_sizes=[64,{args.dim}]",
        f"data.num_sparse_features={len(sizes)}",
        f"data.batch_size={args.batch_size}",
        f"data.zipf_exponents=[{args.zipf}]",
        f"data.pooling_factors=[{args.pooling}]",
        f"data.num_batches={args.warmup + args.steps + 1}",
        # The size rule places exactly: big tables on block SCM, small ones in DRAM.
        "planner=size_rule",
        f"planner.dram_budget={small_bytes * args.small_tables + 1}",
        f"planner.block_scm_min_bytes={small_bytes + 1}",
        f"planner.cache_load_factor={args.cache_load_factor}",
    ]
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return to_app_config(compose(config_name="config", overrides=overrides))


def batches(app: AppConfig) -> Iterator[Batch]:
    return iter(build_dataloader(app.data, 0, 1))


def run(
    args: argparse.Namespace, root: Path, lookahead: int, device: torch.device
) -> dict[str, Any]:
    """Trains a fresh model with ``lookahead`` (0 = plain loop); per-step means."""
    app = make_config(args, root / f"lookahead{lookahead}")
    Path(app.run.dir).mkdir(parents=True)
    torch.manual_seed(app.run.seed)
    t0 = time.perf_counter()
    model, optimizer, plan = build_model(app, 1, False, device)
    build_s = time.perf_counter() - t0
    groups = tiered_groups(model)
    data = batches(app)
    model.train()
    steps: list[StepStats] = []
    losses: list[float] = []
    total = args.warmup + args.steps
    if lookahead == 0:
        for _ in range(total):
            before, t = snapshot(groups), time.perf_counter()
            batch = next(data).to(device)
            optimizer.zero_grad()
            loss, _ = model(batch)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            steps.append(StepStats.between(before, snapshot(groups), time.perf_counter() - t))
    else:
        piped: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
            model, optimizer, device, lookahead=lookahead
        )
        with piped as pipeline:
            it = itertools.islice(data, total)
            for _ in range(total):
                loss_t, _, _ = pipeline.progress(it)
                losses.append(float(loss_t))
                assert pipeline.last_step is not None
                steps.append(pipeline.last_step)
    timed = sum(steps[args.warmup :], StepStats())
    n = timed.steps
    return {
        "lookahead": lookahead,
        "build_s": build_s,
        "steps": n,
        "step_ms": 1000 * timed.seconds / n,
        "stall_ms": 1000 * timed.stall_seconds / n,
        "stall_share": timed.stall_share,
        "prefetch_io_ms": 1000 * timed.prefetch_io_seconds / n,
        "rows_fetched_per_step": timed.rows_fetched / n,
        "rows_written_back_per_step": timed.rows_written_back / n,
        "hit_rate": timed.hit_rate,
        "samples_per_s": args.batch_size * n / timed.seconds,
        "final_loss": losses[-1],
        "plan": plan,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)
    group = init_process_group(resolve_device(args.device))
    root = Path(tempfile.mkdtemp(prefix="lookahead-bench-", dir=args.dir))
    try:
        runs = [run(args, root, k, group.device) for k in (0, args.lookahead)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if group.created:
            dist.destroy_process_group()
    plain, ahead = runs
    result = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": runs,
        "speedup": plain["step_ms"] / ahead["step_ms"],
        "stall_reduction": plain["stall_ms"] / ahead["stall_ms"]
        if ahead["stall_ms"] > 0
        else float("inf"),
        "same_final_loss": plain["final_loss"] == ahead["final_loss"],
    }
    print(runs[0]["plan"])
    print(
        f"{'lookahead':>9} {'step ms':>9} {'stall ms':>9} {'stall %':>8} {'I/O ms':>8} "
        f"{'fetched':>8} {'written':>8} {'hit rate':>9} {'samples/s':>10}"
    )
    for r in runs:
        print(
            f"{r['lookahead']:>9} {r['step_ms']:>9.1f} {r['stall_ms']:>9.1f} "
            f"{100 * r['stall_share']:>7.1f}% {r['prefetch_io_ms']:>8.1f} "
            f"{r['rows_fetched_per_step']:>8.0f} {r['rows_written_back_per_step']:>8.0f} "
            f"{r['hit_rate']:>9.3f} {r['samples_per_s']:>10,.0f}"
        )
    print(
        f"step time plain / look-ahead: {result['speedup']:.2f}x; stall plain / look-ahead: "
        f"{result['stall_reduction']:.1f}x; same final loss: {result['same_final_loss']}"
    )
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
