"""Checkpoints of a run: where they go, which one to resume from, the plan they were taken
with, and the tier files a run directory holds.

A run directory is always either resumable or restartable: a run that stopped before its first
finished checkpoint starts over in place (its tier files and unfinished checkpoints go), a
damaged latest checkpoint gives way to the previous finished one, and a missing tier file is
rebuilt from the checkpoint, which holds every row. Checkpoints hold copies of the rows, so
their files are private (0600, directories 0700) whatever the umask, as the tier files are.

A checkpoint is full (every tensor) or incremental: the rows of tiered tables that training
changed since the checkpoint before it (its parent, named in its ``DONE`` record), every other
tensor whole. Loading an incremental one loads its chain: the full checkpoint it builds on,
then each increment in order (``torchrec_mtrains.distributed.incremental``).
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar, cast

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

from apps.dlrm.errors import CheckpointError, ConfigError, RunDirError
from apps.dlrm.plan_record import recorded_files
from apps.dlrm.run_files import (
    PLAN_FILE,
    PRIVATE_FILE,
    private_dir,
    tier_files,
    write_private,
)
from torchrec_mtrains.distributed.incremental import (
    changed_state_dict,
    clear_changes,
    deferred_views,
    full_state_dict,
    load_tier_checkpoint,
)
from torchrec_mtrains.pipeline.stats import tiered_groups
from torchrec_mtrains.planner import HostTopology

logger: logging.Logger = logging.getLogger(__name__)

DONE_FILE = "DONE"
# What a run that stopped early leaves besides tier files and checkpoints; a run starting over
# in place removes them so its history starts at step 0.
_RUN_OUTPUTS = ("history.jsonl", "metrics.json", "tensorboard")

_T = TypeVar("_T")


class Position(NamedTuple):
    """Where training stands in the data: the epoch and the next batch (per rank) in it."""

    epoch: int
    batch: int


# ---------------------------------------------------------------------------- private files


class _PrivateFileSystem(FileSystem):
    """dcp's local file system, creating files 0600 and directories 0700 whatever the umask:
    a checkpoint holds a full copy of every row."""

    @contextlib.contextmanager
    def create_stream(
        self, path: str | os.PathLike[str], mode: str
    ) -> Generator[io.IOBase, None, None]:
        if "r" in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE)
        os.fchmod(fd, PRIVATE_FILE)
        try:
            with os.fdopen(fd, mode) as stream:
                yield cast(io.IOBase, stream)
        except Exception as e:
            # torch.save turns a failed write into "unexpected pos ..."; the errno survives
            # only as that error's context, which dcp's gathering of errors drops.
            if _disk_full(e) and not isinstance(e, OSError):
                raise OSError(errno.ENOSPC, f"no space left on the device writing {path}") from e
            raise

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        private_dir(Path(path))


def _writer(path: Path) -> FileSystemWriter:
    # A file per tensor: dcp's writer keeps every tensor of a file referenced until the file is
    # closed, so one file per rank would hold all of a log-structured table's rows, gathered
    # batch by batch (see full_state_dict), in memory at once.
    writer = FileSystemWriter(path, single_file_per_rank=False)
    writer.fs = _PrivateFileSystem()
    return writer


# ------------------------------------------------------------------------------ checkpoints


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _step_of(path: Path) -> int | None:
    try:
        return int(path.name.split("_", 1)[1])
    except (IndexError, ValueError):
        return None


def finished_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoints with a ``DONE`` marker, newest first, as ``(step, path)``."""
    found = []
    for done in (run_dir / "checkpoints").glob(f"step_*/{DONE_FILE}"):
        step = _step_of(done.parent)
        if step is not None:
            found.append((step, done.parent))
    return sorted(found, reverse=True)


def last_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = finished_checkpoints(run_dir)
    return found[0] if found else None


def _parent_of(path: Path) -> str | None:
    """The name of the checkpoint ``path`` builds on (None for a full one)."""
    try:
        record = json.loads((path / DONE_FILE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path / DONE_FILE} is unreadable ({e!r}): delete that checkpoint to resume from an "
            "earlier one"
        ) from None
    parent = record.get("parent") if isinstance(record, dict) else None
    return str(parent) if parent else None


