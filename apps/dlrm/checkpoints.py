"""Checkpoints of a run: where they go, which one to resume from, the plan they were taken
with, and the tier files a run directory holds.

A run directory is always either resumable or restartable: a run that stopped before its first
finished checkpoint starts over in place (its tier files and unfinished checkpoints go), a
damaged latest checkpoint gives way to the previous finished one, and a missing tier file is
rebuilt from the checkpoint, which holds every row. Checkpoints hold copies of the rows, so
their files are private (0600, directories 0700) whatever the umask, as the tier files are.

The checkpoints are the links of the library's chain in ``run.dir/checkpoints``
(:class:`torchrec_mtrains.checkpoint.CheckpointManager`): full, or incremental (the rows of
tiered tables that training changed since the checkpoint before it, its parent, named in its
``DONE`` record; every other tensor whole), every ``run.full_checkpoint_every``-th full. This
module decides where a run starts, records the data position with each checkpoint and words
the library's errors with what to pass on the command line.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from apps.dlrm.errors import CheckpointError, ConfigError, RunDirError
from apps.dlrm.plan_record import recorded_files
from apps.dlrm.run_files import PLAN_FILE, tier_files
from torchrec_mtrains.checkpoint import (
    DONE_FILE,
    CheckpointDirectory,
    CheckpointManager,
    CheckpointWriteError,
    Link,
    NoLoadableLinkError,
    on_rank0,
    read_link,
)
from torchrec_mtrains.checkpoint import CheckpointError as LinkError
from torchrec_mtrains.planner import HostTopology

logger: logging.Logger = logging.getLogger(__name__)

# What a run that stopped early leaves besides tier files and checkpoints; a run starting over
# in place removes them so its history starts at step 0.
_RUN_OUTPUTS = ("history.jsonl", "metrics.json", "tensorboard")


class Position(NamedTuple):
    """Where training stands in the data: the epoch and the next batch (per rank) in it."""

    epoch: int
    batch: int


# ------------------------------------------------------------------------------ checkpoints


def checkpoints_of(run_dir: Path) -> CheckpointDirectory:
    """The run's chain of checkpoints, in ``run_dir/checkpoints``."""
    return CheckpointDirectory(run_dir / "checkpoints")


