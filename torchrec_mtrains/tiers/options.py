"""The tiers' options: how each tier's stores are opened, and the checks of every value.

Light on purpose (no I/O, no numpy): the stores import their option types from here, and so does
the planner's host topology, whose block-tier fields take their defaults from these classes, so
each option has one default and one check. A store class names its type as ``options_type``.
"""

from __future__ import annotations

import enum
import math
import numbers
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

PASS_BYTES = 4 << 20
"""Default buffer memory of one I/O pass of a block store (``max_pass_bytes``): 1,024 blocks of 4
KiB, far more than the queue keeps in flight. A store keeps one pass's buffer idle between
calls, so it holds at most two passes of buffers; the planner counts them as host memory."""


class IOEngineKind(str, enum.Enum):
    """Which engine a block store issues its I/Os with."""

    AUTO = "auto"  # for O_DIRECT files the first of AUTO_ENGINES the kernel offers, else threads
    URING = "uring"
    AIO = "aio"
    THREADS = "threads"


AUTO_ENGINES: tuple[IOEngineKind, ...] = (IOEngineKind.URING, IOEngineKind.AIO)
"""What ``engine="auto"`` (the default) tries for an O_DIRECT file, in order, before a thread
pool: io_uring takes less CPU per I/O than native AIO (``benchmarks/tier_bench.py --engine``;
docs/benchmarks.md), and a kernel or container may refuse it (``kernel.io_uring_disabled``,
seccomp), which is logged once. A buffered file uses threads (native AIO blocks on one; io_uring
on buffered files has not been measured here)."""


_O = TypeVar("_O", bound="TierOptions")


@dataclass(frozen=True)
class TierOptions:
    """How the stores of one tier are opened; each backend subclasses it with its own fields.

    A subclass is a frozen dataclass that sets ``tier`` to the name of the tier it configures
    and is named by that store class's ``options_type`` (:func:`register_tier` checks the pair).
    Values are checked when an instance is made: each field against its annotation (a string
    becomes the enum the field is annotated with; ``bool`` is not an ``int``), then
    :meth:`validate`. Every error is a ``ValueError`` naming the tier and the option.

    ``hardware_fields`` lists the fields that describe the device as the planner models it too:
    the tier's hardware config (e.g. ``BlockTierConfig``) has fields of the same names, and
    :func:`torchrec_mtrains.planner.presets.store_options` copies them from the host topology,
    so a store runs with the queue depth and block size the perf model assumed.

    Example::

        options = TIERS["block_scm"].options_type.from_mapping({"queue_depth": 8})
        store = open_store("block_scm", "/mnt/nvme0/run1", "t", layout, options=options)
    """

    tier: ClassVar[str] = ""
    hardware_fields: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        hints = _field_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            ok, converted = _convert(hints[f.name], value)
            if not ok:
                raise self.option_error(
                    f.name, f"must be {_describe(hints[f.name])}, got {value!r}"
                )
            if converted is not value:
                object.__setattr__(self, f.name, converted)
        self.validate()

    def validate(self) -> None:
        """Checks the values beyond their types; raises :meth:`option_error` for a bad one."""

    @classmethod
    def option_error(cls, option: str, problem: str) -> ValueError:
        """The error for a bad value of ``option``: ``tier 'block_scm' option 'queue_depth'
        must be >= 1, got 0``."""
        return ValueError(f"tier {cls.tier!r} option {option!r} {problem}")

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        """The options this tier takes, in declaration order."""
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_mapping(cls: type[_O], values: Mapping[str, Any]) -> _O:
        """The options ``values`` (e.g. a config section) set, defaults for the rest.

        Raises:
            ValueError: for a key that is not an option of this tier (naming the tier, the key
                and the allowed keys) or a bad value.
        """
        allowed = cls.option_names()
        unknown = [str(k) for k in values if k not in allowed]
        if unknown:
            raise ValueError(
                f"tier {cls.tier!r}: unknown option{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(map(repr, unknown))}; allowed: {', '.join(allowed) or '(none)'}"
            )
        return cls(**{str(k): v for k, v in values.items()})

    def as_dict(self) -> dict[str, Any]:
        """The options as plain values (enums as their values), for logs and benchmark JSON."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.value if isinstance(value, enum.Enum) else value
        return out


def _field_hints(cls: type[TierOptions]) -> dict[str, Any]:
    # Resolved here, not in the class body: ``from __future__ import annotations`` makes
    # the annotations strings, evaluated in the subclass's module.
    return typing.get_type_hints(cls)


def _convert(hint: Any, value: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits the annotation ``hint``, and the value to store (an enum member
    for its value, a float for an int)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            ok, converted = _convert(arg, value)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if hint is bool:
        return isinstance(value, bool), value
    if hint is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return ok, int(value) if ok and type(value) is not int else value
    if hint is float:
        ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
        return ok, float(value) if ok and type(value) is not float else value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return True, hint(value)
        except ValueError:
            return False, value
    if isinstance(hint, type):
        return isinstance(value, hint), value
    return True, value


_PLAIN_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _describe(hint: Any) -> str:
    """What ``hint`` accepts, in words."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(arg) for arg in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return "one of " + ", ".join(repr(m.value) for m in hint)
    return _PLAIN_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


@dataclass(frozen=True)
class DramOptions(TierOptions):
    """The DRAM tier takes no options (its file is written back only on flush); the class
    exists so that every tier is configured the same way."""

    tier: ClassVar[str] = "dram"


