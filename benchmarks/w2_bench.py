"""W2: a model larger than memory trains end to end through the DLRM app under a memory cap.

The app (``python -m apps.dlrm.train``) trains ``conf/model/w2_large.yaml`` (26 Criteo-shaped
features, 12.2 GiB of tables with their row-wise Adagrad state) inside a memory cgroup capped at
``--cap`` (default 4 GiB, so the tables are over 3x the cap): page cache included, so nothing
can hide in it. The tiered planner places the tables on this host as the cap leaves it, from an
access profile of the data (``python -m apps.dlrm.profile``, run first, uncapped): DRAM
for tables and caches limited to ``--dram-budget``, and no byte tier (a memory-mapped byte tier
would live in the capped page cache); so the big tables go to the block tier (O_DIRECT) behind
row caches, trained with the look-ahead pipeline. The run evaluates and writes its final
checkpoint as usual.

First, A trains the same steps with every table on TorchRec's FUSED kernel in DRAM, uncapped
(the machine needs the tables' size free): the tiered run's first losses must be A's, bit for
bit, and A's throughput is the same-run baseline.

Reported: throughput and its ratio to A's, cache hit rates (overall and per table), tier stall, tier traffic, the
process's peak RSS and the cgroup's peak usage against the cap, time per phase. The run
directory (tier files, checkpoint) is removed afterwards unless ``--keep``.

With ``run.device=cuda`` among the overrides, U runs last: the same tables on TorchRec's own
FUSED_UVM_CACHING (``planner=size_rule planner.large_tables=uvm_caching``: rows in host memory
mapped for the GPU, a cache in HBM) under the same cap, to show what TorchRec alone does with
tables larger than host memory: its exit, OOM kills, peak and error are reported. Without CUDA
it is reported as not run (fbgemm's UVM has no CPU path).

Example::

    python benchmarks/w2_bench.py --out results/w2.json               # ~5 min here
    python benchmarks/w2_bench.py --smoke --out /tmp/w2_smoke.json    # seconds; the tests
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from torchrec_mtrains.benchmark.measure import disk_free_bytes, machine_info, write_json
from torchrec_mtrains.benchmark.memory_cap import CgroupSupport, cgroup_support, run_capped
from torchrec_mtrains.planner import parse_size

REPO = Path(__file__).resolve().parents[1]
STATE_WIDTH = 1  # row-wise Adagrad
TARGET_RATIO = 3.0


def table_bytes(model: dict[str, Any]) -> int:
    """Weights plus row-wise optimizer state of a model config's tables, float32."""
    dim = int(model["embedding_dim"])
    return sum(int(n) for n in model["num_embeddings_per_feature"]) * (dim + STATE_WIDTH) * 4