def checkpoint_chain(path: Path) -> list[Path]:
    """The checkpoints that together hold the state saved at ``path``, oldest first: ``path``
    alone when it is full, else the full checkpoint it builds on and every increment up to it.

    Raises:
        CheckpointError: a checkpoint of the chain is missing or unfinished, naming it.
    """
    chain = [path]
    while (parent := _parent_of(chain[-1])) is not None:
        base = path.parent / parent
        if not (base / DONE_FILE).is_file() or base in chain:
            raise CheckpointError(
                f"checkpoint {path} holds the rows changed since {base}, which is missing or "
                "unfinished: it cannot be loaded without it"
            )
        chain.append(base)
    return chain[::-1]


def next_parent(last: Path | None, full_every: int) -> Path | None:
    """What the next checkpoint builds on: ``last`` (the newest saved or loaded checkpoint),
    or None for a full checkpoint. Every ``full_every``-th checkpoint of a chain is full, so a
    resume loads at most ``full_every`` checkpoints; ``full_every=1`` makes every one full."""
    if last is None or full_every <= 1:
        return None
    try:
        return last if len(checkpoint_chain(last)) < full_every else None
    except CheckpointError:
        return None


def _unfinished_checkpoints(run_dir: Path) -> list[Path]:
    return sorted(
        p
        for p in (run_dir / "checkpoints").glob("step_*")
        if p.is_dir() and not (p / DONE_FILE).exists()
    )


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


def _disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps: causes, dcp's per-rank failures) is a full disk."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, CheckpointException):
            todo.extend(failure[0] for failure in e.failures.values())
        todo.extend(c for c in (e.__cause__, e.__context__) if c is not None)
    return False


def _first_line(error: BaseException) -> str:
    """The gist of an error: dcp's per-rank failures by their own message, else the first
    line of the message."""
    if isinstance(error, CheckpointException) and error.failures:
        rank, (cause, _) = min(error.failures.items())
        return f"rank {rank}: {_first_line(cause)}"
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def save_checkpoint(
    model: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    run_dir: Path,
    step: int,
    position: Position | None = None,
    keep: int | None = None,
    parent: Path | None = None,
) -> Path:
    """Saves model and optimizer with torch.distributed.checkpoint; tiered tables stream from
    their tiers chunk by chunk. With a ``parent`` checkpoint, tiered tables write only the rows
    changed since it (the model's tiered groups must track changes). A ``DONE`` file marks the
    checkpoint complete and records the data ``position`` a resumed run continues from
    (default: ``step`` batches into epoch 0) and the parent. Files are 0600 and directories
    0700 whatever the umask. Once it is complete, finished checkpoints beyond the newest
    ``keep`` are deleted (``None``: all are kept), except those a kept one builds on.

    Raises:
        CheckpointError: naming the checkpoint directory and the cause (a full disk said as
            such) when the save fails; the unfinished checkpoint is removed.
    """
    path = checkpoint_dir(run_dir, step)
    if dist.get_rank() == 0:
        private_dir(path.parent)
        if path.exists():  # an unfinished one from a run that stopped here: never mixed in
            shutil.rmtree(path)
    dist.barrier()
    groups = tiered_groups(model)
    changed_rows = None
    try:
        # Log-structured tables are read from their tiers, never exported to their views.
        with deferred_views(groups):
            state: dict[str, Any] = {"model": model.state_dict(), "optim": optimizer.state_dict()}
            if parent is not None:
                saved = changed_state_dict(state, groups)
                changed_rows = saved.rows
            else:
                saved = full_state_dict(state, groups)
            dcp_save(saved.state, storage_writer=_writer(path), planner=saved.planner)
    except (Exception, CheckpointException) as e:
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        if _disk_full(e) or _nearly_full(path.parent):
            cause = (
                f"the disk holding it ran out of space ({_free(path.parent)} free now); free space "
                "there or pass run.dir=<a directory on a larger disk>"
            )
        else:
            cause = f"{_first_line(e)}"
        raise CheckpointError(
            f"checkpoint {path} could not be written: {cause}. The unfinished checkpoint was "
            f"removed; {how_to_continue(run_dir)}."
        ) from None
    dist.barrier()
    clear_changes(groups)  # the tiers and this checkpoint now agree
    if dist.get_rank() == 0:
        epoch, batch = position or Position(0, step)
        record: dict[str, Any] = {"step": step, "epoch": epoch, "batch": batch}
        if parent is not None:
            record["parent"] = parent.name
        write_private(path / DONE_FILE, json.dumps(record))
        if keep is not None:
            _drop_old(run_dir, keep)
    dist.barrier()
    if dist.get_rank() == 0:
        logger.info(
            "checkpoint %s: %s, %.1f MB",
            path,
            "full"
            if parent is None
            else f"rows changed since {parent.name} ({changed_rows:,} on rank 0)",
            checkpoint_bytes(path) / 1e6,
        )
    return path


