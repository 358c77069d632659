"""Fault injection: SIGKILL the DLRM app at random moments, resume, and compare bitwise.

An uninterrupted reference run of ``python -m apps.dlrm.train`` (the tests' tiny model: six of
its 26 tables on the byte and block SCM tiers) is timed. Each trial then starts the same run in a
fresh run directory, kills its whole process group with SIGKILL at a random moment (uniform over
the reference's duration, so kills land in start-up, training, checkpoint writes, evaluation and
the final checkpoint; some trials instead kill as soon as a chosen checkpoint is being written),
sometimes kills the rerun too, and reruns until the app completes: with ``run.resume=true``
when a finished checkpoint exists, else as before (the app starts over in place). The final
checkpoint must equal the reference's bitwise, every tensor (weights of every table, dense
parameters, optimizer state), and so must the loss of every step (``history.jsonl``, the last
line of a step wins after a resume) and the evaluation's AUC and NE. Trials alternate between
the look-ahead pipeline (``pipeline.lookahead=2``) and the plain loop (0).

Example::

    python benchmarks/fault_injection.py --trials 20 --seed 0 --out results/fault_injection.json

Exits 1 when any trial's result differs from the reference or a trial could not finish.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

REPO = Path(__file__).resolve().parents[1]

# tests/apps/dlrm/dlrm_helpers.py's tiny model (SIZES, TINY_TABLES), as command-line overrides.
SIZES = [4000, 2000] + [100] * 20 + [4000, 2000, 4000, 2000]
STEPS = 100
CHECKPOINT_EVERY = (
    12  # saves at 12, 24, ..., 96 while training; the final one (100) just before eval
)
LOOKAHEADS = (2, 0)
MAX_RUNS = 6  # app runs per trial before it counts as an error
RUN_TIMEOUT_S = 300.0


def app_overrides(
    lookahead: int, steps: int = STEPS, checkpoint_every: int = CHECKPOINT_EVERY
) -> list[str]:
    """The Hydra overrides of every run: the tiny tiered model, short, one loss per step."""
    return [
        f"model.num_embeddings_per_feature=[{','.join(map(str, SIZES))}]",
        "planner=size_rule",
        "planner.dram_budget=200KB",
        "planner.block_scm_min_bytes=200KB",
        "planner.cache_load_factor=0.25",
        "data.batch_size=64",
        "run.eval_batches=2",
        "run.progress=false",
        "run.tensorboard=false",
        "run.log_every=1",
        f"run.checkpoint_every={checkpoint_every}",
        f"run.steps={steps}",
        "run.num_threads=1",
        f"pipeline.lookahead={lookahead}",
    ]


# ------------------------------------------------------------------------------ one app run


@dataclass
class AppRun:
    """One start of the app: how it ended and, when killed, where it was."""

    resume: bool
    rc: int | None  # None: killed by us
    seconds: float
    kill_at_s: float | None = None
    trigger: str | None = None  # the event that fired the kill, for triggered kills
    last_line: str = ""
    phase: str = ""
    resumed_from: int | None = None


Trigger = Callable[[Path], bool]
RESUMED_AT = re.compile(r"resumed from \S+ at step (\d+)")


def _checkpoint_being_written(step: int) -> Trigger:
    """Fires once the checkpoint of ``step`` exists without its DONE marker (dcp.save running)."""
    name = f"step_{step:08d}"

    def fired(run_dir: Path) -> bool:
        path = run_dir / "checkpoints" / name
        return path.is_dir() and not (path / "DONE").exists()

    return fired


def _last_line(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1].strip()[:100] if lines else ""


def _history(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "history.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut by the kill
            continue
    return out


def _phase(run_dir: Path, log: Path, started_wall: float, start_step: int, steps: int) -> str:
    """Where a killed run was, from what it left: a checkpoint without DONE (dcp.save), the
    history lines this run wrote (training), the output (start-up, build, restore)."""
    for path in sorted((run_dir / "checkpoints").glob("step_*"), reverse=True):
        if not (path / "DONE").exists() and path.stat().st_mtime >= started_wall - 0.5:
            step = int(path.name.split("_")[1])
            return (
                f"final checkpoint write ({step})"
                if step == steps
                else f"checkpoint write ({step})"
            )
    if (run_dir / "metrics.json").exists() and (
        run_dir / "metrics.json"
    ).stat().st_mtime >= started_wall:
        return "summary / exit"
    ours = [h for h in _history(run_dir) if h.get("time", 0) >= started_wall]
    if ours:
        step = int(ours[-1]["step"])
        if step >= steps:
            done = run_dir / "checkpoints" / f"step_{steps:08d}" / "DONE"
            # The final checkpoint is written right after the last step, then evaluation runs.
            return "eval" if done.exists() else "before the final checkpoint"
        if (run_dir / "checkpoints" / f"step_{step:08d}" / "DONE").exists():
            return f"training (after checkpoint {step})"
        return f"training (step {step})"
    text = log.read_text(errors="replace")
    if "Sharding plan" in text:
        return f"training (before step {start_step + 1})" if start_step < steps else "eval"
    if "resumed from" in text:
        return "restore"
    if (run_dir / "plan.json").exists() and (run_dir / "plan.json").stat().st_mtime >= started_wall:
        return "build (tier files)"
    return "start-up (imports, config, plan)"


def finished_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    """The newest checkpoint with a DONE marker, as ``(step, path)``."""
    found = []
    for done in (run_dir / "checkpoints").glob("step_*/DONE"):
        found.append((int(done.parent.name.split("_")[1]), done.parent))
    return max(found) if found else None


def run_app(
    run_dir: Path,
    overrides: Sequence[str],
    *,
    resume: bool,
    log: Path,
    kill: Kill | None = None,
    steps: int = STEPS,
) -> AppRun:
    """Runs the app once in its own session (cwd: a scratch directory next to ``run_dir``),
    SIGKILLing its whole process group when ``kill`` says (None: it runs to its end)."""
    cwd = run_dir.parent / "cwd"
    cwd.mkdir(exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "apps.dlrm.train", f"run.dir={run_dir}", *overrides]
    if resume:
        cmd.append("run.resume=true")
    before = finished_checkpoint(run_dir)
    start_step = before[0] if resume and before is not None else 0
    started_wall = time.time()
    kill = kill or Kill()
    kill_at_s = kill.at_s
    trigger = kill.trigger(started_wall)
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        killed = False
        fired: str | None = None
        while proc.poll() is None:
            now = time.perf_counter() - t0
            hit = kill_at_s is not None and now >= kill_at_s
            if not hit and trigger is not None and trigger[1](run_dir):
                hit, fired = True, trigger[0]
            if hit:
                os.killpg(proc.pid, signal.SIGKILL)
                killed = True
                kill_at_s = now
                break
            if now > RUN_TIMEOUT_S:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                raise TimeoutError(f"the app ran past {RUN_TIMEOUT_S:.0f} s: see {log}")
            time.sleep(0.002)
        proc.wait()
    seconds = time.perf_counter() - t0
    run = AppRun(
        resume=resume,
        rc=None if killed else proc.returncode,
        seconds=seconds,
        kill_at_s=kill_at_s if killed else None,
        trigger=fired,
        last_line=_last_line(log),
    )
    if resume and before is not None:
        # the app's own word: it falls back past a damaged newest checkpoint
        said = RESUMED_AT.findall(log.read_text(errors="replace"))
        run.resumed_from = int(said[-1]) if said else start_step
    if killed:
        run.phase = _phase(run_dir, log, started_wall, start_step, steps)
    return run


# ------------------------------------------------------------------------------ comparison


def _leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _leaves(obj[key], f"{prefix}/{key}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _leaves(value, f"{prefix}/{i}")
    else:
        yield prefix, obj


def checkpoint_leaves(checkpoint: Path, scratch: Path) -> dict[str, Any]:
    """Every entry of a dcp checkpoint (tensors and plain values), by path; a log-structured
    table's rows (saved in batches in the log's order, which depends on the order they were
    written) as one tensor of ids and one of rows, in id order."""
    target = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, target)
    state = torch.load(target, weights_only=False)
    target.unlink()
    return _rows_by_id(dict(_leaves(state)))


_LOG_BATCH = re.compile(r"^(/tier_rows::.+::)(\d+)::(ids|rows)$")


def _rows_by_id(leaves: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tables: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key, value in leaves.items():
        found = _LOG_BATCH.match(key)
        if found is None:
            out[key] = value
            continue
        table, batch, part = found.group(1), int(found.group(2)), found.group(3)
        tables.setdefault(table, {}).setdefault(batch, {})[part] = value
    for table, batches in tables.items():
        ids = torch.cat([batches[b]["ids"] for b in sorted(batches)])
        rows = torch.cat([batches[b]["rows"] for b in sorted(batches)])
        order = torch.argsort(ids)
        out[f"{table}ids"], out[f"{table}rows"] = ids[order], rows[order]
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.is_floating_point():  # bitwise: -0.0 against 0.0 and NaN payloads count
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a, b)


def compare_leaves(ref: dict[str, Any], got: dict[str, Any]) -> tuple[int, list[str]]:
    """How many tensors were compared, and every difference (missing, extra, other bits)."""
    diffs = [f"missing {k}" for k in sorted(set(ref) - set(got))]
    diffs += [f"extra {k}" for k in sorted(set(got) - set(ref))]
    tensors = 0
    for key in sorted(set(ref) & set(got)):
        a, b = ref[key], got[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            tensors += 1
            if not _same_bits(a, b):
                diffs.append(f"tensor {key} differs")
        elif a != b:
            diffs.append(f"value {key}: {a!r} != {b!r}")
    return tensors, diffs


def step_losses(run_dir: Path) -> dict[int, float]:
    """Every step's loss from ``history.jsonl``, the last line of a step winning."""
    return {int(h["step"]): float(h["loss"]) for h in _history(run_dir)}


