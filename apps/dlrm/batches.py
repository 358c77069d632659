"""Batches in step across ranks: the training stream from its checkpointed position, cut to
the run's schedule (``run.epochs``, ``run.steps``) and read ahead by a background thread, and
the held-out stream. Every step is a collective, so a rank whose data runs out ends the epoch
for all (:func:`while_all_have`)."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Generator, Iterable, Iterator, Sized
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch

from apps.dlrm.checkpoints import Position
from apps.dlrm.config import RunConfig
from apps.dlrm.data import DataConfig, Split, build_dataloader
from apps.dlrm.data.background import read_ahead
from apps.dlrm.errors import ConfigError


def source(
    data: DataConfig, rank: int, world: int, split: Split, start: int = 0
) -> Iterable[Batch]:
    """This rank's batches of ``split`` from batch ``start`` on; data config problems (a
    missing file, a bad value) surface here, before any table is built."""
    try:
        return build_dataloader(data, rank, world, start_batch=start, split=split)
    except FileNotFoundError as e:
        raise ConfigError(
            f"data file not found: {e.filename or e}. Point the data config at existing files, "
            "e.g. data=criteo_tsv data.paths=[/path/day_0.tsv], or use data=synthetic."
        ) from None
    except ValueError as e:
        raise ConfigError(f"data (kind {data.kind!r}): {e}") from None


def in_step(
    source: Iterable[Batch], world: int, device: torch.device, read_ahead_batches: int
) -> tuple[Generator[Batch, None, None], int | None]:
    """``source`` cut to the batches every rank has, and their number when known up front,
    built ``read_ahead_batches`` ahead by a background thread (0: as they are taken).

    A source with a length agrees on the shortest once; one without (a text file's lines are
    not counted in advance) agrees before each batch whether every rank still has one."""
    if isinstance(source, Sized):
        count = len(source)
        if world > 1:
            shortest = torch.tensor([count], device=device)
            dist.all_reduce(shortest, op=dist.ReduceOp.MIN)
            count = int(shortest)
        return read_ahead(itertools.islice(source, count), read_ahead_batches), count
    batches = read_ahead(source, read_ahead_batches)
    if world == 1:
        return batches, None
    return while_all_have(batches, device), None


def while_all_have(batches: Iterator[Batch], device: torch.device) -> Generator[Batch, None, None]:
    while True:
        batch = next(batches, None)
        have = torch.tensor([batch is not None], dtype=torch.int32, device=device)
        dist.all_reduce(have, op=dist.ReduceOp.MIN)
        if batch is None or not bool(have):
            return
        yield batch


@dataclass(frozen=True)
class Schedule:
    """How long to train: ``epochs`` passes over the training split, cut short at ``steps``
    steps in all, resumed ones included (``run.epochs``, ``run.steps``; None lifts that
    limit, not both)."""

    steps: int | None
    epochs: int | None

    @classmethod
    def from_config(cls, run: RunConfig) -> Schedule:
        """``run``'s schedule (checked by :class:`~apps.dlrm.config.RunConfig`)."""
        return cls(run.steps, run.epochs)

    def total(self, epoch_batches: int | None) -> int | None:
        """The step the run ends at, when known before it starts."""
        limits = [self.steps]
        if self.epochs is not None and epoch_batches is not None:
            limits.append(self.epochs * epoch_batches)
        known = [n for n in limits if n is not None]
        return min(known) if known else None


@dataclass
class DataState:
    """Where the training stream stands: the positions of the batches it handed out and that
    are not trained yet (look-ahead reads ahead), and what it learnt of the epochs."""

    queued: deque[Position] = field(default_factory=deque)
    epoch_batches: int | None = None  # per rank, once known
    empty: bool = False  # an epoch had no batch at all

    def trained(self) -> Position:
        """The position after the batch the step just trained."""
        epoch, batch = self.queued.popleft()
        return Position(epoch, batch + 1)


def training_batches(
    data: DataConfig,
    rank: int,
    world: int,
    device: torch.device,
    schedule: Schedule,
    start: Position,
    first: Iterable[Batch],
    state: DataState,
    read_ahead_batches: int,
) -> Generator[Batch, None, None]:
    """Every remaining epoch's training batches as one stream: ``first`` (the source from
    ``start``), then a fresh pass per epoch, each in step over the ranks and built
    ``read_ahead_batches`` ahead by a background thread."""
    epoch = start.epoch
    while schedule.epochs is None or epoch < schedule.epochs:
        resumed = epoch == start.epoch
        index = start.batch if resumed else 0
        epoch_source = first if resumed else source(data, rank, world, Split.TRAIN)
        batches, count = in_step(epoch_source, world, device, read_ahead_batches)
        if count is not None:
            state.epoch_batches = index + count
        for batch in batches:
            state.queued.append(Position(epoch, index))
            index += 1
            yield batch
        if index == 0:
            state.empty = True  # more passes would not find any either
            return
        state.epoch_batches = index
        epoch += 1


def short_of_schedule(
    data: DataConfig, schedule: Schedule, state: DataState, step: int
) -> list[str]:
    """Why training ended before ``run.steps``, if it did."""
    if state.empty:
        return [f"the training split is empty (data.kind={data.kind}): nothing was trained"]
    if schedule.steps is None or step >= schedule.steps:
        return []
    passes = f"pass{'es' if schedule.epochs != 1 else ''}"
    return [
        f"run.steps={schedule.steps} not reached: run.epochs={schedule.epochs} {passes} over "
        f"{state.epoch_batches} training batches per rank end at step {step}; raise "
        "run.epochs, or pass run.steps=null to train by epochs alone"
    ]
