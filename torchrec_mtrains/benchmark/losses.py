"""A benchmark's check that what it timed computes what its baseline computes: a variant that
starts from the baseline's weights and trains on its batches must train to its losses. A fast
wrong model is not a result, so a mismatch stops the variant before any figure is printed."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CHECK_STEPS", "LossMismatch", "check_losses"]

CHECK_STEPS = 20
"""The first steps whose losses every variant must share with the baseline."""


class LossMismatch(RuntimeError):
    """A variant trained to other losses than A from the same weights and batches: it does not
    compute what A computes, so none of its figures is a result."""


def check_losses(
    variant: str, losses: Sequence[float], reference: Sequence[float], rtol: float = 0.0
) -> None:
    """Raises :class:`LossMismatch` at the first of ``reference``'s (A's) steps whose loss
    differs from ``losses``' by more than ``rtol`` relative (``0``: bit for bit, what the CPU
    gives: every variant runs the same float operations in the same order)."""
    for step, (got, want) in enumerate(zip(losses, reference)):
        if got != want and abs(got - want) > rtol * abs(want):
            within = f" (beyond {rtol:g} relative)" if rtol else ""
            raise LossMismatch(
                f"{variant}: step {step} loss {got!r}, A's {want!r}{within} from the same "
                "weights and batches: it trains another model than A; no figure of it is "
                "reported"
            )