@dataclass(frozen=True)
class ByteScmOptions(TierOptions):
    """How byte-SCM stores are opened.

    Args:
        numa_node: bind the mapping's pages to this NUMA node (e.g. a CXL memory node);
            ``None`` leaves placement to the kernel.
        map_sync: ``None`` tries ``MAP_SYNC`` when the directory is on a DAX mount and falls
            back to a plain shared mapping; ``True`` requires it; ``False`` never uses it.
        preallocate: a new file's blocks are allocated when it is made, so a full device fails
            there rather than as a SIGBUS at a later write. ``False`` leaves it sparse until
            :meth:`ByteSCMStore.allocate`: for a copy that may never be filled (a
            log-structured table's view), which should take no disk until it is.
    """

    tier: ClassVar[str] = "byte_scm"

    numa_node: int | None = None
    map_sync: bool | None = None
    preallocate: bool = True

    def validate(self) -> None:
        if self.numa_node is not None and self.numa_node < 0:
            raise self.option_error("numa_node", f"must be >= 0 or None, got {self.numa_node}")


@dataclass(frozen=True)
class BlockIOOptions(TierOptions):
    """The options of block I/O every block store takes (not a tier of its own).

    Args:
        block_size: I/O unit and alignment in bytes, a power of two >= 512 (the device's logical
            block size or a multiple of it for O_DIRECT). The perf model costs I/Os of this
            size; a log-structured file keeps the block size it was made with.
        queue_depth: I/Os kept in flight at once; the perf model's IOPS figures are measured
            at this depth.
        direct: use ``O_DIRECT`` where the file system supports it (falls back to buffered I/O
            with one warning per process where it does not, e.g. on older tmpfs).
        engine: how the I/Os are issued (:class:`IOEngineKind`; its value is accepted too).
            ``auto``: for an O_DIRECT file io_uring where the kernel offers it, else native AIO
            (logging once why), and threads for a buffered file (:data:`AUTO_ENGINES`).
            ``uring``: io_uring (registered buffers, one ``io_uring_enter`` submitting and
            reaping many I/Os); ``aio``: native AIO (``io_submit``/``io_getevents``); these two
            fail at open where the kernel refuses them. ``threads``: a pool of ``queue_depth``
            threads, for any file.
        max_io_bytes: cap on one I/O, so a long sequential read (or an append) still spreads
            over the queue; at least ``block_size``.
        max_pass_bytes: buffer memory one batch may use; larger batches are done in passes.
    """

    hardware_fields: ClassVar[tuple[str, ...]] = ("block_size", "queue_depth", "max_pass_bytes")

    block_size: int = 4096
    queue_depth: int = 32
    direct: bool = True
    engine: IOEngineKind = IOEngineKind.AUTO
    max_io_bytes: int = 1 << 20
    max_pass_bytes: int = PASS_BYTES

    def validate(self) -> None:
        bs = self.block_size
        if bs < 512 or bs & (bs - 1):
            raise self.option_error("block_size", f"must be a power of two >= 512, got {bs}")
        if self.queue_depth < 1:
            raise self.option_error("queue_depth", f"must be >= 1, got {self.queue_depth}")
        if self.max_io_bytes < bs:
            raise self.option_error(
                "max_io_bytes", f"({self.max_io_bytes}) must be >= block_size ({bs})"
            )
        if self.max_pass_bytes < 1:
            raise self.option_error("max_pass_bytes", f"must be >= 1, got {self.max_pass_bytes}")


@dataclass(frozen=True)
class BlockScmOptions(BlockIOOptions):
    """How block-SCM stores in the flat layout are opened (:class:`BlockIOOptions`).

    Example::

        BlockScmOptions(block_size=4096, queue_depth=64, engine=IOEngineKind.AIO)
    """

    tier: ClassVar[str] = "block_scm"


@dataclass(frozen=True)
class LogBlockScmOptions(BlockIOOptions):
    """How log-structured block stores are opened: :class:`BlockIOOptions` (appends are split
    into ``max_io_bytes`` pieces, 256 KiB by default), and

    Args:
        segment_bytes: unit of compaction, a multiple of ``block_size`` (small tables use
            smaller segments). A file keeps the segment size it was made with.
        max_space_amplification: the file's data region is at most this many times the
            table's row bytes (or a few segments beyond the live rows for tiny tables); >= 1.1,
            and the lower it is, the more compaction copies per row written. It holds while
            the rows rewritten between two flushes fit in the free space a flush leaves (half
            the dead space the bound allows); beyond that the file grows until a flush.

    Example::

        LogBlockScmOptions(queue_depth=64, max_space_amplification=1.5)
    """

    tier: ClassVar[str] = "log_block_scm"
    hardware_fields: ClassVar[tuple[str, ...]] = (
        *BlockIOOptions.hardware_fields,
        "max_space_amplification",
    )

    max_io_bytes: int = 256 << 10
    segment_bytes: int = 4 << 20
    max_space_amplification: float = 2.0

    def validate(self) -> None:
        super().validate()
        bs = self.block_size
        if self.segment_bytes < bs or self.segment_bytes % bs:
            raise self.option_error(
                "segment_bytes",
                f"must be a positive multiple of block_size ({bs}), got {self.segment_bytes}",
            )
        amp = self.max_space_amplification
        if not (math.isfinite(amp) and amp >= 1.1):
            raise self.option_error(
                "max_space_amplification",
                f"must be a finite number >= 1.1 (compaction needs dead space), got {amp}",
            )


def own_options(
    tier: str, options_type: type[TierOptions], options: TierOptions | None
) -> TierOptions:
    """``options`` (the defaults for ``None``) when they are ``tier``'s kind."""
    if options is None:
        return options_type()
    if not isinstance(options, options_type):
        raise ValueError(
            f"tier {tier!r} takes {options_type.__qualname__}, got "
            f"{type(options).__qualname__} (options of tier {options.tier!r})"
        )
    return options