def checkpoint_bytes(path: Path) -> int:
    """The size of one checkpoint's files (not of the checkpoints it builds on)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def _drop_old(run_dir: Path, keep: int) -> None:
    """Deletes finished checkpoints beyond the newest ``keep``, except those a kept one builds
    on (an incremental checkpoint needs its whole chain)."""
    finished = finished_checkpoints(run_dir)
    needed: set[Path] = set()
    for _, path in finished[:keep]:
        try:
            needed.update(checkpoint_chain(path))
        except CheckpointError:
            needed.add(path)
    for _, path in finished[keep:]:
        if path not in needed:
            shutil.rmtree(path)


def _free(directory: Path) -> str:
    try:
        return f"{shutil.disk_usage(directory).free / 2**20:.1f} MiB"
    except OSError:
        return "unknown"


def _nearly_full(directory: Path) -> bool:
    """torch.save reports a failed write as a position mismatch ("unexpected pos"), losing
    the errno: a disk with under 1 MiB left is taken as the cause."""
    try:
        return shutil.disk_usage(directory).free < 2**20
    except OSError:
        return False


def checkpoint_position(path: Path) -> Position:
    """The data position a checkpoint was taken at. A ``DONE`` holding only the step (written
    before epochs existed) means that many batches into the first epoch."""
    done = path / DONE_FILE
    try:
        record = json.loads(done.read_text())
        if isinstance(record, int):
            return Position(0, record)
        return Position(int(record["epoch"]), int(record["batch"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{done} does not say where the checkpoint stands ({e!r}): delete that checkpoint "
            "to resume from an earlier one"
        ) from None


def checkpoint_problem(path: Path) -> str | None:
    """Why the checkpoint at ``path`` cannot be loaded, found without loading it (its chain,
    and of each checkpoint in it its ``DONE`` record, its metadata, every data file present and
    as long as the metadata says), or None."""
    try:
        checkpoint_position(path)
        chain = checkpoint_chain(path)
    except CheckpointError as e:
        return str(e)
    for member in chain:
        problem = _files_problem(member)
        if problem is not None:
            return problem if member == path else f"it builds on {member}, and {problem}"
    return None


def _files_problem(path: Path) -> str | None:
    metadata = path / ".metadata"
    try:
        with metadata.open("rb") as f:
            storage = pickle.load(f).storage_data
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ValueError) as e:
        return f"{metadata} is unreadable ({type(e).__name__}: {e})"
    needed: dict[str, int] = {}
    for info in storage.values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name, end in sorted(needed.items()):
        try:
            size = (path / name).stat().st_size
        except OSError:
            return f"{path / name} is missing"
        if size < end:
            return f"{path / name} is truncated ({size} of {end} bytes)"
    return None


def _set_aside(path: Path) -> Path:
    """Renames a damaged checkpoint out of the ``step_*`` namespace (kept for inspection, never
    resumed from nor overwritten)."""
    target = path.with_name(f"damaged_{path.name}")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"damaged{n}_{path.name}")
    path.rename(target)
    return target


def fall_back(path: Path, problem: str, rank: int) -> None:
    """Logs that the checkpoint at ``path`` is damaged and, on rank 0, sets it aside."""
    moved = ""
    if rank == 0:
        with contextlib.suppress(OSError):
            moved = f"; moved to {_set_aside(path)}"
    logger.warning(
        "checkpoint %s is damaged (%s): falling back to the previous finished checkpoint%s",
        path,
        problem,
        moved,
    )


def load_checkpoint(
    model: DistributedModelParallel, optimizer: CombinedOptimizer, path: Path
) -> None:
    """Loads ``path`` (with the checkpoints it builds on, oldest first) into the model and
    optimizer; the tiered tables' rows are written to their tier files (so a tier file
    created empty is rebuilt in full). Training changes are counted from here.

    Raises:
        CheckpointError: naming the checkpoint and the cause.
    """
    chain = checkpoint_chain(path)
    groups = tiered_groups(model)
    with deferred_views(groups):
        state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
        for i, member in enumerate(chain):
            try:
                # The first is full; the others hold the tiered rows that changed since the
                # one before. Log-structured tiers get their rows appended, batch by batch.
                load_tier_checkpoint(state, member, groups, incremental=i > 0)
            except (Exception, CheckpointException) as e:
                via = f" (which {path} builds on)" if member != path else ""
                raise CheckpointError(
                    f"checkpoint {member}{via} could not be loaded: {_first_line(e)}"
                ) from e
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
    clear_changes(groups)


def load_newest(
    model: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    candidates: Sequence[tuple[int, Path]],
    rank: int,
) -> tuple[int, Path]:
    """Loads the newest of ``candidates`` (newest first) that loads, falling back (and saying
    so) past damaged ones.

    Raises:
        CheckpointError: when none loads, naming each and why.
    """
    failed: list[str] = []
    for step, path in candidates:
        try:
            load_checkpoint(model, optimizer, path)
        except CheckpointError as e:
            failed.append(str(e))
            fall_back(path, _first_line(e.__cause__ or e), rank)
            continue
        return step, path
    raise CheckpointError(
        "no finished checkpoint could be loaded: " + "; ".join(failed) + ". Start a new run.dir, "
        "or drop run.resume to start this one over"
    )


# ---------------------------------------------------------------------------- the run's start


def _on_rank0(decide: Callable[[], _T], rank: int, world: int) -> _T:
    """``decide()`` run by rank 0 alone (it reads and tidies the shared run directory), its
    result or its user error given to every rank."""
    outcome: list[object] = [None]
    if rank == 0:
        try:
            outcome[0] = ("ok", decide())
        except ConfigError as e:
            if world == 1:
                raise
            outcome[0] = ("error", type(e), str(e))
    if world > 1:
        dist.broadcast_object_list(outcome, src=0)
    result = cast(tuple[Any, ...], outcome[0])
    if result[0] == "error":
        raise result[1](result[2])
    return cast(_T, result[1])


def resume_candidates(
    resume: bool, hardware: HostTopology, run_dir: Path, rank: int, world: int
) -> list[tuple[int, Path]]:
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
    return _on_rank0(lambda: _decide_start(resume, run_dir, leftovers), rank, world)


def _decide_start(resume: bool, run_dir: Path, tier_leftovers: bool) -> list[tuple[int, Path]]:
    finished = finished_checkpoints(run_dir)
    if not resume and finished:
        raise RunDirError(
            f"run.dir={run_dir} already holds a run with a finished checkpoint "
            f"({finished[0][1]}): pass run.resume=true to continue it, or choose a new run.dir."
        )
    unfinished = _unfinished_checkpoints(run_dir)
    usable: list[tuple[int, Path]] = []
    for step, path in finished:
        problem = checkpoint_problem(path)
        if problem is None:
            usable.append((step, path))
        else:
            fall_back(path, problem, 0)
    if finished and not usable:
        raise CheckpointError(
            f"every finished checkpoint in {run_dir}/checkpoints is damaged (each was moved "
            "aside as damaged_step_*, see the warnings): drop run.resume to start this run "
            "over in place, or start a new run.dir."
        )
    if usable:
        for path in unfinished:  # a save that never finished holds rows and nothing usable
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed the unfinished checkpoint %s", path)
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