@dataclass
class Outcome:
    """What a finished run directory holds, to compare with the reference."""

    checkpoint: str
    done: dict[str, Any]
    losses: dict[int, float]
    eval_auc: float | None
    eval_ne: float | None
    leaves: dict[str, Any] = field(repr=False)

    @classmethod
    def of(cls, run_dir: Path, scratch: Path) -> Outcome:
        metrics = json.loads((run_dir / "metrics.json").read_text())
        checkpoint = Path(metrics["checkpoint"])
        return cls(
            checkpoint=str(checkpoint),
            done=json.loads((checkpoint / "DONE").read_text()),
            losses=step_losses(run_dir),
            eval_auc=metrics["eval_auc"],
            eval_ne=metrics["eval_ne"],
            leaves=checkpoint_leaves(checkpoint, scratch),
        )


def compare(ref: Outcome, got: Outcome) -> tuple[int, list[str]]:
    """Tensors compared and every difference of ``got`` from ``ref``."""
    tensors, diffs = compare_leaves(ref.leaves, got.leaves)
    if Path(ref.checkpoint).name != Path(got.checkpoint).name or ref.done != got.done:
        diffs.append(f"final checkpoint {got.checkpoint} {got.done} != {ref.done}")
    if ref.losses != got.losses:
        steps = sorted(
            s for s in set(ref.losses) | set(got.losses) if ref.losses.get(s) != got.losses.get(s)
        )
        diffs.append(f"train loss differs at steps {steps[:8]}{' ...' if len(steps) > 8 else ''}")
    if (ref.eval_auc, ref.eval_ne) != (got.eval_auc, got.eval_ne):
        diffs.append(f"eval AUC/NE {got.eval_auc}/{got.eval_ne} != {ref.eval_auc}/{ref.eval_ne}")
    return tensors, diffs


