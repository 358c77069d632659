"""Records of the private names the seam reaches, and the accessor that names a missing one.

A :class:`PrivateName` says where a name lives, how the library relies on it (:class:`Use`),
what it is, what breaks without it and, for a callable, the parameters it must take. Each seam
module declares its records with :func:`declare` beside the functions that use them, and those
functions carry :func:`reaches`, which appends the records to their docstrings.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

TORCHREC_CHECKED: tuple[str, ...] = ("1.8.0", "1.6.1")
"""TorchRec releases every TorchRec record was checked on: 1.8.0 (the CPU stack), 1.6.1 (the GPU
host's; here with ``PYTHONPATH`` at its wheel, see CONTRIBUTING)."""

TORCH_CHECKED: tuple[str, ...] = ("2.13.0",)
"""torch releases every torch record was checked on (the CPU stack's)."""

_CHECKED = {"torchrec": TORCHREC_CHECKED, "torch": TORCH_CHECKED}


class Use(enum.Enum):
    """How the library relies on a private name."""

    CALLED = "called"
    """A function, or a method of one of TorchRec's objects, that the library calls."""
    READ = "read"
    """An attribute of one of TorchRec's objects that the library reads (or sets)."""
    IMPORTED = "imported"
    """A public class imported from a private module path."""
    OVERRIDDEN = "overridden"
    """A private method TorchRec calls on itself, overridden by a library subclass."""
    PROVIDED = "provided"
    """A private attribute TorchRec reads, set by a library class on its objects."""


@dataclass(frozen=True)
class PrivateName:
    """One private name of TorchRec or torch that the library relies on.

    Attributes:
        owners: where it lives, each ``"module:Class"`` or ``"module"`` (a module-level name);
            an attribute set by constructors is listed on the classes whose constructors set
            it. Every owner is checked.
        name: the name.
        use: how the library relies on it.
        reaches: what it is, in a sentence.
        breaks: what breaks without it, in a sentence.
        parameters: for a callable, the parameter names ``inspect.signature`` gives on the
            newest release checked (``None``: not a callable).
        parameters_by_version: the parameter names on releases where they differ.
        overridden_in: for an overridden or provided name, the library classes that define it
            (``"module:Class"``).
    """

    owners: tuple[str, ...]
    name: str
    use: Use
    reaches: str
    breaks: str
    parameters: tuple[str, ...] | None = None
    parameters_by_version: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    overridden_in: tuple[str, ...] = ()

    @property
    def package(self) -> str:
        """The distribution the name belongs to (``torchrec`` or ``torch``)."""
        return self.owners[0].partition(":")[0].split(".")[0]

    @property
    def checked_on(self) -> tuple[str, ...]:
        """The releases of :attr:`package` this record was checked on."""
        return _CHECKED[self.package]

    @property
    def title(self) -> str:
        """``Class.name`` (or ``module.name``) of the first owner, and how many more."""
        module, _, cls = self.owners[0].partition(":")
        more = f" (and {len(self.owners) - 1} more)" if len(self.owners) > 1 else ""
        return f"{cls or module}.{self.name}{more}"

    def expected_parameters(self, version: str) -> tuple[str, ...] | None:
        """The parameter names expected on ``version`` of :attr:`package` (a release not
        checked is expected to look like the newest one)."""
        return self.parameters_by_version.get(version, self.parameters)

    def describe(self) -> str:
        """The record in a paragraph, for docstrings and error messages."""
        versions = ", ".join(self.checked_on)
        return (
            f"{self.title} ({self.use.value}; {self.package} {versions}): {self.reaches} "
            f"Without it: {self.breaks}"
        )


REGISTRY: list[PrivateName] = []
"""Every record the seam's modules declared (each module adds its own when imported)."""


def declare(
    owners: str | tuple[str, ...],
    name: str,
    use: Use,
    *,
    reaches: str,
    breaks: str,
    parameters: tuple[str, ...] | None = None,
    parameters_by_version: Mapping[str, tuple[str, ...]] | None = None,
    overridden_in: tuple[str, ...] = (),
) -> PrivateName:
    """Records a private name in :data:`REGISTRY` and returns its record."""
    record = PrivateName(
        owners=(owners,) if isinstance(owners, str) else owners,
        name=name,
        use=use,
        reaches=reaches,
        breaks=breaks,
        parameters=parameters,
        parameters_by_version=dict(parameters_by_version or {}),
        overridden_in=overridden_in,
    )
    REGISTRY.append(record)
    return record


_F = TypeVar("_F", bound=Callable[..., Any])


def reaches(*records: PrivateName) -> Callable[[_F], _F]:
    """Appends ``records`` to the decorated function's docstring (what it reaches, the versions
    checked, what breaks without it)."""

    def mark(fn: _F) -> _F:
        lines = "\n".join(f"    {record.describe()}" for record in records)
        fn.__doc__ = f"{inspect.cleandoc(fn.__doc__ or '')}\n\nReaches:\n{lines}\n"
        return fn

    return mark


class TorchRecCompatError(RuntimeError):
    """A private name the library relies on is missing from the installed package.

    Args:
        record: the missing name's record.
        holder: the object it was looked for on.
    """

    def __init__(self, record: PrivateName, holder: object) -> None:
        self.record = record
        super().__init__(
            f"{type(holder).__qualname__} has no {record.name!r}, which torchrec_mtrains "
            f"relies on ({record.describe()}); this release of {record.package} is not one "
            f"the seam was checked on ({', '.join(record.checked_on)}): run "
            "tests/distributed/test_torchrec_compat.py and see torchrec_mtrains/_compat/"
        )


def private_attr(holder: object, record: PrivateName) -> Any:
    """``holder``'s attribute ``record.name``.

    Raises:
        TorchRecCompatError: naming the record when ``holder`` has no such attribute.
    """
    try:
        return getattr(holder, record.name)
    except AttributeError:
        raise TorchRecCompatError(record, holder) from None


def has_private_attr(holder: object, record: PrivateName) -> bool:
    """Whether ``holder`` has ``record.name`` (for names only some of TorchRec's classes set)."""
    return hasattr(holder, record.name)


def set_private_attr(holder: object, record: PrivateName, value: Any) -> None:
    """Sets ``holder``'s attribute ``record.name`` (``setattr``: a module registers a module)."""
    setattr(holder, record.name, value)
