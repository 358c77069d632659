"""Checks the planner's perf model against measured training steps on this machine.

Two subcommands:

``calibrate``
    measures the primitive costs the local hardware preset (``torchrec_mtrains/conf/hardware/local.yaml``)
    holds, each in isolation: TorchRec's fused CPU kernel through ``DistributedModelParallel``
    (tables on FUSED only), the row cache's bookkeeping (the tiered kernel on the ``dram`` tier,
    timing its remapping step), and the two storage tiers' stores reading and writing random
    rows. It prints the YAML to paste into the preset.

``check`` (the default)
    builds small models through ``DistributedModelParallel`` with the tiered sharder, their big
    tables on ``byte_scm`` or ``block_scm`` with caches of different sizes (and one model as the
    planner places it), profiles the same synthetic batches the model trains on, trains until
    every cache is full, times forward + backward steps and compares the median step with the
    perf model's prediction from the profile and the preset. It prints predicted vs measured
    and the error per configuration.

Every measurement uses one intra-op thread (the preset's figures are per rank, one rank per
core) and the median step; ``--repeats`` keeps the fastest of several medians, because other
processes on a shared machine only ever make a step slower.

Example::

    python benchmarks/perf_model_check.py calibrate
    python benchmarks/perf_model_check.py check --out runs/perf_check.json
    python benchmarks/perf_model_check.py check --quick        # seconds; what the tests run
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.data import SyntheticCriteoDataset, SyntheticDataConfig
from torchrec_mtrains.benchmark.fio import fio_job
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import process_group
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.pipeline import tier_stats
from torchrec_mtrains.planner import (
    HostTopology,
    Placement,
    StepTime,
    from_profile,
    load_topology,
    parse_size,
    plan_tables,
    shard_step_time,
)
from torchrec_mtrains.planner.shard_estimators import table_work
from torchrec_mtrains.profiler import AccessProfile, TableInfo, profile_batches
from torchrec_mtrains.tiers import OpenMode, open_store
from torchrec_mtrains.types import RowLayout, Tier

logger = logging.getLogger("perf_model_check")

LR = 0.05
FUSED = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR}
STATE_WIDTH = 1  # row-wise Adagrad


# ------------------------------------------------------------------------------- plumbing


Placements = dict[str, tuple[str, float]]
"""table -> (tier or "fused", cache load factor)."""


@dataclass(frozen=True)
class TableSpec:
    """One table of a benchmark model and the synthetic traffic it gets."""

    rows: int
    dim: int
    zipf: float
    pooling: int = 1


def table_configs(specs: Sequence[TableSpec]) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_cat_{i}",
            embedding_dim=s.dim,
            num_embeddings=s.rows,
            feature_names=[f"cat_{i}"],
        )
        for i, s in enumerate(specs)
    ]


def dataset(specs: Sequence[TableSpec], batch_size: int, batches: int, seed: int = 0) -> Any:
    return SyntheticCriteoDataset(
        SyntheticDataConfig(
            batch_size=batch_size,
            num_batches=batches,
            seed=seed,
            num_dense_features=1,
            num_sparse_features=len(specs),
            num_embeddings_per_feature=[s.rows for s in specs],
            zipf_exponents=[s.zipf for s in specs],
            pooling_factors=[s.pooling for s in specs],
        )
    )


def kjts(specs: Sequence[TableSpec], batch_size: int, batches: int) -> list[KeyedJaggedTensor]:
    ds = dataset(specs, batch_size, batches)
    return [ds.batch_at(i).sparse_features for i in range(batches)]


def build(
    specs: Sequence[TableSpec],
    root: Path,
    placements: dict[str, tuple[str, float]] | None = None,
    plan: EmbeddingModuleShardingPlan | None = None,
) -> tuple[DistributedModelParallel, TieredEmbeddingBagCollectionSharder]:
    """A DMP-sharded EmbeddingBagCollection; ``placements`` maps table -> (tier or "fused",
    cache load factor), or ``plan`` gives a ready plan."""
    storage = TierStorage(root=str(root), open_mode=OpenMode.TRUNCATE)
    sharder = TieredEmbeddingBagCollectionSharder(
        storage, offer_tiered_kernel=True, fused_params=dict(FUSED)
    )
    ebc = EmbeddingBagCollection(tables=table_configs(specs), device=torch.device("meta"))
    if plan is None:
        placements = placements or {}
        generators = {}
        for config in ebc.embedding_bag_configs():
            tier, _ = placements.get(config.name, ("fused", 1.0))
            kernel = "fused" if tier == "fused" else TIERED_KERNEL
            generators[config.name] = table_wise(rank=0, compute_kernel=kernel)
        plan = construct_module_sharding_plan(
            ebc, generators, sharder=sharder, local_size=1, world_size=1, device_type="cpu"
        )
        for name, (tier, factor) in placements.items():
            if tier != "fused":
                plan[name] = TieredParameterSharding.wrap(
                    plan[name], TieredTableOptions(tier=Tier(tier), cache_load_factor=factor)
                )
    model = DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )
    return model, sharder


def train_step(model: DistributedModelParallel, kjt: KeyedJaggedTensor) -> None:
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    out.values().sum().backward()


def run_steps(
    model: DistributedModelParallel,
    batches: Sequence[KeyedJaggedTensor],
    warmup: int,
    until_full: Callable[[], bool] | None = None,
) -> list[float]:
    """Trains on ``batches``: ``warmup`` steps (more while ``until_full`` says the caches are
    not full yet, never past half the batches), then times each remaining step."""
    i = 0
    while i < len(batches) // 2 and (i < warmup or (until_full is not None and not until_full())):
        train_step(model, batches[i])
        i += 1
    times = []
    for kjt in batches[i:]:
        t0 = time.perf_counter()
        train_step(model, kjt)
        times.append(time.perf_counter() - t0)
    return times


def nnls(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Non-negative least squares of the *relative* error (rows weighted by 1 / b), by
    dropping negative coefficients and refitting: the check judges relative errors."""
    a = a / b[:, None]
    b = np.ones_like(b)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        x, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (x >= 0).all():
            coef[active] = x
            break
        active.pop(int(np.argmin(x)))
    return coef