# ------------------------------------------------------------------------------ trials


@dataclass
class Reference:
    lookahead: int
    seconds: float
    outcome: Outcome


def reference_run(
    workdir: Path, lookahead: int, steps: int = STEPS, checkpoint_every: int = CHECKPOINT_EVERY
) -> Reference:
    """The uninterrupted run every trial of ``lookahead`` is compared with."""
    run_dir = workdir / f"reference_la{lookahead}" / "run"
    run_dir.parent.mkdir(parents=True)
    log = run_dir.parent / "app.log"
    run = run_app(
        run_dir,
        app_overrides(lookahead, steps, checkpoint_every),
        resume=False,
        log=log,
        steps=steps,
    )
    if run.rc != 0:
        raise RuntimeError(f"the reference run failed (exit {run.rc}): see {log}")
    return Reference(lookahead, run.seconds, Outcome.of(run_dir, workdir))


@dataclass
class Trial:
    number: int
    lookahead: int
    runs: list[AppRun]
    outcome: str = ""  # exact / mismatch / error
    tensors: int = 0
    differences: list[str] = field(default_factory=list)

    @property
    def kills(self) -> list[AppRun]:
        return [r for r in self.runs if r.rc is None]


@dataclass(frozen=True)
class Kill:
    """When one start of the app is killed: ``at_s`` seconds after it starts, as soon as the
    checkpoint of step ``checkpoint`` is being written, or once it reported step ``step``."""

    at_s: float | None = None
    checkpoint: int | None = None
    step: int | None = None

    def trigger(self, started_wall: float) -> tuple[str, Trigger] | None:
        if self.checkpoint is not None:
            return f"checkpoint {self.checkpoint} written", _checkpoint_being_written(
                self.checkpoint
            )
        if self.step is not None:
            return f"step {self.step} reported", _step_reported(self.step, started_wall)
        return None


