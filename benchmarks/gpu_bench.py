"""W1 on one compute device: TorchRec's own kernels against tiered tables at the same
device-cache budget.

The W1 workload (``apps.dlrm.workloads.w1``: 26 tables of the Criteo Kaggle shape, 33.8 M rows,
dim 64, Zipf(1.1), row-wise Adagrad fused into the kernels) at each ``--batch-sizes`` value.
Variants, each in its own subprocess, from the same weights on the same batches:

* ``A``: TorchRec's FUSED kernel with every table in the device's memory (HBM on a GPU),
  trained with TorchRec's ``TrainPipelineSparseDist``.
* ``U``: TorchRec's FUSED_UVM_CACHING kernel on the tables of at least ``--min-rows`` rows (the
  five over 1 M), a cache of ``--cache-load-factor`` of their rows in HBM, every other table
  FUSED in HBM, trained with TorchRec's ``PrefetchTrainPipelineSparseDist`` (it fills the cache
  for the next batch while the current one trains). CUDA only: fbgemm's UVM has no CPU path,
  so ``--device cpu`` reports it as not run, with that reason.
* ``ours_dram``, ``ours_byte_scm``, ``ours_block_scm``: the same tables tiered on DRAM, byte
  SCM (a mapped file) or block SCM (O_DIRECT files, the tier's default log layout), behind a
  cache of the same load factor in the device's memory, every other table FUSED there; the
  look-ahead pipeline reads the rows of the next ``--lookahead`` batches meanwhile. Stores open
  with the ``local`` hardware preset's options, as the app opens them.

Every variant's first steps' losses are compared with A's before anything is timed: bit for bit
on the CPU, within ``1e-6`` relative on CUDA (the tolerance the CUDA parity tests hold
TorchRec's own kernels to). A variant that trains another model reports no figure. Then it
warms up: at least ``--warmup`` steps and until its device cache is full (ours' and U's; at
most ``--max-warmup-s``), so the timed steps evict as many rows as they load.

Per variant: ms a step and samples/s (the median of ``--windows`` timed windows, the device
synchronized at each window's ends), ratios to A and to U, the cache hit rate (unique ids a
step found in the cache: ours' counters, U's fbgemm UVM-cache statistics), the stall (ours:
the training thread waiting for tier I/O), the row bytes filled into the device cache a step
(host to device: ours moves weights and optimizer state, U's cache holds weights), and for
``ours_block_scm`` the rate the disk allows: its random 4 KiB read IOPS, measured in the same
run under the tiers' directory (fio, or the tier's own AIO engine where fio is missing),
divided by the blocks a sample reads. JSON, and a PNG beside it.

Example::

    python benchmarks/gpu_bench.py --out results/gpu.json                    # a GPU host
    python benchmarks/gpu_bench.py --device cpu --smoke --out /tmp/gpu.json  # seconds; CI
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torchrec.distributed.train_pipeline import (
    PrefetchTrainPipelineSparseDist,
    TrainPipelineSparseDist,
)

from apps.dlrm.workloads.w1 import (
    BatchStream,
    Built,
    Workload,
    build_fused,
    build_tiered_on,
    build_uvm_cached,
    fused_tbes,
    tiered_groups,
)
from torchrec_mtrains.benchmark.disk import random_read_iops
from torchrec_mtrains.benchmark.losses import CHECK_STEPS, LossMismatch, check_losses
from torchrec_mtrains.benchmark.measure import (
    add_malloc_option,
    apply_malloc_option,
    machine_info,
    median_windows,
    synchronize,
    target,
    write_json,
)
from torchrec_mtrains.benchmark.tier_probes import (
    TierClock,
    caches_full,
    tier_delta,
    tier_snapshot,
)
from torchrec_mtrains.distributed.runtime import process_group, with_index
from torchrec_mtrains.pipeline import LookaheadTrainPipeline
from torchrec_mtrains.types import Tier

VARIANTS = ("A", "U", "ours_dram", "ours_byte_scm", "ours_block_scm")
TIER_OF = {"ours_dram": Tier.DRAM, "ours_byte_scm": Tier.BYTE_SCM, "ours_block_scm": Tier.BLOCK_SCM}
CUDA_ONLY = {"U": "TorchRec's FUSED_UVM_CACHING kernel (fbgemm's UVM) runs on CUDA only"}
CUDA_LOSS_RTOL = 1e-6
BLOCK_SIZE = 4096
# Targets (ours against U on the same device, the block tier against its disk's rate).
TARGET_DRAM_VS_U = 0.9
TARGET_BYTE_SCM_VS_U = 0.85
TARGET_BLOCK_VS_IOPS_BOUND = 0.7
TARGET_STALL_SHARE = 0.10
# fbgemm's UVM cache statistics: positions in get_uvm_cache_stats().
_UVM_UNIQUE_INDICES, _UVM_UNIQUE_MISSES = 2, 3


# ---------------------------------------------------------------------------------- worker


@dataclass
class WorkerSpec:
    """What one subprocess runs (JSON between parent and worker)."""

    variant: str
    device: str
    workload: dict[str, Any]
    warmup: int
    windows: int
    window_steps: int
    directory: str
    out: str
    cache_load_factor: float
    min_rows: int
    lookahead: int
    threads: int
    check_steps: int
    reference_losses: list[float] | None = None
    profile_steps: int = 0
    max_warmup_s: float = 120.0
    # Once built: reuse_freed_memory(this) (torchrec_mtrains.malloc); None: glibc's settings.
    malloc_trim_threshold: int | None = None


def build(spec: WorkerSpec, wl: Workload, device: torch.device) -> Built:
    if spec.variant == "A":
        return build_fused(wl, device=device)
    if spec.variant == "U":
        return build_uvm_cached(wl, device, spec.cache_load_factor, spec.min_rows)
    if spec.variant in TIER_OF:
        directory = Path(spec.directory)
        tier = TIER_OF[spec.variant]
        return build_tiered_on(wl, directory, tier, spec.cache_load_factor, spec.min_rows, device)
    raise ValueError(f"unknown variant {spec.variant!r}; expected one of {', '.join(VARIANTS)}")


def make_pipeline(spec: WorkerSpec, built: Built, device: torch.device) -> Any:
    """The training loop each variant is timed under (see the module's docstring)."""
    if spec.variant == "U":
        return PrefetchTrainPipelineSparseDist(built.model, built.dense_optimizer, device)
    if spec.variant in TIER_OF:
        return LookaheadTrainPipeline(
            built.model, built.dense_optimizer, device, lookahead=spec.lookahead
        )
    return TrainPipelineSparseDist(built.model, built.dense_optimizer, device)


# fbgemm's set-associative cache may keep a few ways of some sets empty for long.
UVM_CACHE_FULL_SHARE = 0.99


def _uvm_caches(built: Built) -> list[Any]:
    """The fbgemm modules of the variant that keep a UVM cache in HBM (U's caching kernels)."""
    return [tbe for tbe in fused_tbes(built.model) if tbe.lxu_cache_weights.numel() > 0]


def _caches_full(built: Built, groups: list[Any]) -> Callable[[], bool]:
    """Whether the variant's device caches are full: ours' (every slot resident), U's
    (fbgemm's UVM caches, ``UVM_CACHE_FULL_SHARE`` of their lines); true without a cache."""
    uvm = _uvm_caches(built)

    def full() -> bool:
        return caches_full(groups) and all(
            float((tbe.lxu_cache_state >= 0).float().mean()) >= UVM_CACHE_FULL_SHARE for tbe in uvm
        )

    return full


def _uvm_cache_stats(built: Built) -> torch.Tensor | None:
    """U's fbgemm UVM-cache counters summed over its caching kernels (None for the others)."""
    stats = [
        tbe.get_uvm_cache_stats().detach().to("cpu", torch.float64)
        for tbe in _uvm_caches(built)
        if getattr(tbe, "gather_uvm_cache_stats", False)
    ]
    return torch.stack(stats).sum(0) if stats else None


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Builds one variant on its device, checks its losses against A's, times it."""
    torch.set_num_threads(spec.threads)
    device = with_index(torch.device(spec.device))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fields: dict[str, Any] = {k: tuple(v) if k == "sizes" else v for k, v in spec.workload.items()}
    wl = Workload(**fields)
    out: dict[str, Any] = {"variant": spec.variant, "device": str(device)}
    with process_group(device):
        t0 = time.perf_counter()
        built = build(spec, wl, device)
        out["build_s"] = time.perf_counter() - t0
        out["plan"] = built.plan_text
        out.update(built.info)
        print(f"[{spec.variant}] built in {out['build_s']:.1f} s: {built.plan_text}", flush=True)
        # Built: from here on, with --malloc-trim-threshold, the steps reuse what the last freed.
        out["malloc"] = apply_malloc_option(spec.malloc_trim_threshold)
        pipeline = make_pipeline(spec, built, device)
        try:
            out.update(_train(spec, wl, built, pipeline, device))
        except LossMismatch as e:
            out["loss_mismatch"] = str(e)
            write_json(Path(spec.out), out)
            raise
        finally:
            close: Callable[[], None] | None = getattr(pipeline, "close", None)
            if close is not None:
                close()  # the look-ahead pipeline drains its tier workers
        write_json(Path(spec.out), out)
    return out


def _train(
    spec: WorkerSpec, wl: Workload, built: Built, pipeline: Any, device: torch.device
) -> dict[str, Any]:
    stream = BatchStream(wl)
    batches = (stream[j] for j in itertools.count())
    groups = tiered_groups(built.model) if spec.variant in TIER_OF else []
    clock = TierClock(groups) if groups else None
    losses: list[float] = []

    def step() -> None:
        loss, _ = pipeline.progress(batches)  # trains batch i; pulls what it reads ahead
        if len(losses) < spec.check_steps:
            losses.append(float(loss))  # a host sync, only in the untimed first steps

    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    for _ in range(spec.check_steps):
        step()
    out["first_losses"] = losses
    if spec.reference_losses is not None:  # before anything else: a wrong model stops here
        rtol = CUDA_LOSS_RTOL if device.type == "cuda" else 0.0
        check_losses(spec.variant, losses, spec.reference_losses, rtol)
        exact = losses == spec.reference_losses
        out["losses_vs_A"] = "bit for bit" if exact else f"within {rtol:g} relative"
        print(f"[{spec.variant}] first {len(losses)} losses: A's, {out['losses_vs_A']}", flush=True)
    # Steady state: at least ``warmup`` steps and until the device caches (ours', U's) are
    # full, so that the timed steps evict as many rows as they load; at most max_warmup_s.
    full = _caches_full(built, groups)
    done = spec.check_steps
    while done < spec.warmup or (
        time.perf_counter() - t0 < spec.max_warmup_s and (done % 10 or not full())
    ):
        step()
        done += 1
    synchronize(device)
    out["warmup_s"] = time.perf_counter() - t0
    out["warmup_steps_done"] = done
    out["caches_full_before_timing"] = full()
    if not out["caches_full_before_timing"]:
        print(f"[{spec.variant}] caches not full after {done} warm-up steps", flush=True)

    timed = spec.windows * spec.window_steps
    stream.prepare(done, timed + spec.lookahead + 2)  # no batch is made inside a window
    tiers_before = tier_snapshot(groups)
    clock_before = clock.snapshot() if clock else {}
    uvm_before = _uvm_cache_stats(built)
    windows: list[float] = []
    for _ in range(spec.windows):
        synchronize(device)
        w0 = time.perf_counter()
        for _ in range(spec.window_steps):
            step()
        synchronize(device)
        windows.append(time.perf_counter() - w0)
        rate = spec.window_steps * wl.batch_size / windows[-1]
        print(f"[{spec.variant}] window {len(windows)}/{spec.windows}: {rate:,.0f} samples/s")
    out.update(median_windows(windows, spec.window_steps * wl.batch_size))
    out["step_ms"] = statistics.median(windows) / spec.window_steps * 1e3
    out["timed_steps"] = timed
    if groups:
        d = tier_delta(tiers_before, tier_snapshot(groups))
        d.pop("tables")
        out["tiers"] = d
        out["hit_rate"] = d["hit_rate"]
        out["h2d_bytes_per_step"] = d["misses"] * wl.row_bytes / timed
        out["d2h_bytes_per_step"] = d["writebacks"] * wl.row_bytes / timed
        out["read_blocks_per_step"] = d["tier_bytes_read"] / BLOCK_SIZE / timed
        if clock is not None:
            spent = {k: v - clock_before.get(k, 0.0) for k, v in clock.snapshot().items()}
            out["stall_share"] = spent["stall_s"] / sum(windows) if windows else None
            out["stall_ms_per_step"] = spent["stall_s"] / timed * 1e3
    uvm_after = _uvm_cache_stats(built)
    if uvm_before is not None and uvm_after is not None:
        d_uvm = (uvm_after - uvm_before).tolist()
        unique, misses = d_uvm[_UVM_UNIQUE_INDICES], d_uvm[_UVM_UNIQUE_MISSES]
        out["hit_rate"] = 1.0 - misses / unique if unique else None
        out["h2d_bytes_per_step"] = misses * wl.dim * 4 / timed
    if spec.profile_steps > 0:
        try:
            out["profile"] = _profile(step, spec.profile_steps, device)
        except Exception as e:  # a failed profile must not lose the figures
            out["profile"] = f"profile failed: {type(e).__name__}: {e}"
    return out


def _profile(step: Callable[[], None], steps: int, device: torch.device) -> str:
    """Where ``steps`` steps after the timed windows spend their time: torch.profiler's
    operator tables (every thread, the device's kernels too on CUDA), by self device time on
    CUDA and by self CPU time. After the windows, so it never slows a timed step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        synchronize(device)
    ops = prof.key_averages()
    # On CUDA both views: a step the device idles through is bound by the host's work.
    sorts = (["self_device_time_total"] if cuda else []) + ["self_cpu_time_total"]
    return "\n".join(
        f"by {sort}:\n{ops.table(sort_by=sort, row_limit=30, max_name_column_width=60)}"
        for sort in sorts
    )


# ---------------------------------------------------------------------------------- parent


def launch(spec: WorkerSpec, work: Path, timeout_s: float) -> dict[str, Any]:
    """Runs one variant in a subprocess; its JSON, or why there is none."""
    tag = Path(spec.out).stem
    spec_path = work / f"{tag}.spec.json"
    write_json(spec_path, asdict(spec))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)]
    print(f"--- {tag}", flush=True)
    t0 = time.perf_counter()
    try:
        done = subprocess.run(cmd, timeout=max(1.0, timeout_s), check=False)
        code: int | str = done.returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    out = Path(spec.out)
    record: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    record["wall_s"] = time.perf_counter() - t0
    record["ok"] = code == 0 and "loss_mismatch" not in record and "samples_per_s" in record
    if not record["ok"]:
        record["error"] = record.get("loss_mismatch") or f"exit {code}"
        print(f"--- {tag}: not measured ({record['error']})", flush=True)
    return record


def _ratio(x: dict[str, Any] | None, y: dict[str, Any] | None) -> float | None:
    if not x or not y or not x.get("ok") or not y.get("ok"):
        return None
    return float(x["samples_per_s"]) / float(y["samples_per_s"])


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios and targets per batch size, recomputable from the JSON alone."""
    out: dict[str, Any] = {}
    iops = (results.get("disk") or {}).get("iops")
    for batch, runs in results["batches"].items():
        a, u = runs.get("A"), runs.get("U")
        rows: dict[str, Any] = {}
        for variant, run in runs.items():
            rows[variant] = {"vs_A": _ratio(run, a), "vs_U": _ratio(run, u)}
        block = runs.get("ours_block_scm") or {}
        bound = None
        if iops and block.get("ok") and block.get("read_blocks_per_step"):
            bound = iops * int(batch) / block["read_blocks_per_step"]
        rows["ours_block_scm_iops_bound_samples_per_s"] = bound
        stalls = [r.get("stall_share") for r in runs.values() if r.get("stall_share") is not None]
        rows["targets"] = {
            "ours_dram_vs_U": target(rows.get("ours_dram", {}).get("vs_U"), TARGET_DRAM_VS_U),
            "ours_byte_scm_vs_U": target(
                rows.get("ours_byte_scm", {}).get("vs_U"), TARGET_BYTE_SCM_VS_U
            ),
            "ours_block_scm_vs_iops_bound": target(
                block["samples_per_s"] / bound if bound and block.get("ok") else None,
                TARGET_BLOCK_VS_IOPS_BOUND,
            ),
            "max_stall_share": target(max(stalls) if stalls else None, TARGET_STALL_SHARE, True),
        }
        out[batch] = rows
    return out


def print_summary(results: dict[str, Any]) -> None:
    def f(value: Any, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"\nW1 on {results['device_name']} ({results['device']})")
    for batch, runs in results["batches"].items():
        s = results["summary"][batch]
        print(f"\nbatch {int(batch):,}")
        head = f"{'variant':16}{'ms/step':>9}{'samples/s':>12}{'/A':>7}{'/U':>7}"
        print(head + f"{'hit':>7}{'stall':>8}{'H2D MB/step':>13}")
        for variant, run in runs.items():
            if not run.get("ok"):
                print(f"{variant:16}  not run: {run.get('error') or run.get('skipped')}")
                continue
            h2d = run.get("h2d_bytes_per_step")
            print(
                f"{variant:16}{run['step_ms']:9.2f}{run['samples_per_s']:12,.0f}"
                f"{f(s[variant]['vs_A'], '.2f'):>7}{f(s[variant]['vs_U'], '.2f'):>7}"
                f"{f(run.get('hit_rate'), '.3f'):>7}{f(run.get('stall_share'), '.1%'):>8}"
                f"{f(h2d / 1e6 if h2d is not None else None, '.2f'):>13}"
            )
        bound = s["ours_block_scm_iops_bound_samples_per_s"]
        if bound:
            print(f"block_scm rate the disk's IOPS allow: {bound:,.0f} samples/s")
        for name, t in s["targets"].items():
            met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
            print(f"target {name}: {f(t['value'], '.3f')} (target {t['target']}) {met}")


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = list(results["batches"])
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        runs = results["batches"][batch]
        names = list(runs)
        rates = [runs[n]["samples_per_s"] if runs[n].get("ok") else 0.0 for n in names]
        bars = ax.bar(names, rates, color=["#777777", "#4c72b0"] + ["#dd8452"] * 3)
        for bar, name in zip(bars, names):
            vs_a = results["summary"][batch][name]["vs_A"]
            label = "not run" if not runs[name].get("ok") else f"{vs_a:.2f}x A"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
        bound = results["summary"][batch]["ours_block_scm_iops_bound_samples_per_s"]
        if bound and "ours_block_scm" in names:
            x = names.index("ours_block_scm")
            ax.hlines(bound, x - 0.4, x + 0.4, colors="k", linestyles="dashed")
            ax.annotate("disk IOPS bound", (x, bound), xytext=(0, 12), textcoords="offset points",
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_title(f"W1, batch {int(batch):,}, on {results['device_name']}")
        ax.set_ylabel("samples/s (median window)")
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _device_name(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return str(machine_info().get("cpu_model") or "CPU")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("results/gpu.json"))
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    add_malloc_option(parser, None)
    parser.add_argument("--batch-sizes", default=None, help="default 8192,65536 (smoke 256)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--cache-load-factor", type=float, default=0.15)
    parser.add_argument("--min-rows", type=int, default=None, help="default 1M (smoke 10k)")
    parser.add_argument("--lookahead", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 50)")
    parser.add_argument(
        "--max-warmup-s",
        type=float,
        default=120.0,
        help="a variant warms up at least --warmup steps and until its device cache is full, "
        "for at most this long",
    )
    parser.add_argument("--windows", type=int, default=None, help="timed windows (default 5)")
    parser.add_argument("--window-steps", type=int, default=None, help="default 20")
    parser.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--dir", type=Path, default=None, help="tier files (default: a tmp dir)")
    parser.add_argument("--time-limit", type=float, default=1e9, help="seconds for all runs")
    parser.add_argument("--disk-probe-bytes", type=int, default=None, help="default 1 GiB")
    parser.add_argument("--smoke", action="store_true", help="tiny tables, a few steps")
    parser.add_argument(
        "--profile-steps", type=int, default=0, help="after timing, profile this many steps"
    )
    parser.add_argument("--render", type=Path, help="re-summarize and re-plot a result JSON")
    args = parser.parse_args(argv)
    if args.worker is not None:
        spec = WorkerSpec(**json.loads(args.worker.read_text()))
        try:
            return run_worker(spec)
        except LossMismatch as e:
            print(e, file=sys.stderr)
            raise SystemExit(3) from None
    if args.render is not None:
        return report(json.loads(args.render.read_text()), args.out)

    start = time.perf_counter()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible (torch.cuda.is_available() is False)")
    device = str(with_index(torch.device(args.device)))  # every worker on the same GPU
    wl0 = Workload.smoke() if args.smoke else Workload.full()
    batch_sizes = [
        int(b) for b in (args.batch_sizes or ("256" if args.smoke else "8192,65536")).split(",")
    ]
    min_rows = args.min_rows or (10_000 if args.smoke else 1_000_000)
    warmup = args.warmup if args.warmup is not None else (2 if args.smoke else 50)
    windows = args.windows or (2 if args.smoke else 5)
    window_steps = args.window_steps or (2 if args.smoke else 20)
    check_steps = min(CHECK_STEPS, 4) if args.smoke else CHECK_STEPS
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; expected {', '.join(VARIANTS)}")
    # A first, always: every other variant's losses are checked against A's.
    variants = [v for v in VARIANTS if v in variants or v == "A"]
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="gpu_bench_"))
    work = Path(tempfile.mkdtemp(prefix="gpu_bench_", dir=base))
    results: dict[str, Any] = {
        "device": device,
        "device_name": _device_name(device),
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine": machine_info(),
        "workload": asdict(wl0),
        "cache_load_factor": args.cache_load_factor,
        "min_rows": min_rows,
        "batches": {},
    }
    if "ours_block_scm" in variants:
        probe = args.disk_probe_bytes or ((16 << 20) if args.smoke else (1 << 30))
        results["disk"] = random_read_iops(work, probe, 0.5 if args.smoke else 5.0)
        results["disk"]["directory"] = str(work)
        print(f"disk: {results['disk']['iops']:,.0f} random 4 KiB reads/s", flush=True)
    for batch in batch_sizes:
        wl = Workload(**{**asdict(wl0), "batch_size": batch})
        runs: dict[str, Any] = {}
        reference: list[float] | None = None
        for variant in variants:
            left = args.time_limit - (time.perf_counter() - start)
            if variant in CUDA_ONLY and not device.startswith("cuda"):
                runs[variant] = {"ok": False, "skipped": CUDA_ONLY[variant]}
                continue
            if left <= 0 or (variant != "A" and reference is None):
                why = "time limit" if left <= 0 else "A did not run: nothing to check against"
                runs[variant] = {"ok": False, "skipped": why}
                continue
            spec = WorkerSpec(
                variant=variant,
                device=device,
                workload=asdict(wl),
                warmup=warmup,
                windows=windows,
                window_steps=window_steps,
                directory=str(work / f"{variant}_{batch}"),
                out=str(work / f"{variant}_{batch}.json"),
                cache_load_factor=args.cache_load_factor,
                min_rows=min_rows,
                lookahead=args.lookahead,
                threads=args.threads,
                check_steps=check_steps,
                reference_losses=reference,
                profile_steps=args.profile_steps,
                max_warmup_s=args.max_warmup_s,
                malloc_trim_threshold=args.malloc_trim_threshold,
            )
            runs[variant] = launch(spec, work, left)
            shutil.rmtree(spec.directory, ignore_errors=True)  # disk for the next one's files
            if variant == "A" and runs[variant]["ok"]:
                reference = runs[variant]["first_losses"]
        results["batches"][str(batch)] = runs
    results["seconds"] = time.perf_counter() - start
    return report(results, args.out)


def report(results: dict[str, Any], out: Path) -> dict[str, Any]:
    """Summary, JSON and the printed table, then the PNG: the figures are kept whatever the
    plot does."""
    results["summary"] = summarize(results)
    write_json(out, results)
    print_summary(results)
    plot(results, out.with_suffix(".png"))
    print(f"\nwrote {out} and {out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