# ---------------------------------------------------------------------------- calibration


def calibrate_compute(root: Path, steps: int, repeats: int) -> dict[str, float]:
    """Fused kernel: step = overhead + tables * per_table + lookups * lookup + bytes / bw."""
    rows_design, rows_y = [], []
    for n_tables in (1, 4):
        for dim in (16, 128):
            for batch in (1024, 8192):
                specs = [TableSpec(200_000, dim, 1.1)] * n_tables
                batches = kjts(specs, batch, steps)
                step = math.inf
                for _ in range(repeats):
                    model, _ = build(specs, root)
                    step = min(step, statistics.median(run_steps(model, batches, warmup=5)))
                    del model
                unique = np.mean(
                    [
                        sum(len(np.unique(jt.values().numpy())) for jt in kjt.to_dict().values())
                        for kjt in batches
                    ]
                )
                lookups = n_tables * batch
                moved = (
                    2 * lookups * dim * 4
                    + 2 * unique * (dim + STATE_WIDTH) * 4
                    + 2 * n_tables * batch * dim * 4
                )
                rows_design.append([1.0, n_tables, lookups, moved])
                rows_y.append(step)
                print(
                    f"  fused  tables={n_tables} dim={dim:>3} batch={batch:>5}: "
                    f"{step * 1e3:7.2f} ms",
                    flush=True,
                )
    a, b = np.array(rows_design), np.array(rows_y)
    c = nnls(a, b)
    print(f"  fit: max error {np.max(np.abs(a @ c - b) / b):.1%}")
    return {
        "step_overhead_us": c[0] * 1e6,
        "table_overhead_us": c[1] * 1e6,
        "lookup_ns": c[2] * 1e9,
        "bandwidth_gbs": (1.0 / c[3] / 1e9) if c[3] > 0 else 1e3,
    }