def finished_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoints with a ``DONE`` marker, newest first, as ``(step, path)``."""
    return checkpoints_of(run_dir).finished()


def last_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = finished_checkpoints(run_dir)
    return found[0] if found else None


def how_to_continue(run_dir: Path) -> str:
    """What a rerun of this run directory does, for error messages."""
    last = last_checkpoint(run_dir)
    if last is None:
        return (
            f"run.dir={run_dir} holds no finished checkpoint: the same command starts over in "
            "place once the cause is fixed"
        )
    return (
        f"the last finished checkpoint is {last[1]} (step {last[0]}): continue from it with "
        "run.resume=true once the cause is fixed"
    )


def save_checkpoint(
    manager: CheckpointManager, run_dir: Path, step: int, position: Position, full: bool = False
) -> Link:
    """Saves the checkpoint of ``step`` (incremental on the last saved or loaded one when due,
    see :meth:`CheckpointManager.save`), its ``DONE`` record holding the data ``position`` a
    resumed run continues from.

    Raises:
        CheckpointError: naming the checkpoint directory and the cause (a full disk said as
            such, with where to make room) when the save fails, and how a rerun carries on;
            the unfinished checkpoint is removed.
    """
    try:
        return manager.save(step, extra=position._asdict(), full=full)
    except CheckpointWriteError as e:
        cause = e.reason
        if e.disk_full:
            cause += "; free space there or pass run.dir=<a directory on a larger disk>"
        raise CheckpointError(
            f"checkpoint {e.path} could not be written: {cause}. The unfinished checkpoint was "
            f"removed; {how_to_continue(run_dir)}."
        ) from None
    except LinkError as e:
        raise CheckpointError(str(e)) from None


def checkpoint_position(path: Path) -> Position:
    """The data position a checkpoint was taken at. A ``DONE`` holding only the step (written
    before epochs existed) means that many batches into the first epoch."""
    try:
        extra = read_link(path).extra
        if not extra:
            return Position(0, read_link(path).step)
        return Position(int(extra["epoch"]), int(extra["batch"]))
    except (LinkError, KeyError, TypeError, ValueError) as e:
        cause = e.reason if isinstance(e, LinkError) else repr(e)
        raise CheckpointError(
            f"{path / DONE_FILE} does not say where the checkpoint stands ({cause}): delete "
            "that checkpoint to resume from an earlier one"
        ) from None


def load_newest(manager: CheckpointManager) -> Link:
    """Loads the newest finished checkpoint that loads, falling back (and saying so) past
    damaged ones (:meth:`CheckpointManager.restore`).

    Raises:
        CheckpointError: when none loads, naming each and why.
    """
    try:
        loaded = manager.restore()
    except NoLoadableLinkError as e:
        raise CheckpointError(
            f"{e}. Start a new run.dir, or drop run.resume to start this one over"
        ) from None
    if loaded is None:
        raise CheckpointError(
            f"{manager.directory.root} holds no finished checkpoint any more: start a new "
            "run.dir, or drop run.resume to start this one over"
        )
    return loaded


# ---------------------------------------------------------------------------- the run's start


def resume_candidates(
    resume: bool, hardware: HostTopology, run_dir: Path, rank: int, world: int
) -> list[Link]:
    """The finished checkpoints to resume from, newest first (checked ones that look
    complete; damaged ones are set aside, saying so), or none for a run that starts (over).
    ``resume`` is ``run.resume``; ``hardware`` says where the tier files are.

    A run directory whose earlier run stopped before its first finished checkpoint starts
    over in place, with or without ``run.resume`` (saying so): its unfinished checkpoints and
    outputs go, and :func:`start_over` removes each rank's tier files.

    Raises:
        RunDirError: ``run.resume=true`` on a directory that never held a run, a new run on
            a directory holding a finished checkpoint, or a run that finished without one.
        CheckpointError: ``run.resume=true`` where every finished checkpoint is damaged.
    """
    leftovers = bool(tier_files(hardware, run_dir, rank))
    if world > 1:
        flags: list[object] = [None] * world
        dist.all_gather_object(flags, leftovers)
        leftovers = any(bool(f) for f in flags)
    return on_rank0(lambda: _decide_start(resume, run_dir, leftovers), (ConfigError,))


def _decide_start(resume: bool, run_dir: Path, tier_leftovers: bool) -> list[Link]:
    directory = checkpoints_of(run_dir)
    finished = directory.finished()
    if not resume and finished:
        raise RunDirError(
            f"run.dir={run_dir} already holds a run with a finished checkpoint "
            f"({finished[0][1]}): pass run.resume=true to continue it, or choose a new run.dir."
        )
    unfinished = directory.unfinished()
    usable = directory.loadable()  # the damaged ones are set aside, saying so
    if finished and not usable:
        raise CheckpointError(
            f"every finished checkpoint in {run_dir}/checkpoints is damaged (each was moved "
            "aside as damaged_step_*, see the warnings): drop run.resume to start this run "
            "over in place, or start a new run.dir."
        )
    if usable:
        directory.remove_unfinished()
        return usable
    started = tier_leftovers or bool(unfinished) or (run_dir / PLAN_FILE).exists()
    damaged = any((run_dir / "checkpoints").glob("damaged*_step_*"))
    if started and (run_dir / "metrics.json").exists() and not damaged:
        # It ran to the end without keeping a checkpoint: its tier files hold its trained rows.
        raise RunDirError(
            f"run.dir={run_dir} holds a run that finished without a checkpoint "
            "(run.final_checkpoint=false): its tier files hold the only copy of its trained "
            "rows, so it is not started over. Choose a new run.dir, or delete this one first."
        )
    if resume and not started:
        raise RunDirError(
            f"run.resume=true but {run_dir}/checkpoints holds no finished checkpoint and "
            "run.dir holds no earlier run: point run.dir at an earlier run's directory, or drop "
            "run.resume."
        )
    if started:
        for path in unfinished:
            shutil.rmtree(path, ignore_errors=True)
        for name in _RUN_OUTPUTS:
            target = run_dir / name
            if target.is_dir():
                shutil.rmtree(target, ignore_errors=True)
            else:
                target.unlink(missing_ok=True)
        logger.warning(
            "run.dir=%s holds no finished checkpoint (its run stopped before one was saved): "
            "starting over in place from step 0%s",
            run_dir,
            f", removing {len(unfinished)} unfinished checkpoint(s)" if unfinished else "",
        )
    return []


def start_over(hardware: HostTopology, run_dir: Path, rank: int) -> int:
    """Removes this rank's tier files left by a run of ``run_dir`` that stopped before its
    first finished checkpoint; returns how many. Files this run directory did not make (a
    shared ``hardware.tier_root`` or ``hardware.dirs``) are never touched.

    Raises:
        RunDirError: when such foreign files are in the way, naming them.
    """
    files = list(tier_files(hardware, run_dir, rank))
    if not files:
        return 0
    recorded = set(recorded_files(run_dir).get(str(rank), []))
    inside = run_dir.resolve()
    ours = [p for p in files if p in recorded or Path(p).resolve().is_relative_to(inside)]
    foreign = sorted(set(files) - set(ours))
    if foreign:
        raise RunDirError(
            f"tier files {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} are in "
            f"this run's tier directories but were not made by run.dir={run_dir} (is "
            "hardware.tier_root or hardware.dirs shared with another run?): delete them, or "
            "point hardware.tier_root / hardware.dirs elsewhere."
        )
    for path in ours:
        Path(path).unlink(missing_ok=True)
    logger.warning("rank %d: removed %d tier file(s) of the run that stopped", rank, len(ours))
    return len(ours)
