"""Incremental against full checkpoints on W2, and a resume that rebuilds every tier from them.

One W2 run (``w2_bench.py``: 12.2 GiB of tables on the block tier in its default log layout, 4 GiB
memory cap) trains ``2 x --every`` steps with a checkpoint every ``--every`` steps: the first is a
full copy of every table (the log-structured ones streamed from their logs), the second holds
only the rows changed over the ``--every`` steps since: of tiered tables, and of the FUSED tables
their kernels compute (plus every other tensor). Both are timed and sized in the same run. A
second run with the block tier's flat layout (``hardware.block_scm.layout=flat``) times the same
full checkpoint, the baseline the default layout must not be slower than.

Then exactness at that scale: the rows of every tier file (weights and optimizer state) are
digested, the files deleted, and the run is resumed from its newest checkpoint, which loads the
chain (the full checkpoint, then the increment) and rebuilds every tier file; the rebuilt files
must hold the same rows, file by file (a log's bytes depend on the order rows were written).

Example::

    python benchmarks/checkpoint_bench.py --out results/checkpoint_w2.json    # ~10 min here
    python benchmarks/checkpoint_bench.py --smoke --out /tmp/ckpt_smoke.json  # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from torchrec_mtrains.benchmark.measure import machine_info, write_json
from torchrec_mtrains.benchmark.memory_cap import cgroup_support, run_capped
from torchrec_mtrains.benchmark.tier_files import row_digests
from torchrec_mtrains.planner import parse_size

W2_BENCH = Path(__file__).resolve().with_name("w2_bench.py")
CHANGED = re.compile(r"checkpoint \S+/(step_\d+): rows changed since \S+ \(([\d,]+) on rank 0\)")


def run_w2(args: list[str]) -> dict[str, Any]:
    """``w2_bench.py`` with ``args`` in its own process (its output shown as it runs); its
    result, read back from the JSON it wrote at ``--out``."""
    out = Path(args[args.index("--out") + 1])
    done = subprocess.run([sys.executable, str(W2_BENCH), *args], check=False)
    if not out.exists():
        raise SystemExit(f"w2_bench.py failed (exit {done.returncode}) before writing {out}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every", type=int, default=300, help="steps between checkpoints")
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--smoke", action="store_true", help="tiny tables, a few steps")
    args = parser.parse_args(argv)
    every = min(args.every, 3) if args.smoke else args.every
    train_overrides = [
        f"run.checkpoint_every={every}",
        "run.final_checkpoint=false",  # the checkpoint at the last step is the increment
        "run.full_checkpoint_every=4",
        "run.eval_batches=0",
    ]
    w2_args = [
        "--out",
        str(args.out.with_suffix(".w2.json")),
        "--steps",
        str(2 * every),
        "--dir",
        str(args.dir),
        "--keep",
        *(["--smoke"] if args.smoke else []),
        *train_overrides,
    ]
    trained = run_w2(w2_args)
    metrics = trained["metrics"]
    if trained["app"]["returncode"] != 0 or metrics is None:
        raise SystemExit("the W2 run failed: see its log above")
    run_dir = Path(metrics["run_dir"])
    work = run_dir.parent
    log = (work / "app.log").read_text(errors="replace")
    changed = {name: int(rows.replace(",", "")) for name, rows in CHANGED.findall(log)}
    full, incremental = metrics["checkpoints_saved"]
    assert full["parent"] is None and incremental["parent"] is not None, metrics
    result: dict[str, Any] = {
        "w2": {k: trained[k] for k in ("model", "table_bytes", "num_rows", "cap_bytes")},
        "command": trained["command"],
        "steps_between": every,
        "full": full,
        "incremental": {
            **incremental,
            "changed_rows": changed.get(f"step_{incremental['step']:08d}"),
        },
        "bytes_ratio_full_over_incremental": full["bytes"] / incremental["bytes"],
        "seconds_ratio_full_over_incremental": full["seconds"] / incremental["seconds"],
        "train_samples_per_s": metrics["samples_per_s"],
    }
    try:
        # Exactness: every tier file rebuilt from the chain (full + increment) is the same.
        tiers = run_dir / "tiers"
        before = row_digests(tiers)
        for path in tiers.rglob("*.rows"):
            path.unlink()
        resume = [*trained["command"].split(), "run.resume=true"]
        cmd = [sys.executable, *resume]
        print("$ python " + " ".join(cmd[1:]), flush=True)
        support = cgroup_support()
        cap = parse_size("2GiB" if args.smoke else "4GiB")
        resumed = run_capped(
            cmd,
            support,
            "w2_resume",
            cap if support.ok else None,
            log=work / "resume.log",
            env={**os.environ, "THP_MEM_ALLOC_ENABLE": "1"},
            cwd=W2_BENCH.parents[1],
        )
        resume_log = (work / "resume.log").read_text(errors="replace")
        print(resume_log[-3000:], flush=True)
        after = row_digests(tiers)
        same = sum(1 for k, v in before.items() if after.get(k) == v)
        result["resume"] = {
            "returncode": resumed["returncode"],
            "wall_s": resumed["wall_s"],
            "cgroup_peak_bytes": resumed.get("cgroup_peak_bytes"),
            "restore_s": json.loads((run_dir / "metrics.json").read_text())["seconds"].get(
                "restore"
            ),
            "tier_files": len(before),
            "tier_files_identical": same,
            "exact": same == len(before) and after.keys() == before.keys(),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)  # disk for the baseline's run
    # The baseline: the same full checkpoint with the block tier's flat layout.
    flat_args = [
        "--out",
        str(args.out.with_suffix(".flat.w2.json")),
        "--steps",
        str(every),
        "--dir",
        str(args.dir),
        *(["--smoke"] if args.smoke else []),
        *train_overrides,
        "hardware.block_scm.layout=flat",
    ]
    flat = run_w2(flat_args)
    if flat["app"]["returncode"] != 0 or flat["metrics"] is None:
        raise SystemExit("the W2 run with the flat layout failed: see its log above")
    (flat_full,) = flat["metrics"]["checkpoints_saved"]
    result["flat_full"] = flat_full
    result["full_seconds_default_over_flat"] = full["seconds"] / flat_full["seconds"]
    result["machine"] = machine_info()
    print_summary(result)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


def print_summary(result: dict[str, Any]) -> None:
    full, inc = result["full"], result["incremental"]
    print(f"\n=== checkpoints of W2 ({result['w2']['table_bytes'] / 2**30:.1f} GiB of tables) ===")
    print(
        f"full (step {full['step']}):         {full['bytes'] / 1e9:8.3f} GB  {full['seconds']:7.1f} s"
    )
    rows = inc.get("changed_rows")
    print(
        f"incremental (step {inc['step']}):  {inc['bytes'] / 1e9:8.3f} GB  {inc['seconds']:7.1f} s"
        f"  ({rows:,} changed rows over {result['steps_between']} steps)"
        if rows is not None
        else ""
    )
    print(
        f"full / incremental: {result['bytes_ratio_full_over_incremental']:.1f}x bytes, "
        f"{result['seconds_ratio_full_over_incremental']:.1f}x time"
    )
    flat = result.get("flat_full")
    if flat:
        print(
            f"full with the flat layout (same steps): {flat['bytes'] / 1e9:8.3f} GB  "
            f"{flat['seconds']:7.1f} s -> default / flat "
            f"{result['full_seconds_default_over_flat']:.2f}x time"
        )
    resume = result.get("resume")
    if resume:
        print(
            f"resume from the chain, tier files deleted: exit {resume['returncode']}, restore "
            f"{resume['restore_s']} s, {resume['tier_files_identical']}/{resume['tier_files']} "
            f"tier files rebuilt with the same rows -> {'EXACT' if resume['exact'] else 'DIFFERENT'}"
        )


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main(sys.argv[1:])