def smoke_sizes() -> list[int]:
    """The W2 shape divided by 1000 (largest table 14k rows)."""
    model = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "w2_large.yaml"))
    assert isinstance(model, dict)
    return [max(4, int(n) // 1000) for n in model["num_embeddings_per_feature"]]


def data_overrides(args: argparse.Namespace) -> list[str]:
    """Model and data: the same for the profile and the training run."""
    out = [
        f"model={args.model}",
        "data=synthetic",
        f"data.batch_size={args.batch_size}",
        "data.zipf_exponents=[1.1]",
    ]
    if args.smoke:
        sizes = ",".join(str(n) for n in smoke_sizes())
        out.append(f"model.num_embeddings_per_feature=[{sizes}]")
    return out


def profile_command(args: argparse.Namespace, out: Path) -> list[str]:
    """Profiles the first ``--profile-batches`` batches of the data stream (SHARDS hit-rate
    curves): what the planner sizes caches from and the hot rows it pins."""
    return [
        sys.executable,
        "-m",
        "apps.dlrm.profile",
        "--out",
        str(out),
        "--max-batches",
        str(args.profile_batches),
        "--method",
        "shards",
        *data_overrides(args),
    ]


def app_command(args: argparse.Namespace, run_dir: Path, profile: Path | None) -> list[str]:
    """The app's command line: every choice explicit, so app defaults do not move the run."""
    overrides = [
        *data_overrides(args),
        f"run.dir={run_dir}",
        f"run.steps={args.steps}",
        f"run.eval_batches={args.eval_batches}",
        f"run.log_every={max(1, args.steps // 10)}",
        "run.progress=false",
        f"run.num_threads={args.threads}",
        "hardware=local",
        "hardware.byte_scm=null",  # a mapped byte tier would sit in the capped page cache
        "planner=tiered",
        f"planner.dram_budget={args.dram_budget}",
        f"pipeline.lookahead={args.lookahead}",
    ]
    if profile is not None:
        overrides.append(f"planner.profile={profile}")
    if args.smoke:
        overrides.append("planner.min_cache_rows=64")
        overrides.append("hardware.block_scm.max_pass_bytes=65536")  # a 1 MiB DRAM budget
    return [sys.executable, "-m", "apps.dlrm.train", *overrides, *args.override]


def reference_command(args: argparse.Namespace, run_dir: Path, profile: Path | None) -> list[str]:
    """A: the same run with every table on TorchRec's FUSED kernel in DRAM (a DRAM budget
    larger than the tables), uncapped, over the same steps: its first losses are what the
    tiered run must train to, its throughput the same-run baseline. No evaluation and no
    checkpoint (its process holds every table in memory: the machine needs their size free)."""
    cmd = app_command(args, run_dir, profile)
    return [
        *cmd,
        f"run.steps={args.steps}",
        "run.eval_batches=0",
        "run.final_checkpoint=false",
        "planner.dram_budget=1TiB",
    ]


def uvm_command(args: argparse.Namespace, run_dir: Path) -> list[str]:
    """U: the same model, data and steps through the app with the tables past the DRAM
    budget on TorchRec's FUSED_UVM_CACHING at ``--uvm-cache-load-factor`` (the plain loop:
    TorchRec's kernel fills its own cache), no evaluation and no checkpoint."""
    overrides = [
        *data_overrides(args),
        f"run.dir={run_dir}",
        f"run.steps={args.steps}",
        "run.eval_batches=0",
        "run.final_checkpoint=false",
        "run.progress=false",
        f"run.num_threads={args.threads}",
        "hardware=local",
        "planner=size_rule",
        f"planner.dram_budget={args.dram_budget}",
        "planner.large_tables=uvm_caching",
        f"planner.cache_load_factor={args.uvm_cache_load_factor}",
        "pipeline.lookahead=0",
    ]
    return [sys.executable, "-m", "apps.dlrm.train", *overrides, *args.override]


def on_cuda(args: argparse.Namespace) -> bool:
    return any(o.replace(" ", "") == "run.device=cuda" for o in args.override)


def run_uvm(
    args: argparse.Namespace, work: Path, cap: int | None, support: CgroupSupport
) -> dict[str, Any]:
    """Runs U under ``cap``: its exit, OOM kills and peaks (:func:`run_capped`), its last
    error line, and what it trained if it got that far."""
    cmd = uvm_command(args, work / "uvm")
    print("$ python " + " ".join(cmd[1:]), flush=True)
    log = work / "uvm.log"
    out = run_app(cmd, cap, log, support)
    out["command"] = " ".join(cmd[1:])
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    out["error"] = errors[-1] if errors else (lines[-1] if lines and out["returncode"] else None)
    metrics_path = work / "uvm" / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    out["trained_steps"] = metrics.get("steps", 0)
    out["samples_per_s"] = metrics.get("samples_per_s")
    if out["returncode"] != 0:
        out["log_tail"] = "\n".join(lines[-30:])
    return out


def check_losses(ours: list[float], reference: list[float]) -> str | None:
    """Why the tiered run is not what A trains (the first step whose loss differs), or None."""
    if not reference:
        return "A reported no losses"
    for step, (got, want) in enumerate(zip(ours, reference)):
        if got != want:
            return f"step {step}: loss {got!r}, A's {want!r}"
    if len(ours) < len(reference):
        return f"the tiered run trained {len(ours)} steps, A {len(reference)}"
    return None


def run_app(cmd: list[str], cap: int | None, log: Path, support: CgroupSupport) -> dict[str, Any]:
    """Runs the app's ``cmd`` as ``make train`` runs it (transparent huge pages for large
    tensors), capped at ``cap`` in a memory cgroup when ``support`` allows, output in ``log``."""
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1"}
    return run_capped(cmd, support, "w2_app", cap, log=log, env=env, cwd=REPO)


def summarize(result: dict[str, Any], metrics: dict[str, Any] | None) -> dict[str, Any]:
    cap = result["cap_bytes"]
    tables = result["table_bytes"]
    peak = result["app"].get("cgroup_peak_bytes") or result["app"].get("peak_rss_bytes")
    out: dict[str, Any] = {
        "tables_over_cap": tables / cap if cap else None,
        "tables_over_cap_target": TARGET_RATIO,
        "peak_rss_under_cap": (result["app"]["peak_rss_bytes"] <= cap) if cap else None,
        "peak_anon_under_cap": (result["app"].get("peak_anon_bytes", 0) <= cap) if cap else None,
        "cgroup_peak_under_cap": (peak <= cap) if cap and peak else None,
        "trained": bool(metrics),
    }
    if metrics:
        a_rate = (result.get("reference") or {}).get("samples_per_s")
        rate = metrics.get("samples_per_s")
        out.update(
            {
                "samples_per_s": rate,
                "A_samples_per_s": a_rate,
                "vs_A": rate / a_rate if rate and a_rate else None,
                "cache_hit_rate": metrics.get("cache_hit_rate"),
                "stall_share": metrics.get("stall_share"),
                "steps": metrics.get("steps"),
                "eval_auc": metrics.get("eval_auc"),
                "seconds": metrics.get("seconds"),
            }
        )
    return out


def print_summary(result: dict[str, Any]) -> None:
    s = result["summary"]
    app = result["app"]
    gib = 2**30
    print("\n=== W2 results ===")
    print(
        f"tables {result['table_bytes'] / gib:.2f} GiB (weights + row-wise state), cap "
        + (f"{result['cap_bytes'] / gib:.2f} GiB" if result["capped"] else "none")
        + (f" -> {s['tables_over_cap']:.2f}x the cap" if s["tables_over_cap"] else "")
    )
    print(
        f"peak anonymous memory {app.get('peak_anon_bytes', 0) / gib:.2f} GiB, "
        f"peak RSS {app.get('peak_rss_bytes', 0) / gib:.2f} GiB (with mapped tier-file pages), "
        "cgroup peak "
        + (f"{app['cgroup_peak_bytes'] / gib:.2f} GiB" if app.get("cgroup_peak_bytes") else "n/a")
        + f", exit {app['returncode']}"
        + (", OOM-killed" if app.get("oom_kills") else "")
    )
    if s["trained"]:
        print(f"first {result['losses_checked']} losses are A's (every table FUSED), bit for bit")
        secs = s.get("seconds") or {}
        print(
            f"throughput {s['samples_per_s']:,.0f} samples/s over {s['steps']} steps, cache hit "
            f"rate {s['cache_hit_rate']:.3f}, tier stall {s['stall_share'] or 0:.1%} of training"
        )
        if s.get("A_samples_per_s"):
            print(
                f"A (every table FUSED in DRAM, uncapped, same steps): "
                f"{s['A_samples_per_s']:,.0f} samples/s -> tiered / A {s['vs_A']:.2f}x"
            )
        print("time (s): " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items()))
        for name, t in sorted(result["metrics"]["tables"].items()):
            print(
                f"  {name:<10} hit {t['hit_rate']:.3f}  read {t['tier_bytes_read'] / 2**20:9.1f}"
                f" MiB  written {t['tier_bytes_written'] / 2**20:9.1f} MiB"
            )
    u = result.get("U") or {}
    what = "U (the same tables on TorchRec's FUSED_UVM_CACHING"
    if "not_run" in u:
        print(f"{what}): not run: {u['not_run']}")
    elif u:
        done = (
            f", trained {u['trained_steps']} steps at {u['samples_per_s']:,.0f} samples/s"
            if u.get("samples_per_s")
            else ", trained nothing"
        )
        print(
            f"{what}, same cap): exit {u['returncode']}"
            + (", OOM-killed" if u.get("oom_kills") else "")
            + done
            + (f"; {u['error']}" if u.get("error") else "")
        )
    print(f"load average {result['machine']['load_average']}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cap", default="4GiB", help="memory cap of the app process")
    parser.add_argument(
        "--dram-budget", default="2GiB", help="planner.dram_budget: DRAM for tables and caches"
    )
    parser.add_argument("--model", default="w2_large", help="model config (conf/model)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument(
        "--profile-batches",
        type=int,
        default=200,
        help="profile this many batches first (uncapped, offline) for the planner; 0 = none "
        "(the planner then assumes uniform access)",
    )
    parser.add_argument("--eval-batches", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--lookahead", type=int, default=2)
    parser.add_argument(
        "--uvm-cache-load-factor",
        type=float,
        default=0.15,
        help="U's cache (CUDA only): TorchRec's FUSED_UVM_CACHING load factor",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--no-cap", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the run directory")
    parser.add_argument("--smoke", action="store_true", help="tiny tables, a few steps")
    parser.add_argument(
        "override", nargs="*", help="extra Hydra overrides for the app, e.g. run.seed=1"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.eval_batches, args.batch_size = min(args.steps, 6), 2, 128
        args.profile_batches = min(args.profile_batches, 4)
        args.cap, args.dram_budget = "2GiB", "1MiB"
        args.lookahead = min(args.lookahead, 1)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    model = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{args.model}.yaml"))
    assert isinstance(model, dict)
    if args.smoke:
        model["num_embeddings_per_feature"] = smoke_sizes()
    tables = table_bytes(model)
    cap = parse_size(args.cap)
    support = cgroup_support()
    capped = support.ok and not args.no_cap
    if not capped:
        reason = "--no-cap given" if args.no_cap else support.reason
        print(f"memory cap skipped: {reason}; the app runs without a cap", flush=True)
    elif tables < TARGET_RATIO * cap and not args.smoke:
        print(
            f"note: tables ({tables / 2**30:.2f} GiB) are less than {TARGET_RATIO:g}x the cap "
            f"({cap / 2**30:.2f} GiB)",
            flush=True,
        )
    args.dir.mkdir(parents=True, exist_ok=True)
    need = 2.2 * tables  # tier files + the final checkpoint
    free = disk_free_bytes(args.dir)
    print(
        f"W2: {args.model}, {tables / 2**30:.2f} GiB of tables; {free / 2**30:.1f} GiB free in "
        f"{args.dir} (needs ~{need / 2**30:.1f} GiB: tier files + final checkpoint)",
        flush=True,
    )
    if free < need:
        raise SystemExit(f"not enough free disk in {args.dir}: use --dir or a smaller model")
    work = Path(tempfile.mkdtemp(prefix="w2_bench_", dir=args.dir))
    run_dir = work / "run"
    result: dict[str, Any] = {
        "model": args.model,
        "table_bytes": tables,
        "num_rows": sum(int(n) for n in model["num_embeddings_per_feature"]),
        "cap_bytes": cap if capped else None,
        "capped": capped,
        "cap_skipped_reason": None if capped else ("--no-cap" if args.no_cap else support.reason),
        "args": {k: str(v) for k, v in vars(args).items()},
        "machine_start_load": list(os.getloadavg()),
    }
    try:
        profile: Path | None = None
        if args.profile_batches > 0:
            t0 = time.perf_counter()
            pcmd = profile_command(args, work / "profile")
            print("$ python " + " ".join(pcmd[1:]), flush=True)
            subprocess.run(pcmd, cwd=REPO, check=True, capture_output=True, text=True)
            profile = work / "profile.json"
            result["profile_s"] = time.perf_counter() - t0
            result["profile_command"] = " ".join(pcmd[1:])
        # A first: every table FUSED in DRAM, uncapped, from the same seed and batches.
        ref_cmd = reference_command(args, work / "reference", profile)
        print("$ python " + " ".join(ref_cmd[1:]), flush=True)
        ref = subprocess.run(ref_cmd, cwd=REPO, capture_output=True, text=True, check=False)
        ref_metrics_path = work / "reference" / "metrics.json"
        if ref.returncode != 0 or not ref_metrics_path.exists():
            raise SystemExit(f"A (every table FUSED) failed:\n{(ref.stdout + ref.stderr)[-3000:]}")
        ref_metrics = json.loads(ref_metrics_path.read_text())
        result["reference"] = {
            "command": " ".join(ref_cmd[1:]),
            "first_losses": ref_metrics["train_losses_first"],
            "samples_per_s": ref_metrics["samples_per_s"],
            "steps": ref_metrics["steps"],
            "plan": (work / "reference" / "plan.txt").read_text(),
        }
        shutil.rmtree(work / "reference", ignore_errors=True)
        cmd = app_command(args, run_dir, profile)
        result["command"] = " ".join(cmd[1:])
        print("$ python " + result["command"], flush=True)
        log = work / "app.log"
        result["app"] = run_app(cmd, cap if capped else None, log, support)
        text = log.read_text(errors="replace")
        metrics_path = run_dir / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else None
        if metrics is not None:
            mismatch = check_losses(
                metrics["train_losses_first"], result["reference"]["first_losses"]
            )
            if mismatch is not None:
                raise SystemExit(
                    f"W2 stopped: the tiered run does not train what A trains from the same "
                    f"weights and batches ({mismatch}); no figure of it is reported"
                )
            result["losses_checked"] = len(result["reference"]["first_losses"])
        result["metrics"] = metrics
        plan = run_dir / "plan.txt"
        result["plan"] = plan.read_text() if plan.exists() else None
        print(text[-6000:], flush=True)  # its figures, once its losses are checked
        if result["app"]["returncode"] != 0:
            result["app"]["log_tail"] = text[-3000:]
        if on_cuda(args):
            result["U"] = run_uvm(args, work, cap if capped else None, support)
        else:
            result["U"] = {
                "not_run": "TorchRec's FUSED_UVM_CACHING (fbgemm's UVM) runs on CUDA only: "
                "give run.device=cuda"
            }
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    result["machine"] = machine_info()
    result["summary"] = summarize(result, metrics)
    print_summary(result)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main(sys.argv[1:])