def _step_reported(step: int, started_wall: float) -> Trigger:
    """Fires once this start of the app wrote the history line of ``step`` (or a later one)."""

    def fired(run_dir: Path) -> bool:
        return any(
            h.get("step", 0) >= step and h.get("time", 0) >= started_wall
            for h in _history(run_dir)[-3:]
        )

    return fired


def plan_kills(
    rng: random.Random, duration_s: float, steps: int, checkpoint_every: int
) -> tuple[Kill, ...]:
    """One kill (two in ~30% of trials) uniform over the reference's ``duration_s``. In ~30%
    of trials the first kill instead fires on an event, as those phases last milliseconds:
    a checkpoint being written (one while training, or the final one, written just before
    evaluation) or the last step reported (the final checkpoint and evaluation follow)."""
    second = (Kill(at_s=rng.uniform(0.0, duration_s)),) if rng.random() < 0.3 else ()
    if rng.random() < 0.3:
        saves = [*range(checkpoint_every, steps, checkpoint_every), steps]
        event = rng.choice([*(Kill(checkpoint=s) for s in saves), Kill(step=steps)])
        return (event, *second)
    return (Kill(at_s=rng.uniform(0.0, duration_s)), *second)


def run_trial(
    number: int,
    workdir: Path,
    ref: Reference,
    kills: Sequence[Kill],
    steps: int = STEPS,
    checkpoint_every: int = CHECKPOINT_EVERY,
    lookahead: int | None = None,
) -> Trial:
    """Starts a fresh run (``lookahead``: the reference's unless given), kills its starts as
    ``kills`` says, reruns until one completes, and compares the result with ``ref``."""
    base = workdir / f"trial_{number:03d}"
    run_dir = base / "run"
    base.mkdir(parents=True)
    lookahead = ref.lookahead if lookahead is None else lookahead
    overrides = app_overrides(lookahead, steps, checkpoint_every)
    trial = Trial(number, lookahead, [])
    for attempt in range(MAX_RUNS):
        kill = kills[attempt] if attempt < len(kills) else Kill()
        run = run_app(
            run_dir,
            overrides,
            resume=finished_checkpoint(run_dir) is not None,
            log=base / f"app{attempt}.log",
            kill=kill,
            steps=steps,
        )
        trial.runs.append(run)
        if run.rc is None:
            continue
        if run.rc != 0:
            trial.outcome = "error"
            trial.differences.append(f"run {attempt} exited {run.rc}: {run.last_line}")
            return trial
        break
    else:
        trial.outcome = "error"
        trial.differences.append(f"no run completed in {MAX_RUNS} starts")
        return trial
    try:
        got = Outcome.of(run_dir, base)
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        trial.outcome = "error"
        trial.differences.append(f"unreadable result: {type(e).__name__}: {e}")
        return trial
    trial.tensors, trial.differences = compare(ref.outcome, got)
    trial.outcome = "mismatch" if trial.differences else "exact"
    return trial


