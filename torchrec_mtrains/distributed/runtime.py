"""The compute device and the process group of a training process, chosen once.

A job runs one rank per GPU on CUDA hosts (NCCL) and one or more ranks per host on CPU (gloo).
Under ``torchrun`` (and so ``torchx run``) every rank finds its rank, world size and local rank
in the environment; a process started alone forms a one-rank group on a free loopback port.

Every collective waits at most the group's timeout for the other ranks. :func:`failing_together`
turns what follows a failure into one error on every rank: a rank that raises tells the others
(through the job's store) and aborts the group, so their collectives fail at once and they stop
naming it and its error; a rank whose collective timed out or lost a peer names the ranks that
did not report back (stopped, hung or dead).

A group is ended with :func:`end_process_group` (``process_group`` does it on leaving): the
group's backend threads must be joined while the interpreter is whole, not at its exit.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import logging
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from torchrec_mtrains._compat.torch_internals import abort_process_group, default_store

logger: logging.Logger = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda")

_T = TypeVar("_T")


def local_rank() -> int:
    """This process's rank on its host (``LOCAL_RANK`` under torchrun; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Ranks on this host (``LOCAL_WORLD_SIZE`` under torchrun; 1 alone)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resolve_device(choice: str = "auto") -> torch.device:
    """The device this rank computes on.

    Args:
        choice: ``auto`` (CUDA when a GPU is visible, else the CPU), ``cpu`` or ``cuda``. On
            CUDA each local rank gets its own GPU, ``cuda:<LOCAL_RANK>``.

    Raises:
        ValueError: for another choice, for ``cuda`` without a visible GPU, or when this
            host runs more ranks than it has GPUs.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device={choice!r}: expected one of {', '.join(DEVICE_CHOICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "device=cuda but no GPU is visible to this process (torch.cuda.is_available() is "
            "False); use device=cpu or device=auto"
        )
    rank, gpus = local_rank(), torch.cuda.device_count()
    if rank >= gpus:
        raise ValueError(
            f"local rank {rank} has no GPU of its own: this host has {gpus} GPU(s) and runs "
            f"{local_world_size()} rank(s); start at most one rank per GPU"
        )
    return torch.device("cuda", rank)


def with_index(device: torch.device) -> torch.device:
    """``device`` with its index: a bare ``cuda`` is the current CUDA device. Code that
    makes a device current on a thread (``torch.cuda.set_device``) needs one: torch refuses
    ``torch.device("cuda")`` there."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ranks."""
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ProcessGroupInfo:
    """Where this process stands in the job.

    Attributes:
        rank / world_size: in the default process group.
        device: the compute device (see :func:`resolve_device`).
        created: whether :func:`init_process_group` formed the group (and so should end it).
    """

    rank: int
    world_size: int
    device: torch.device
    created: bool


def init_process_group(
    device: torch.device,
    timeout: timedelta | None = None,
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
) -> ProcessGroupInfo:
    """Joins the job's default process group with the backend for ``device``, or forms a
    one-rank group when the process was started alone; reuses a group that already exists.

    Args:
        device: this rank's compute device; on CUDA it becomes the current device first, as
            NCCL's collectives need.
        timeout: how long a collective may wait for the other ranks (torch's default if None).
        backend: the group's backend, default :func:`backend_for` ``device``
            (``cpu:gloo,cuda:nccl`` gives one group that reduces tensors of both kinds).
        rank / world_size / port: join ``world_size`` processes meeting on loopback ``port``
            (ranks a test or benchmark spawned itself); by default the torchrun environment
            says where to meet, and a process started alone forms a group of one.

    Raises:
        ValueError: when only some of ``rank``, ``world_size`` and ``port`` are given.
    """
    explicit = (rank, world_size, port)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise ValueError(
            f"rank={rank}, world_size={world_size}, port={port}: give all three to meet on "
            "loopback, or none to use the torchrun environment"
        )
    device = with_index(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), device, False)
    backend = backend or backend_for(device)
    if rank is not None and world_size is not None:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    elif "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    _collect_at_exit()
    logger.debug(
        "rank %d of %d on %s (%s)", dist.get_rank(), dist.get_world_size(), device, backend
    )
    return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), device, True)


def end_process_group() -> None:
    """Destroys the default group and its backend now, while the interpreter is whole.

    ``dist.destroy_process_group`` only unregisters the group: TorchRec's sharded modules,
    optimizers and ShardedTensors hold it in reference cycles, so its backend (gloo's worker and
    I/O threads, the store rank 0 hosts) would live on until the collector runs while the
    interpreter finalizes. A gloo worker that then drops the last reference to a collective's
    tensor takes the GIL, and CPython ends it with ``pthread_exit`` inside a ``noexcept``
    destructor: "terminate called without an active exception", SIGABRT after a finished run.
    Collecting those cycles here runs the group's destructor, which joins its threads.
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


@functools.cache
def _collect_at_exit() -> None:
    """Once per process: a collection at exit, before the interpreter finalizes, ends a group
    destroyed while its holders were still reachable (an error's traceback keeps the model) as
    :func:`end_process_group` would, and a caller's ``dist.destroy_process_group`` too."""
    atexit.register(gc.collect)


@contextlib.contextmanager
def process_group(
    device: torch.device | None = None, timeout: timedelta | None = None, **where: Any
) -> Iterator[ProcessGroupInfo]:
    """:func:`init_process_group` (``device`` default: the CPU) for the ``with`` block; the
    group is ended (:func:`end_process_group`) at its end if this call formed it.

    Example::

        with process_group() as group:  # DistributedModelParallel needs a group, even of one
            model = DistributedModelParallel(module, device=group.device)
    """
    info = init_process_group(device or torch.device("cpu"), timeout, **where)
    try:
        yield info
    finally:
        if info.created:
            end_process_group()


_DURATION_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}


