"""Checkpoint chains for a TorchRec training loop: full and incremental links saved with
``torch.distributed.checkpoint``, kept, and restored at any world size.

A link holds the model's ``state_dict()`` and the optimizer's (``{"model": ..., "optim":
...}``), tiered tables streamed from their tiers. An incremental link holds, of the tiered
tables (and the resident tables their kernels compute), only the rows training changed since
the link before it, its parent; every other tensor whole (dense layers, TorchRec's own tables,
the dense optimizer); of a virtual table, its rows that changed and the ids evicted since
(see :mod:`~torchrec_mtrains.distributed.virtual_checkpoints`). Every ``full_every``-th link of
a chain is full. A restore loads the
full link, then each increment in order, each rank reading the rows that fall in its own
shards (:func:`~torchrec_mtrains.distributed.incremental.load_tier_checkpoint`), so a chain
saved at one world size loads at another.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, OptimizerWrapper

from torchrec_mtrains._compat.optim import wrapped_optimizer
from torchrec_mtrains.checkpoint.chain import CheckpointDirectory, done_record, on_rank0
from torchrec_mtrains.checkpoint.storage import (
    disk_full,
    first_line,
    free_space,
    nearly_full,
    private_dir,
    private_writer,
    write_private,
)
from torchrec_mtrains.checkpoint.types import (
    DONE_FILE,
    RESERVED_KEYS,
    CheckpointError,
    CheckpointOptions,
    CheckpointWriteError,
    Link,
    NoLoadableLinkError,
)
from torchrec_mtrains.distributed.incremental import (
    changed_state_dict,
    clear_changes,
    deferred_views,
    full_state_dict,
    load_tier_checkpoint,
    track_changes,
)
from torchrec_mtrains.distributed.tiered_tables import tiered_groups
from torchrec_mtrains.distributed.virtual_checkpoints import (
    ChainLoad,
    saving_changes,
    virtual_spans,
)

logger: logging.Logger = logging.getLogger(__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class CheckpointManager:
    """Saves and restores the chain of checkpoints of one training run in ``directory``.

    Every rank calls :meth:`save` and :meth:`restore` together (they are collectives); rank 0
    alone reads and tidies the directory, which every rank must see. Files are 0600 and
    directories 0700 whatever the umask: a checkpoint holds a copy of every row.

    Args:
        directory: where the links go (``step_<step>`` directories), made if missing.
        model: the ``DistributedModelParallel`` model, with or without tiered tables.
        optimizer: its optimizers: a ``KeyedOptimizer`` such as ``CombinedOptimizer([
            model.fused_optimizer, dense])``, or a sequence of them (combined here). The
            dense one may build its state on its first step (Adam): a restore does that first.
        options: how often a link is full and how many are kept.

    Example::

        dense = KeyedOptimizerWrapper(
            dict(in_backward_optimizer_filter(model.named_parameters())),
            lambda params: torch.optim.Adam(params, lr=1e-3),
        )
        manager = CheckpointManager("ckpt", model, [model.fused_optimizer, dense])
        resumed = manager.restore()  # the newest complete link, or None
        step = resumed.extra["next_batch"] if resumed else 0
        for batch in batches[step:]:
            ...  # a training step
            step += 1
            if step % 1000 == 0:
                manager.save(step, extra={"next_batch": step})
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        model: nn.Module,
        optimizer: KeyedOptimizer | Sequence[KeyedOptimizer],
        options: CheckpointOptions | None = None,
    ) -> None:
        self.directory = CheckpointDirectory(Path(directory))
        self.model = model
        self.optimizer = (
            optimizer if isinstance(optimizer, KeyedOptimizer) else CombinedOptimizer(optimizer)
        )
        self.options = options or CheckpointOptions()
        self._groups = tiered_groups(model)
        # virtual tables' eviction rules, by table: how rows an increment does not hold age;
        # and the ids of this rank's shard: the rows a restore reads
        virtual = [s.virtual for g in self._groups for s in g.shards if s.virtual is not None]
        self._rules = {v.name: v.space.spec.eviction for v in virtual}
        self._spans = virtual_spans(self._groups)
        self._last: Link | None = None
        if self.options.full_every > 1:
            track_changes(self._groups)  # incremental links hold only the rows training changed

    @property
    def last(self) -> Link | None:
        """The link saved or restored last, which the next incremental one builds on."""
        return self._last

    def latest(self) -> Link | None:
        """The newest link that can be loaded as far as its files tell, or None."""
        return self.directory.latest()

    # ---------------------------------------------------------------------------- saving

    def save(
        self, step: int, extra: Mapping[str, Any] | None = None, *, full: bool = False
    ) -> Link:
        """Saves the link of ``step``: incremental on the last saved or restored link, unless
        ``full`` or its chain already holds ``full_every`` links. It counts once its done
        record is written (with ``extra``, JSON values such as the data position, rank 0's);
        finished links beyond the newest ``keep`` are then deleted, except those a kept one
        builds on. A link of the same step is replaced.

        Raises:
            ValueError: a bad ``step`` or ``extra``; nothing is written.
            CheckpointError: the directory holds links of later steps (a restore would pick
                them over this one), naming the newest; nothing is written.
            CheckpointWriteError: the save failed, naming the link and the cause (a full disk
                said as such); the unfinished link is removed.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r}: must be a whole number >= 0")
        record = _checked_extra(extra)
        path = self.directory.path_of(step)
        parent = on_rank0(lambda: self._prepare(step, full), (CheckpointError, OSError))
        groups = self._groups
        try:
            # Log-structured tables are read from their tiers, never exported to their views.
            changes = saving_changes(groups) if parent is not None else contextlib.nullcontext(0)
            with deferred_views(groups), changes as virtual_rows:
                state = self._state()
                saved = (
                    full_state_dict(state, groups)
                    if parent is None
                    else changed_state_dict(state, groups)
                )
                dcp_save(saved.state, storage_writer=private_writer(path), planner=saved.planner)
        except (Exception, CheckpointException) as e:
            raise self._write_failed(path, e) from e
        _barrier()
        clear_changes(groups)  # the tiers and this link now agree
        link = Link(path, step, parent.name if parent is not None else None, record)
        if _rank() == 0:
            write_private(path / DONE_FILE, done_record(step, record, parent), durable=True)
            if self.options.keep is not None:
                self.directory.drop_old(self.options.keep)
            logger.info(
                "checkpoint %s: %s, %.1f MB",
                path,
                "full"
                if parent is None
                else f"rows changed since {parent.name} ({saved.rows + virtual_rows:,} on rank 0)",
                link.size_bytes() / 1e6,
            )
        _barrier()
        self._last = link
        return link

    def _prepare(self, step: int, full: bool) -> Link | None:
        """On rank 0, before a save: refuses one a later link would shadow, removes what a
        save of this step left, and returns the link it builds on (None: a full one)."""
        path = self.directory.path_of(step)
        later = self.directory.finished(after=step)
        if later:
            raise CheckpointError(
                f"checkpoint {path} would be older than {later[0][1]}, a finished link of a later "
                "step: a restore would pick that one. Restore it, delete the later links, or "
                "save into another directory",
                later[0][1],
            )
        private_dir(self.directory.root)
        if path.exists():  # an unfinished save of this step, or the link it replaces
            shutil.rmtree(path)
        last, every = self._last, self.options.full_every
        if full or last is None or every == 1 or last.step >= step:
            return None
        try:
            return last if len(self.directory.chain(last)) < every else None
        except CheckpointError:
            return None

    def _write_failed(self, path: Path, error: BaseException) -> CheckpointWriteError:
        if _rank() == 0:
            shutil.rmtree(path, ignore_errors=True)
        full = disk_full(error) or nearly_full(path.parent)
        reason = (
            f"the disk holding it ran out of space ({free_space(path.parent)} free now)"
            if full
            else first_line(error)
        )
        return CheckpointWriteError(
            f"checkpoint {path} could not be written: {reason}. The unfinished checkpoint was "
            "removed.",
            path,
            reason,
            full,
        )

    # ------------------------------------------------------------------------- restoring

    def restore(self, link: Link | None = None) -> Link | None:
        """Loads ``link`` with the links it builds on (the full one, then each increment in
        order) into the model and optimizer, at any world size; tiered rows are written to
        their tiers. Without ``link``, loads the newest link that loads: a damaged one (found
        by its files, or by loading it) is renamed ``damaged_<name>`` (kept, never loaded
        again) with a warning, and the one before is tried; unfinished links are removed.
        Training changes are counted from the loaded link, which the next save builds on.

        Returns:
            The link loaded (its ``extra`` says where training stands), or None when the
            directory holds no finished link.

        Raises:
            ChainError: ``link``'s chain misses a link or is out of order, naming both.
            CheckpointError: ``link`` could not be loaded, naming the link and the cause.
            NoLoadableLinkError: without ``link``, finished links exist but none loads.
        """
        if link is not None:
            self._load(link)
            self._last = link
            return link
        failures: list[str] = []
        for candidate in on_rank0(self._candidates, (CheckpointError,)):
            error = _agreed(self._load, candidate)
            if error is None:
                self._last = candidate
                return candidate
            failures.append(str(error))
            problem = first_line(error.__cause__ or error)
            self.directory.fall_back(candidate.path, problem, move=_rank() == 0)
        if failures:
            raise NoLoadableLinkError(
                "no finished checkpoint could be loaded: " + "; ".join(failures),
                self.directory.root,
                failures,
            )
        return None

    def _candidates(self) -> list[Link]:
        usable = self.directory.loadable()
        self.directory.remove_unfinished()
        return usable

    def _load(self, link: Link) -> None:
        chain = self.directory.chain(link)
        groups = self._groups
        _build_lazy_states(self.optimizer, chain[0].path)
        with deferred_views(groups):
            state = self._state()
            virtual = ChainLoad(state, self._rules, self._spans)
            for i, member in enumerate(chain):
                try:
                    # The first is full; the others hold the tiered rows that changed since
                    # the one before. Log-structured tiers get their rows appended; virtual
                    # tables' changes are merged into the rows the links before loaded.
                    virtual.before(member.path, incremental=i > 0)
                    load_tier_checkpoint(state, member.path, groups, incremental=i > 0)
                    virtual.after()
                except (Exception, CheckpointException) as e:
                    via = f" (which {link.path} builds on)" if member.path != link.path else ""
                    raise CheckpointError(
                        f"checkpoint {member.path}{via} could not be loaded: {first_line(e)}",
                        member.path,
                        first_line(e),
                    ) from e
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optim"])
        clear_changes(groups)

    def _state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.optimizer.state_dict()}


def _checked_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    out = dict(extra or {})
    taken = sorted(RESERVED_KEYS & out.keys())
    if taken:
        raise ValueError(f"extra: {', '.join(taken)} are the chain's own; name them otherwise")
    if not all(isinstance(key, str) for key in out):
        raise ValueError(f"extra: its keys must be strings, not {sorted(map(repr, out))}")
    try:
        json.dumps(out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra: its values must be JSON (numbers, strings, lists): {e}") from None
    return out


def _agreed(load: Callable[[Link], None], link: Link) -> CheckpointError | None:
    """Runs ``load(link)`` on every rank; the error of the first rank it failed on, on every
    rank (so all fall back together), or None."""
    error: CheckpointError | None = None
    try:
        load(link)
    except CheckpointError as e:
        error = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        said: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(said, None if error is None else str(error))
        first = next((str(s) for s in said if s is not None), None)
        if error is None and first is not None:
            error = CheckpointError(first, link.path)
    return error


def _leaves(optimizer: KeyedOptimizer) -> Iterator[KeyedOptimizer]:
    if isinstance(optimizer, CombinedOptimizer):
        for _, child in optimizer.optimizers:
            yield from _leaves(child)
    elif isinstance(optimizer, OptimizerWrapper):
        yield from _leaves(wrapped_optimizer(optimizer))
    else:
        yield optimizer


def _build_lazy_states(optimizer: KeyedOptimizer, checkpoint: Path) -> None:
    """Builds the state of each optimizer that builds it on its first step (Adam) and has
    none yet, where ``checkpoint`` holds it: TorchRec's optimizers load states into the
    tensors they have, and would silently keep none."""
    lazy = [leaf for leaf in _leaves(optimizer) if not leaf.state and leaf.params]
    if not lazy:
        return
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    saved = [key for key in metadata if key.startswith("optim.state.")]
    key_of = {id(param): key for key, param in optimizer.params.items()}
    for leaf in lazy:
        prefixes = tuple(
            f"optim.state.{key_of[id(p)]}." for p in leaf.params.values() if id(p) in key_of
        )
        if any(key.startswith(prefixes) for key in saved):
            leaf.init_state()