def _row(trial: Trial) -> str:
    kills = trial.kills
    times = ", ".join(
        f"{k.kill_at_s:.2f}" + ("*" if k.trigger else "") for k in kills if k.kill_at_s is not None
    )
    phases = "; ".join(k.phase for k in kills) or "(none landed: the run finished first)"
    # each rerun: the checkpoint step it resumed from, or "0" for a start over in place
    resumed_s = ", ".join(str(r.resumed_from or 0) for r in trial.runs[1:]) or "-"
    return (
        f"{trial.number:>5}  {trial.lookahead:>2}  {times:<14} {phases:<60} {resumed_s:<10} "
        f"{trial.outcome}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--checkpoint-every", type=int, default=CHECKPOINT_EVERY)
    parser.add_argument(
        "--dir", type=Path, default=None, help="work directory (default: a temp one)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)
    if args.trials < 1:
        parser.error(f"--trials={args.trials}: give at least 1")

    if args.dir is not None:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="fault_injection_", dir=args.dir))
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    try:
        refs = {}
        for lookahead in LOOKAHEADS:
            refs[lookahead] = reference_run(workdir, lookahead, args.steps, args.checkpoint_every)
            print(
                f"reference, look-ahead {lookahead}: {refs[lookahead].seconds:.2f} s, "
                f"{len(refs[lookahead].outcome.leaves)} checkpoint entries, "
                f"eval AUC {refs[lookahead].outcome.eval_auc}",
                flush=True,
            )
        _, cross = compare(refs[LOOKAHEADS[0]].outcome, refs[LOOKAHEADS[1]].outcome)
        print(
            f"references with look-ahead {LOOKAHEADS[0]} and {LOOKAHEADS[1]}: "
            f"{'bitwise equal' if not cross else 'DIFFER: ' + '; '.join(cross[:3])}",
            flush=True,
        )
        print(
            f"\n{'trial':>5}  la  {'kill at (s)':<14} {'phase at kill (from the log/run dir)':<60} "
            f"{'resumed':<10} outcome"
        )
        trials: list[Trial] = []
        for number in range(1, args.trials + 1):
            lookahead = LOOKAHEADS[(number - 1) % len(LOOKAHEADS)]
            # a little short of the reference's time, so that a slightly faster start is
            # still killed
            duration = 0.97 * refs[lookahead].seconds
            kills = plan_kills(rng, duration, args.steps, args.checkpoint_every)
            trial = run_trial(
                number, workdir, refs[lookahead], kills, args.steps, args.checkpoint_every
            )
            trials.append(trial)
            print(_row(trial), flush=True)
            for diff in trial.differences[:5]:
                print(f"         {diff}", flush=True)
            if not args.keep and trial.outcome == "exact":
                shutil.rmtree(workdir / f"trial_{number:03d}", ignore_errors=True)
        counts = {k: sum(t.outcome == k for t in trials) for k in ("exact", "mismatch", "error")}
        n_kills = sum(len(t.kills) for t in trials)
        resumes = sum(r.resumed_from is not None for t in trials for r in t.runs)
        restarts = sum(
            1 for t in trials for i, r in enumerate(t.runs) if i > 0 and r.resumed_from is None
        )
        elapsed = time.perf_counter() - t_start
        fired = sum(1 for t in trials for k in t.kills if k.trigger)
        by_phase: dict[str, int] = {}
        for t in trials:
            for k in t.kills:
                kind = k.phase.split(" (")[0]
                by_phase[kind] = by_phase.get(kind, 0) + 1
        print(
            f"\n{len(trials)} trials, {n_kills} kills ({fired} fired by an event, * above), "
            f"{resumes} resumes from a checkpoint, {restarts} starts over in place; "
            f"exact {counts['exact']}, mismatch {counts['mismatch']}, error {counts['error']} "
            f"({elapsed:.0f} s)"
        )
        print("kills by phase: " + ", ".join(f"{k} {n}" for k, n in sorted(by_phase.items())))
        if cross:
            print("look-ahead 2 and the plain loop do not train the same bits")
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            record = {
                "seed": args.seed,
                "steps": args.steps,
                "checkpoint_every": args.checkpoint_every,
                "overrides": app_overrides(LOOKAHEADS[0], args.steps, args.checkpoint_every),
                "reference_seconds": {str(k): r.seconds for k, r in refs.items()},
                "references_equal": not cross,
                "kills_by_phase": by_phase,
                "totals": {
                    "trials": len(trials),
                    "kills": n_kills,
                    "resumes": resumes,
                    "restarts": restarts,
                    **counts,
                },
                "seconds": elapsed,
                "trials": [{**asdict(t), "runs": [asdict(r) for r in t.runs]} for t in trials],
            }
            args.out.write_text(json.dumps(record, indent=1) + "\n")
        return 0 if counts["exact"] == len(trials) and not cross else 1
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