def calibrate_cache(root: Path, steps: int) -> dict[str, float]:
    """The row cache's remapping step, timed inside the tiered kernel on the dram tier, per
    step: fixed + per id + per distinct id + per miss + per slot (when evicting)."""
    samples: list[list[float]] = []
    durations: list[float] = []
    original = TieredTableGroup.remap

    def timed_remap(self: TieredTableGroup, values: torch.Tensor, *args: Any) -> torch.Tensor:
        before = [(s.cache.stats.lookups, s.cache.stats.misses) for s in self.shards]
        t0 = time.perf_counter()
        out = original(self, values, *args)
        dt = time.perf_counter() - t0
        for shard, (lk, ms) in zip(self.shards, before):
            unique = shard.cache.stats.lookups - lk
            misses = shard.cache.stats.misses - ms
            # Every step with a miss scans the slots (free slots, protection flags, victims).
            slots = shard.cache.num_slots if misses else 0
            samples.append([1.0, float(values.numel()), unique, misses, slots])
        durations.append(dt)
        return out

    design, target = [], []
    TieredTableGroup.remap = timed_remap  # type: ignore[method-assign,assignment]
    try:
        for zipf in (0.8, 1.2):
            for batch in (1024, 8192):
                for factor in (0.05, 0.2, 0.6):
                    specs = [TableSpec(200_000, 32, zipf)]
                    batches = kjts(specs, batch, steps)
                    model, _ = build(specs, root, {"t_cat_0": ("dram", factor)})
                    start = len(durations)
                    run_steps(model, batches, warmup=0)
                    del model
                    rows = np.array(samples[start + 3 :])  # after the first, coldest steps
                    times = np.array(durations[start + 3 :])
                    design.append(np.median(rows, axis=0))
                    target.append(float(np.median(times)))
                    print(
                        f"  cache  zipf={zipf} batch={batch:>5} factor={factor:<4}: remap "
                        f"{target[-1] * 1e3:7.2f} ms (unique {design[-1][2]:.0f}, misses "
                        f"{design[-1][3]:.0f})",
                        flush=True,
                    )
    finally:
        TieredTableGroup.remap = original  # type: ignore[method-assign]
    a, b = np.array(design), np.array(target)
    c = nnls(a, b)
    print(f"  fit: max error {np.max(np.abs(a @ c - b) / b):.1%}")
    return {
        "table_overhead_us": c[0] * 1e6,
        "lookup_ns": c[1] * 1e9,
        "unique_ns": c[2] * 1e9,
        "miss_ns": c[3] * 1e9,
        "slot_ns": c[4] * 1e9,
    }


FIO_JOBS = {
    "read_qd1": ("randread", 1),
    "read_qd32": ("randread", 32),
    "write_qd32": ("randwrite", 32),
}


def run_fio(
    directory: Path, seconds: int = 5, jobs: Sequence[str] = tuple(FIO_JOBS)
) -> dict[str, float] | None:
    """The disk under ``directory``: random 4 KiB reads at queue depth 1 (a page fault's wait)
    and 32, random 4 KiB writes at 32 (O_DIRECT); ``None`` without fio."""
    out: dict[str, float] = {}
    for key in jobs:
        rw, depth = FIO_JOBS[key]
        job = fio_job(directory, rw, depth, seconds)
        if job is None:
            return None
        out[f"{key}_iops"], out[f"{key}_lat_us"] = job["iops"], job["lat_us"]
        print(f"  fio {key}: {job['iops']:.0f} IOPS, {job['lat_us']:.0f} us")
    return out