def parse_duration(value: str | int | float, what: str = "duration") -> timedelta:
    """``"90s"``, ``"5min"`` (or ``"5m"``), ``"1.5h"``, ``"500ms"``; a bare number is seconds.

    Raises:
        ValueError: naming ``what`` when ``value`` is not a positive, finite duration.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}={value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).lower() if match else ""
        if not match or (unit and unit not in _DURATION_UNITS):
            raise ValueError(
                f"{what}={value!r} is not a duration; write e.g. 90s, 5min, 1h or seconds"
            )
        seconds = float(match.group(1)) * _DURATION_UNITS[unit or "s"]
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{what}={value!r} must be a finite duration > 0")
    return timedelta(seconds=seconds)


def format_duration(duration: timedelta) -> str:
    """``90s``, ``10min``, ``1.5h``: the shortest of the units :func:`parse_duration` reads."""
    seconds = duration.total_seconds()
    for unit, size in (("h", 3600.0), ("min", 60.0)):
        if seconds >= size and (seconds / size * 10).is_integer():
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


class RankFailure(RuntimeError):
    """A collective failed because other ranks failed, ended or stopped answering.

    Attributes:
        ranks: the ranks at fault (empty when every rank reported back).
    """

    def __init__(self, message: str, ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.ranks = ranks


# Where ranks leave word on the job's store when a run fails: "failed/<rank>" holds a rank's
# own error, "reported/<rank>" marks a rank that saw a collective fail and is still running.
_BOARD = "torchrec_mtrains/failure/"
# Messages of a collective that failed for want of a peer (gloo's, and the c10d wrappers').
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")
# gloo's own words where its message does not name it: a pair it closed when a collective
# waited past the timeout ("Application timeout caused pair closure").
_GLOO_ONLY = ("pair closure",)


def _collective_failure(error: BaseException) -> str | None:
    """``"timed out"`` / ``"lost a peer"`` when ``error``, or an error it was raised from (a
    pipeline may wrap its worker's), is a collective failing for want of another rank; else
    None: this rank's own error."""
    seen: set[int] = set()
    found: BaseException | None = error
    while found is not None and id(found) not in seen and not isinstance(found, RankFailure):
        seen.add(id(found))
        text = str(found)
        if isinstance(found, RuntimeError) and (
            isinstance(found, dist.DistError)
            or "gloo" in text
            or "NCCL" in text
            or any(marker in text for marker in _GLOO_ONLY)
        ):
            if any(marker in text for marker in _TIMED_OUT):
                return "timed out"
            if any(marker in text for marker in _PEER_LOST) or isinstance(found, dist.DistError):
                return "lost a peer"
        found = found.__cause__ or found.__context__
    return None


def _bounded(work: Callable[[], _T], seconds: float) -> _T | None:
    """``work()`` on a daemon thread, given up after ``seconds`` (None): a store hosted by a
    stopped process accepts connections but never answers, and must not hang this one."""
    result: list[_T] = []

    def run() -> None:
        try:
            result.append(work())
        except Exception as e:  # the store is gone: the caller says so without its answer
            logger.debug("the job's store did not answer: %s", e)

    thread = threading.Thread(target=run, name="rank-failure-board", daemon=True)
    thread.start()
    thread.join(seconds)
    return result[0] if result else None


def _abort_group() -> None:
    """Ends the default group now: the other ranks' pending and next collectives with this
    one fail at once (gloo: the connections close) instead of waiting out the timeout."""
    if not dist.is_initialized():
        return
    try:
        (abort_process_group() or dist.destroy_process_group)()
        if dist.is_initialized():  # the abort left the group registered
            dist.destroy_process_group()
    except Exception as e:  # already failing: the error being raised says more than this one
        logger.debug("aborting the process group failed: %s", e)


def _summary(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _plural(ranks: list[int]) -> str:
    names = ", ".join(map(str, ranks))
    return f"rank {names}" if len(ranks) == 1 else f"ranks {names}"


def _watch(
    store: Any, rank: int, world: int, grace_s: float, everyone: bool = False
) -> tuple[dict[int, str], list[int]]:
    """(errors the other ranks posted, the other ranks that neither posted an error nor
    reported a failed collective), once every other rank is heard from, ``grace_s`` has
    passed, or (unless ``everyone``) a rank posted its error: that post is the cause."""
    others = [r for r in range(world) if r != rank]
    failed: dict[int, str] = {}
    reported: set[int] = set()
    deadline = time.monotonic() + grace_s
    while True:
        for r in others:
            if r not in failed and store.check([f"{_BOARD}failed/{r}"]):
                failed[r] = store.get(f"{_BOARD}failed/{r}").decode(errors="replace")
            if r not in reported and store.check([f"{_BOARD}reported/{r}"]):
                reported.add(r)
        silent = [r for r in others if r not in failed and r not in reported]
        if (failed and not everyone) or not silent or time.monotonic() >= deadline:
            return failed, silent
        time.sleep(0.05)


@contextlib.contextmanager
def failing_together(
    timeout: timedelta | None = None,
    *,
    option: str = "the process group's timeout",
    grace_s: float = 3.0,
) -> Iterator[None]:
    """Makes a failure on any rank end every rank of the default group promptly, each with an
    error that names the rank at fault.

    Inside the block, a rank that raises its own error posts it on the job's store and aborts
    the group before re-raising it, so the others' collectives fail at once; a rank whose
    collective fails (timed out, or a peer's connection closed) raises :class:`RankFailure`
    naming the rank that posted an error, or else the ranks that did not report back within
    ``grace_s`` (stopped, hung or dead). Costs nothing until something fails. A group of one
    rank, or none, passes errors through unchanged.

    Args:
        timeout: the group's collective timeout, quoted in the error.
        option: how the user sets that timeout (e.g. ``run.collective_timeout=10min``).
        grace_s: how long a rank whose collective failed waits for the others to report.

    Raises:
        RankFailure: when a collective failed because of another rank.

    Example::

        with process_group(timeout=timedelta(minutes=10)), failing_together(option="..."):
            train()
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store: Any = default_store()
    try:
        yield
    except BaseException as error:
        how = _collective_failure(error)
        if how is None and isinstance(error, GeneratorExit | RankFailure):
            raise
        key, note = (
            (f"{_BOARD}failed/{rank}", _summary(error))
            if how is None
            else (f"{_BOARD}reported/{rank}", how)
        )
        # A set is not acknowledged: the check that follows it on the same connection is, so
        # the post is on the store before the abort below lets the others look for it.
        posted = _bounded(lambda: store.set(key, note) is None and store.check([key]), 2.0)
        # Aborting fails the collectives the other ranks wait in (or enter next) with this one.
        _abort_group()
        if how is None:
            # The store may live in this process (rank 0 hosts it unless torchrun's agent does):
            # stay until the others have read the error, or for grace_s.
            if posted:
                _bounded(lambda: _watch(store, rank, world, grace_s, everyone=True), grace_s + 1)
            raise
        # A rank that closed its connection posted first, unless it died; with one other rank
        # there is nobody else to wait for.
        wait_s = 0.0 if how == "lost a peer" and world == 2 else grace_s
        found = _bounded(lambda: _watch(store, rank, world, wait_s), wait_s + 2) if posted else None
        raise _rank_failure(error, how, found, rank, world, timeout, option) from error


def _rank_failure(
    error: BaseException,
    how: str,
    found: tuple[dict[int, str], list[int]] | None,
    rank: int,
    world: int,
    timeout: timedelta | None,
    option: str,
) -> RankFailure:
    """The error for a collective that failed on ``rank``, from what :func:`_watch` found."""
    knob = option.split("=")[0]
    if found is None:  # the store did not answer
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return RankFailure(
                f"a collective on rank {rank} {how} and the job's store (torchrun's agent) did "
                f"not answer to say which rank failed ({option}); check every rank's log. "
                f"{_summary(error)}",
                (),
            )
        silent = [0]  # the store lives in rank 0's process: it is the rank not answering
    else:
        failed, silent = found
        if failed:
            first = min(failed)
            return RankFailure(
                f"rank {first} failed, so rank {rank} stops too. Rank {first}: {failed[first]}",
                (first,),
            )
    if not silent:
        return RankFailure(
            f"a collective on rank {rank} {how} while all {world} ranks were still running "
            f"({option}): {_summary(error)}",
            (),
        )
    one = len(silent) == 1
    them, they = (_plural(silent), "it" if one else "they")
    if how == "timed out":
        waited = f"{format_duration(timeout)} " if timeout is not None else ""
        what = (
            f"a collective on rank {rank} waited {waited}for {them} ({option})"
            f"{' and the store rank 0 hosts did not answer' if found is None else ''}, and "
            f"{they} did not report back: {they} {'is' if one else 'are'} stopped, hung or "
            f"dead. Check {'its' if one else 'their'} log, or raise {knob} if {they} "
            f"{'was' if one else 'were'} only slow (a long step, checkpoint or evaluation)."
        )
    else:
        what = (
            f"rank {rank} lost its connection to {them} in a collective, and {they} did not "
            f"report back: {they} ended or {'was' if one else 'were'} killed. Check "
            f"{'its' if one else 'their'} log (and the host's, for the OOM killer)."
        )
    return RankFailure(f"{them} stopped answering: {what}", tuple(silent))
