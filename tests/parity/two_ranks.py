"""Cases of a sweep axis that run on two spawned ranks, job after job.

One job runs the remaining cases in order on two gloo ranks and stops at the first case that
fails on a rank (the other may be stuck in a collective); the next job starts after it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

C = TypeVar("C")

Outcome = tuple[Any, str, str]  # (case, status, detail)


def run_in_two_rank_jobs(
    cases: Sequence[tuple[int, C]],
    spawn: Callable[[list[C]], list[list[dict[str, Any]]]],
    judge: Callable[[list[dict[str, Any]]], tuple[str, str]],
) -> dict[int, tuple[C, str, str]]:
    """Runs ``cases`` (each with its index in the sweep) through ``spawn`` (cases -> per rank,
    their results in order) until every case ran or failed; ``judge`` turns one case's results
    on both ranks into its status and detail. Returns them by index."""
    out: dict[int, tuple[C, str, str]] = {}
    left = list(cases)
    while left:
        per_rank = spawn([c for _, c in left])
        ran = min(len(r) for r in per_rank)
        if ran == 0:
            i, case = left[0]
            out[i] = (case, "error", "the ranks reported nothing")
        for j in range(ran):
            i, case = left[j]
            out[i] = (case, *judge([r[j] for r in per_rank]))
        left = left[max(ran, 1) :]  # a job stops at a case that failed on a rank
    return out