def calibrate_tier(root: Path, tier: str, rows: int, repeats: int) -> dict[str, float]:
    """A store's random-row reads and writes at two row sizes and two batch sizes:
    time = call + rows * per_row(row bytes) (byte tiers) or call + ios / IOPS (block)."""
    rng = np.random.default_rng(0)
    points_r: list[tuple[int, int, float]] = []
    points_w: list[tuple[int, int, float]] = []
    for dim in (16, 128):
        layout = RowLayout(num_rows=rows, dim=dim, state_width=STATE_WIDTH)
        directory = root / f"{tier}_{dim}"
        directory.mkdir(parents=True, exist_ok=True)
        store = open_store(tier, directory, "t", layout, mode=OpenMode.TRUNCATE)
        chunk = max(1, (64 << 20) // layout.row_bytes)
        for start in range(0, rows, chunk):  # fill, so reads hit written blocks
            n = min(chunk, rows - start)
            store.write_range(start, np.ones((n, layout.row_width), dtype=np.float32))
        store.flush()
        for m in (256, 4096):
            data = np.ones((m, layout.row_width), dtype=np.float32)
            reads, writes = [], []
            for _ in range(repeats):
                ids = rng.choice(rows, m, replace=False)
                t0 = time.perf_counter()
                store.read_rows(ids)
                reads.append(time.perf_counter() - t0)
                ids = rng.choice(rows, m, replace=False)
                t0 = time.perf_counter()
                store.write_rows(ids, data)
                writes.append(time.perf_counter() - t0)
            points_r.append((layout.row_bytes, m, statistics.median(reads)))
            points_w.append((layout.row_bytes, m, statistics.median(writes)))
            print(
                f"  {tier:<9} row={layout.row_bytes:>4} B rows={m:>5}: read "
                f"{points_r[-1][2] / m * 1e9:8.0f} ns/row, write "
                f"{points_w[-1][2] / m * 1e9:8.0f} ns/row",
                flush=True,
            )
        store.close()
        shutil.rmtree(directory, ignore_errors=True)
    if tier == "block_scm":
        from torchrec_mtrains.planner.perf_model import partial_units_per_row, units_per_row

        def fit_ios(points: list[tuple[int, int, float]], rmw: bool) -> tuple[float, float]:
            a = np.array(
                [
                    [
                        1.0,
                        m
                        * (
                            units_per_row(rb, 4096)
                            + (partial_units_per_row(rb, 4096) if rmw else 0)
                        ),
                    ]
                    for rb, m, _ in points
                ]
            )
            c = nnls(a, np.array([t for *_, t in points]))
            return c[0], c[1]

        call_r, per_io_r = fit_ios(points_r, False)
        call_w, per_io_w = fit_ios(points_w, True)
        return {
            "call_overhead_us": call_r * 1e6,
            "read_iops": 1.0 / per_io_r,
            # a write-back's I/Os are half reads (read-modify-write), half writes
            "write_iops": 1.0 / max(2 * per_io_w - per_io_r, 1e-9),
        }

    def fit_bytes(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
        a = np.array([[1.0, m, m * rb] for rb, m, _ in points])
        c = nnls(a, np.array([t for *_, t in points]))
        return c[0], c[1], c[2]

    call_r, lat_r, byte_r = fit_bytes(points_r)
    call_w, lat_w, byte_w = fit_bytes(points_w)
    return {
        "call_overhead_us": (call_r + call_w) / 2 * 1e6,
        "read_latency_ns": lat_r * 1e9,
        "write_latency_ns": lat_w * 1e9,
        "read_bandwidth_gbs": 1.0 / byte_r / 1e9 if byte_r > 0 else 100.0,
        "write_bandwidth_gbs": 1.0 / byte_w / 1e9 if byte_w > 0 else 100.0,
    }


def calibrate(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="calib-", dir=args.dir))
    result: dict[str, dict[str, float]] = {}
    try:
        with process_group():
            print("fused kernel (DMP, tables on FUSED):", flush=True)
            result["compute"] = calibrate_compute(root, args.steps, args.repeats)
            print("row cache (tiered kernel on the dram tier, remap timed):", flush=True)
            result["cache_manager"] = calibrate_cache(root, args.steps)
        print("tiers (stores alone):", flush=True)
        result["block_scm"] = calibrate_tier(root, "block_scm", args.tier_rows, args.repeats)
        print("byte_scm on the run directory's disk (page cache):")
        result["byte_scm (file on disk)"] = calibrate_tier(
            root, "byte_scm", args.tier_rows // 4, args.repeats
        )
        fio = run_fio(root)
        if fio:
            result["fio (run directory)"] = fio
        if Path(args.shm_dir).is_dir():
            shm = Path(tempfile.mkdtemp(prefix="calib-", dir=args.shm_dir))
            try:
                print(f"byte_scm on tmpfs ({args.shm_dir}):")
                result["byte_scm (tmpfs)"] = calibrate_tier(
                    shm, "byte_scm", args.tier_rows // 2, args.repeats
                )
            finally:
                shutil.rmtree(shm, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n# measured figures for torchrec_mtrains/conf/hardware/local*.yaml")
    for section, values in result.items():
        print(f"{section}:")
        for key, value in values.items():
            print(f"  {key}: {value:.4g}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


# ---------------------------------------------------------------------------------- check


@dataclass
class CheckResult:
    """Predicted vs measured step time of one configuration."""

    name: str
    placements: dict[str, str]
    predicted_ms: float
    measured_ms: float
    predicted_hit_rate: dict[str, float] = field(default_factory=dict)
    measured_hit_rate: dict[str, float] = field(default_factory=dict)
    predicted_parts_ms: dict[str, float] = field(default_factory=dict)

    @property
    def error(self) -> float:
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


def predict(
    specs: Sequence[TableSpec],
    placements: Placements,
    profile: AccessProfile,
    host: HostTopology,
    batch_size: int,
) -> tuple[float, dict[str, float], StepTime]:
    """The perf model's step time for a one-rank model placed as given."""
    total = StepTime()
    hits: dict[str, float] = {}
    for config, spec in zip(table_configs(specs), specs):
        access = from_profile(profile[config.name])
        tier, factor = placements.get(config.name, ("fused", 1.0))
        work = table_work(access, spec.dim, batch_size, state_width=STATE_WIDTH)
        if tier == "fused":
            total = total + shard_step_time(Placement.FUSED_DRAM, work, host)
            continue
        options = TieredTableOptions(tier=Tier(tier), cache_load_factor=factor)
        cache = options.cache_rows(spec.rows)
        hit = access.hit_rate(cache, batch_size)
        hits[config.name] = hit
        placement = Placement(f"cached_{tier}")
        total = total + shard_step_time(placement, work, host, cache_rows=cache, hit_rate=hit)
    step = host.compute.step_overhead_us * 1e-6 + total.total
    return step, hits, total


def measure(
    specs: Sequence[TableSpec],
    batches: Sequence[KeyedJaggedTensor],
    root: Path,
    repeats: int,
    placements: dict[str, tuple[str, float]] | None = None,
    plan: EmbeddingModuleShardingPlan | None = None,
) -> tuple[float, dict[str, float]]:
    """Fastest over ``repeats`` of the median step time once caches are full, and the
    measured hit rates over the timed steps."""
    best = math.inf
    hit_rates: dict[str, float] = {}
    for _ in range(repeats):
        model, _ = build(specs, root, placements, plan)

        n = len(batches)
        i = 0
        while i < n // 2 and (
            i < 5 or not all(s["evictions"] > 0 for s in tier_stats(model).values())
        ):
            train_step(model, batches[i])
            i += 1
        before = tier_stats(model)
        times = []
        for kjt in batches[i:]:
            t0 = time.perf_counter()
            train_step(model, kjt)
            times.append(time.perf_counter() - t0)
        after = tier_stats(model)
        for name, stats in after.items():
            lookups = stats["lookups"] - before[name]["lookups"]
            hits = stats["hits"] - before[name]["hits"]
            hit_rates[name] = hits / lookups if lookups else 0.0
        best = min(best, statistics.median(times))
        del model
    return best, hit_rates


CHECK_SPECS = [
    TableSpec(rows=2_000, dim=32, zipf=1.1, pooling=2),
    TableSpec(rows=1_000_000, dim=32, zipf=1.1),
    TableSpec(rows=1_000_000, dim=64, zipf=0.9),
]
QUICK_SPECS = [TableSpec(rows=500, dim=8, zipf=1.1), TableSpec(rows=20_000, dim=8, zipf=1.1)]


def check_configs(quick: bool) -> list[tuple[str, Placements | int | None]]:
    """(name, what to build): hand-made placements (table -> (tier, cache load factor)), or
    the planner's plan with all of the host's DRAM (``None``) or a DRAM budget in bytes."""
    if quick:
        return [("byte_scm 10%", {"t_cat_1": ("byte_scm", 0.1)})]
    out: list[tuple[str, Placements | int | None]] = []
    for tier in ("byte_scm", "block_scm"):
        for factor in (0.005, 0.02, 0.1):
            out.append(
                (
                    f"{tier} caches {factor:.1%}",
                    {"t_cat_1": (tier, factor), "t_cat_2": (tier, factor)},
                )
            )
    out.append(
        (
            "mixed: byte 2% + block 5%",
            {"t_cat_1": ("byte_scm", 0.02), "t_cat_2": ("block_scm", 0.05)},
        )
    )
    out.append(("planned", None))
    out.append(("planned, 200 MiB of DRAM", 200 * 2**20))
    return out


def with_dram_budget(host: HostTopology, budget: int) -> HostTopology:
    """The host with only ``budget`` bytes of DRAM left for embeddings."""
    out = copy.deepcopy(host)
    out.dram.capacity = str(parse_size(out.dram_reserved) + budget)
    return out


def check(args: argparse.Namespace) -> list[CheckResult]:
    specs = QUICK_SPECS if args.quick else CHECK_SPECS
    host = load_topology(args.hardware)
    batches = kjts(specs, args.batch_size, args.steps)
    profile = profile_batches(
        batches,
        {c.name: TableInfo(c.num_embeddings, c.embedding_dim) for c in table_configs(specs)},
        sampling_rate=1.0,
        feature_to_table={f"cat_{i}": f"t_cat_{i}" for i in range(len(specs))},
    )
    results = []
    root = Path(tempfile.mkdtemp(prefix="perf-check-", dir=args.dir))
    disk: list[float] = []
    try:
        if not args.quick:  # the disk is shared: say what it delivered during this run
            probe = run_fio(root, seconds=3, jobs=("read_qd32",))
            disk += [probe["read_qd32_iops"]] if probe else []
        with process_group():
            for name, what in check_configs(args.quick):
                plan = None
                placements = what if isinstance(what, dict) else None
                if placements is None:
                    budget = what if isinstance(what, int) else None
                    planned_host = host if budget is None else with_dram_budget(host, budget)
                    sharder = TieredEmbeddingBagCollectionSharder(
                        offer_tiered_kernel=True, fused_params=dict(FUSED)
                    )
                    plan, summary = plan_tables(
                        table_configs(specs), planned_host, 1, args.batch_size, profile, sharder
                    )
                    predicted = summary.step_time_s
                    parts: dict[str, float] = {}
                    hits = {t.table: t.hit_rate for t in summary.tables if t.hit_rate is not None}
                    placed = {
                        t.table: f"{t.tier.value}/{t.kernel}"
                        + (f" cache {t.cache_rows}" if t.hit_rate is not None else "")
                        for t in summary.tables
                    }
                    print(summary.format(), flush=True)
                else:
                    predicted, hits, total = predict(
                        specs, placements, profile, host, args.batch_size
                    )
                    parts = {k: v * 1e3 for k, v in asdict(total).items()}
                    placed = {k: f"{t}@{f:g}" for k, (t, f) in placements.items()}
                measured, measured_hits = measure(
                    specs, batches, root, args.repeats, placements, plan
                )
                result = CheckResult(
                    name=name,
                    placements=placed,
                    predicted_ms=predicted * 1e3,
                    measured_ms=measured * 1e3,
                    predicted_hit_rate={k: float(v) for k, v in hits.items()},
                    measured_hit_rate=measured_hits,
                    predicted_parts_ms=parts,
                )
                results.append(result)
                print(
                    f"{name:<28} predicted {result.predicted_ms:8.2f} ms   measured "
                    f"{result.measured_ms:8.2f} ms   error {result.error:+6.1%}",
                    flush=True,
                )
        if not args.quick:
            probe = run_fio(root, seconds=3, jobs=("read_qd32",))
            disk += [probe["read_qd32_iops"]] if probe else []
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if disk and host.block_scm is not None:
        print(
            "disk: fio random 4 KiB reads at QD32 before / after: "
            + " / ".join(f"{d:,.0f}" for d in disk)
            + f" IOPS (the preset's block tier assumes {host.block_scm.read_iops:,.0f})"
        )
    errors = [abs(r.error) for r in results]
    print(
        f"\n{len(results)} configurations: mean |error| {statistics.mean(errors):.1%}, "
        f"max |error| {max(errors):.1%}"
    )
    if args.out:
        payload = [dict(asdict(r), error=r.error) for r in results]
        Path(args.out).write_text(json.dumps(payload, indent=1) + "\n")
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="check", choices=["check", "calibrate"])
    parser.add_argument("--hardware", default="local", help="hardware preset (check)")
    parser.add_argument("--batch-size", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=0, help="batches per configuration")
    parser.add_argument("--repeats", type=int, default=0)
    parser.add_argument("--tier-rows", type=int, default=4_000_000, help="rows (calibrate)")
    parser.add_argument("--dir", default=None, help="where tier files go (default: a temp dir)")
    parser.add_argument(
        "--shm-dir", default="/dev/shm", help="tmpfs for the byte tier (local_shm preset)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny models, a few steps")
    parser.add_argument("--out", default="", help="write the results as JSON here")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = args.steps or 24
        args.repeats = args.repeats or 1
        args.batch_size = min(args.batch_size, 256)
    args.steps = args.steps or (40 if args.command == "calibrate" else 240)
    args.repeats = args.repeats or (9 if args.command == "calibrate" else 2)
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
    if args.command == "calibrate":
        calibrate(args)
    else:
        check(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
