"""What the checkpoint chain is made of: its options, a link as its done record describes it,
and the errors that name the link or file at fault. Imports nothing heavy, so a tool that only
reads a checkpoint directory pays for no TorchRec."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DONE_FILE = "DONE"
"""A link's done record: written last, so a link without one never counts."""

LINK_PREFIX = "step_"
"""Links are directories ``step_<step, 8 digits>`` of the checkpoint directory."""

RESERVED_KEYS = frozenset({"step", "parent"})
"""Keys of a done record that the chain owns; ``extra`` may not use them."""


def _count(value: object, name: str, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        allowed = "a whole number >= 1" + (" or None (keep every link)" if allow_none else "")
        raise ValueError(f"{name}={value!r}: must be {allowed}")


@dataclass(frozen=True)
class CheckpointOptions:
    """How a :class:`CheckpointManager` lays out its chain.

    Attributes:
        full_every: every ``full_every``-th link of a chain is a full checkpoint, the others
            hold only the rows of tiered tables that training changed since the link before
            (every other tensor whole), so a restore loads at most ``full_every`` links.
            ``1`` makes every link full (and tracks no changes).
        keep: once a link is done, finished links beyond the newest ``keep`` are deleted,
            except those a kept link builds on. ``None`` keeps every link.
    """

    full_every: int = 4
    keep: int | None = 3

    def __post_init__(self) -> None:
        _count(self.full_every, "full_every")
        _count(self.keep, "keep", allow_none=True)


@dataclass(frozen=True)
class Link:
    """One finished checkpoint of a chain, as its done record describes it.

    Attributes:
        path: its directory.
        step: the training step it was saved at (its directory is named after it).
        parent: the name of the link it holds the changes since (``None``: a full one).
        extra: what the training loop recorded with it (``save(step, extra=...)``): JSON
            values such as the data position.
    """

    path: Path
    step: int
    parent: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict, compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def full(self) -> bool:
        return self.parent is None

    def size_bytes(self) -> int:
        """The size of this link's own files (not those of the links it builds on)."""
        return sum(f.stat().st_size for f in self.path.iterdir() if f.is_file())


class CheckpointError(RuntimeError):
    """A link that cannot be written, read or loaded.

    Attributes:
        path: the link (or file) at fault.
        reason: why, in a few words (the message without the link's name).
    """

    def __init__(self, message: str, path: Path, reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason or message

    def __reduce__(self) -> tuple[Any, ...]:
        # Whole, attributes included, to the other ranks (see ``on_rank0``).
        return (_rebuilt, (type(self), str(self), dict(self.__dict__)))


def _rebuilt(cls: type[CheckpointError], message: str, state: dict[str, Any]) -> CheckpointError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class ChainError(CheckpointError):
    """A link whose chain cannot be replayed: a link it builds on is missing, unfinished or
    not older than it. ``path`` is the link naming it, ``missing`` the one at fault."""

    def __init__(self, message: str, path: Path, missing: Path) -> None:
        super().__init__(message, path)
        self.missing = missing


class CheckpointWriteError(CheckpointError):
    """A save that failed; its unfinished link was removed. ``disk_full``: the disk holding
    it ran out of space (said so in ``reason``, with the space left)."""

    def __init__(self, message: str, path: Path, reason: str, disk_full: bool) -> None:
        super().__init__(message, path, reason)
        self.disk_full = disk_full


class NoLoadableLinkError(CheckpointError):
    """A restore where finished links exist but none loads. ``failures``: why each did not,
    newest first; ``path`` is the checkpoint directory."""

    def __init__(self, message: str, path: Path, failures: Sequence[str]) -> None:
        super().__init__(message, path)
        self.failures = tuple(failures)
