"""The tiers by name: each store class registers itself (:func:`register_tier`), and a table's
tier name and options pick the store that opens its file (:func:`resolve_options`,
:func:`placement_options`: the block tier's log or flat layout), :func:`open_store` opens it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from torchrec_mtrains.tiers.base import OpenMode, RowStore
from torchrec_mtrains.tiers.options import TierOptions, own_options
from torchrec_mtrains.types import RowLayout

_REGISTRY: dict[str, type[RowStore]] = {}
_S = TypeVar("_S", bound=type[RowStore])
TIERS: Mapping[str, type[RowStore]] = MappingProxyType(_REGISTRY)
"""Read-only view of the registered tiers, by name."""


def register_tier(cls: _S, *, clobber: bool = False) -> _S:
    """Registers a store class under ``cls.name``; usable as a class decorator.

    Raises ``ValueError`` if the name is taken and ``clobber`` is false, or if ``cls`` has no
    ``options_type`` for its tier."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__qualname__} must define a non-empty class attribute 'name'")
    options_type = getattr(cls, "options_type", None)
    if not (isinstance(options_type, type) and issubclass(options_type, TierOptions)):
        raise ValueError(
            f"{cls.__qualname__} must set the class attribute 'options_type' to its "
            "TierOptions subclass"
        )
    if options_type.tier != name:
        raise ValueError(
            f"{cls.__qualname__}.options_type is {options_type.__qualname__}, whose tier is "
            f"{options_type.tier!r}, not {name!r}"
        )
    if name in _REGISTRY and _REGISTRY[name] is not cls and not clobber:
        raise ValueError(f"tier {name!r} is already registered to {_REGISTRY[name].__qualname__}")
    if not cls.serves_tier:
        cls.serves_tier = name
    _REGISTRY[name] = cls
    return cls


def tier_class(tier: str) -> type[RowStore]:
    """The store class registered as ``tier``; ``ValueError`` listing the registered tiers."""
    try:
        return TIERS[tier]
    except KeyError:
        raise ValueError(
            f"unknown tier {tier!r}; registered tiers: {', '.join(sorted(TIERS))}"
        ) from None


LAYOUT_KEY = "layout"
"""The key of a tier's options mapping that picks another file layout of the same device
(``{"block_scm": {"layout": "log"}}``: the log-structured block tier)."""


def layouts_of(tier: str) -> dict[str, type[RowStore]]:
    """The registered stores that keep ``tier``'s rows, by file layout (``flat``, ``log``)."""
    return {cls.file_layout: cls for cls in TIERS.values() if cls.serves_tier == tier}


DEFAULT_LAYOUTS: Mapping[str, str] = {"block_scm": "log"}
"""The file layout a table placed on a tier gets when its options name none; ``flat`` for a
tier not listed. The block tier appends write-backs to a log: a flat file's in-place
write-back is a read-modify-write of every block a row touches, several times the I/O."""


def default_layout(tier: str) -> str:
    """The file layout of a table placed on ``tier`` when its options name none."""
    return DEFAULT_LAYOUTS.get(tier, "flat")


def placement_options(
    tier: str, options: TierOptions | Mapping[str, Any] | None = None
) -> TierOptions:
    """The options a table placed on ``tier`` opens its store with: as :func:`resolve_options`,
    except that options naming no layout (``None``, or a mapping without ``layout``) get the
    tier's :func:`default_layout`. Typed options name their store, so they are kept."""
    if isinstance(options, TierOptions):
        return resolve_options(tier, options)
    values = dict(options or {})
    values.setdefault(LAYOUT_KEY, default_layout(tier_class(tier).serves_tier))
    return resolve_options(tier, values)


def resolve_options(
    tier: str, options: TierOptions | Mapping[str, Any] | None = None
) -> TierOptions:
    """``tier``'s options from a typed object, a mapping such as a config section (checked key
    by key, see :meth:`TierOptions.from_mapping`) or ``None`` (the defaults).

    The options say which store opens the tier's files: ``tier``'s own, or a store serving it
    in another file layout, chosen by giving that store's options
    (``LogBlockScmOptions`` for ``block_scm``) or a mapping with ``layout`` (``"log"``).
    :attr:`TierOptions.tier` of the result names the store to open.

    Raises:
        ValueError: for an unknown tier or layout, options of another tier, an unknown key or
            a bad value, naming the tier and the option.
    """
    own = tier_class(tier)
    if isinstance(options, TierOptions) and options.tier != tier:
        store = TIERS.get(options.tier)
        if store is not None and store.serves_tier == own.serves_tier:
            return options  # another layout of the same device
    if options is None or isinstance(options, TierOptions):
        return own_options(tier, own.options_type, options)
    if LAYOUT_KEY in options:
        values = dict(options)
        layout = values.pop(LAYOUT_KEY)
        layouts = layouts_of(own.serves_tier)
        if layout not in layouts:
            raise own.options_type.option_error(
                LAYOUT_KEY, f"must be one of {', '.join(sorted(layouts))}, got {layout!r}"
            )
        return layouts[layout].options_type.from_mapping(values)
    return own.options_type.from_mapping(options)


def open_store(
    tier: str,
    directory: str | os.PathLike[str],
    table: str,
    layout: RowLayout,
    *,
    mode: OpenMode | str = OpenMode.OPEN_OR_CREATE,
    options: TierOptions | Mapping[str, Any] | None = None,
) -> RowStore:
    """Opens ``table`` on the tier named ``tier``.

    Args:
        tier: a registered tier name (:data:`TIERS`); the options may pick another file
            layout of its device (see :func:`resolve_options`).
        directory: existing, writable directory for the store's file.
        table: table (or shard) name.
        layout: shape of the rows.
        mode: what to do with an existing file (see :class:`OpenMode`).
        options: the tier's :class:`TierOptions`, or a mapping of them (e.g.
            ``{"engine": "aio", "block_size": 8192, "queue_depth": 4}``), or ``None`` for the
            defaults; see :func:`resolve_options`.

    Raises:
        ValueError: for an unknown tier or bad options, naming the tier and the option.
    """
    resolved = resolve_options(tier, options)
    return tier_class(resolved.tier)(directory, table, layout, mode=mode, options=resolved)
