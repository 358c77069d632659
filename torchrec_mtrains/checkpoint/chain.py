"""A checkpoint directory as a chain of links, read and tidied without loading a tensor: which
links are finished, what each builds on, which can be loaded, which to delete.

A link is a ``torch.distributed.checkpoint`` directory ``step_<step>`` with a done record
(``DONE``, JSON: its step, the parent it builds on if it is incremental, and the training
loop's ``extra`` values), written once every rank's files are written: a link without one
never counts. Rank 0 alone reads and tidies a directory every rank shares (see
:func:`on_rank0`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, cast

import torch.distributed as dist

from torchrec_mtrains.checkpoint.types import (
    DONE_FILE,
    LINK_PREFIX,
    RESERVED_KEYS,
    ChainError,
    CheckpointError,
    Link,
)

logger: logging.Logger = logging.getLogger(__name__)

_T = TypeVar("_T")


def link_name(step: int) -> str:
    return f"{LINK_PREFIX}{step:08d}"


def _step_of(path: Path) -> int | None:
    if not path.name.startswith(LINK_PREFIX):
        return None
    try:
        return int(path.name[len(LINK_PREFIX) :])
    except ValueError:
        return None


def read_link(path: Path) -> Link:
    """The finished link at ``path``, from its done record. A record holding only a number
    (an older layout) is that step's full link.

    Raises:
        CheckpointError: the record is missing or unreadable, or names a step other than the
            directory's name, naming the record.
    """
    done = path / DONE_FILE
    try:
        record = json.loads(done.read_text())
        if isinstance(record, int) and not isinstance(record, bool):
            record = {"step": record}
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"no step in {record!r}"[:200])
        parent = record.get("parent")
        if parent is not None and (
            not isinstance(parent, str) or "/" in parent or _step_of(Path(parent)) is None
        ):
            raise ValueError(f"parent {parent!r} is not a link's name")
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{done} is unreadable ({e!r})", path) from None
    step = int(record["step"])
    if _step_of(path) not in (None, step):
        raise CheckpointError(f"{done} records step {step}, not that of its directory", path)
    extra = {k: v for k, v in record.items() if k not in RESERVED_KEYS}
    return Link(path, step, parent or None, extra)


def done_record(step: int, extra: dict[str, Any], parent: Link | None) -> str:
    """The done record of a link: its step, the training loop's values, its parent's name."""
    record: dict[str, Any] = {"step": step, **extra}
    if parent is not None:
        record["parent"] = parent.name
    return json.dumps(record)


class CheckpointDirectory:
    """The links under ``root`` (a directory of ``step_<step>`` directories), read and tidied
    without loading them.

    Example::

        directory = CheckpointDirectory(Path("ckpt"))
        for link in directory.links():
            print(link.step, link.parent or "full", directory.problem(link))
    """

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path_of(self, step: int) -> Path:
        return self.root / link_name(step)

    def finished(self, after: int = -1) -> list[tuple[int, Path]]:
        """The links with a done record (of steps past ``after``), newest first, as
        ``(step, path)``, their records unread (the step is the directory's name's)."""
        found = []
        for done in self.root.glob(f"{LINK_PREFIX}*/{DONE_FILE}"):
            step = _step_of(done.parent)
            if step is not None and step > after:
                found.append((step, done.parent))
        return sorted(found, reverse=True)

    def links(self) -> list[Link]:
        """The finished links whose done record reads, newest first."""
        out = []
        for _, path in self.finished():
            with contextlib.suppress(CheckpointError):
                out.append(read_link(path))
        return out

    def unfinished(self) -> list[Path]:
        """Links a save began and never finished (no done record), oldest first."""
        return sorted(
            p
            for p in self.root.glob(f"{LINK_PREFIX}*")
            if p.is_dir() and _step_of(p) is not None and not (p / DONE_FILE).exists()
        )

    def chain(self, link: Link | Path) -> list[Link]:
        """The links that together hold the state saved at ``link``, oldest first: ``link``
        alone when it is full, else the full link it builds on and every increment up to it.

        Raises:
            CheckpointError: a done record of the chain is unreadable, naming it.
            ChainError: a link of the chain is missing or unfinished, or not older than the
                link naming it, naming both.
        """
        chain = [link if isinstance(link, Link) else read_link(link)]
        while (parent := chain[-1].parent) is not None:
            child, base = chain[-1], self.root / parent
            via = f" (which {chain[0].path} builds on)" if child is not chain[0] else ""
            if not (base / DONE_FILE).is_file():
                raise ChainError(
                    f"checkpoint {child.path}{via} holds the rows changed since {base}, which "
                    "is missing or unfinished: it cannot be loaded without it",
                    child.path,
                    base,
                )
            older = read_link(base)
            if older.step >= child.step:
                raise ChainError(
                    f"checkpoint {child.path}{via} (step {child.step}) builds on {base} (step "
                    f"{older.step}), which is not older: the chain is out of order and cannot "
                    "be replayed",
                    child.path,
                    base,
                )
            chain.append(older)
        return chain[::-1]

    def problem(self, link: Link | Path) -> str | None:
        """Why ``link`` cannot be loaded, found without loading it (its chain, and of each
        link in it the done record, dcp's metadata, every data file present and as long as
        the metadata says), or None."""
        path = link.path if isinstance(link, Link) else link
        try:
            chain = self.chain(link)
        except CheckpointError as e:
            return str(e)
        for member in chain:
            problem = _files_problem(member.path)
            if problem is not None:
                return (
                    problem if member.path == path else f"it builds on {member.path}, and {problem}"
                )
        return None

    def latest(self) -> Link | None:
        """The newest link that can be loaded as far as its files tell (see :meth:`problem`),
        or None."""
        for _, path in self.finished():
            if self.problem(path) is None:
                return read_link(path)
        return None

    def loadable(self) -> list[Link]:
        """The finished links that look loadable, newest first; each damaged one is set aside
        (see :meth:`set_aside`), saying why."""
        usable = []
        for _, path in self.finished():
            problem = self.problem(path)
            if problem is None:
                usable.append(read_link(path))
            else:
                self.fall_back(path, problem)
        return usable

    def remove_unfinished(self) -> list[Path]:
        """Deletes the links a save began and never finished; returns them."""
        gone = self.unfinished()
        for path in gone:  # a save that never finished holds rows and nothing usable
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed the unfinished checkpoint %s", path)
        return gone

    def set_aside(self, path: Path) -> Path:
        """Renames a damaged link out of the ``step_*`` namespace, to ``damaged_step_*``: kept
        for inspection, never loaded, built on nor overwritten."""
        target = path.with_name(f"damaged_{path.name}")
        n = 1
        while target.exists():
            n += 1
            target = path.with_name(f"damaged{n}_{path.name}")
        path.rename(target)
        return target

    def fall_back(self, path: Path, problem: str, move: bool = True) -> None:
        """Logs that the link at ``path`` is damaged and, with ``move``, sets it aside."""
        moved = ""
        if move:
            with contextlib.suppress(OSError):
                moved = f"; moved to {self.set_aside(path)}"
        logger.warning(
            "checkpoint %s is damaged (%s): falling back to the previous finished checkpoint%s",
            path,
            problem,
            moved,
        )

    def drop_old(self, keep: int) -> list[Path]:
        """Deletes finished links beyond the newest ``keep``, except those a kept one builds
        on (an incremental link needs its whole chain); returns them."""
        finished = [path for _, path in self.finished()]
        needed: set[Path] = set()
        for path in finished[:keep]:
            try:
                needed.update(link.path for link in self.chain(path))
            except CheckpointError:
                needed.add(path)
        gone = [path for path in finished[keep:] if path not in needed]
        for path in gone:
            shutil.rmtree(path)
        return gone


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


def on_rank0(decide: Callable[[], _T], errors: tuple[type[Exception], ...] = ()) -> _T:
    """``decide()`` run by rank 0 alone (it reads and tidies a directory every rank shares),
    its result given to every rank; an error of ``errors`` it raises is raised on every rank,
    so no rank waits for another that stopped. Needs no process group when there is none."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    outcome: list[object] = [None]
    if dist.get_rank() == 0:
        try:
            outcome[0] = ("ok", decide())
        except errors as e:
            outcome[0] = ("error", e)
    dist.broadcast_object_list(outcome, src=0)
    result = cast(tuple[Any, ...], outcome[0])
    if result[0] == "error":
        raise result[1]
    return cast(_T, result[1])
