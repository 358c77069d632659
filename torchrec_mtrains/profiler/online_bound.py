"""The most hits a row cache can expect without knowing the future, when ids are drawn
independently from a known law.

Why: Belady's MIN (:mod:`~torchrec_mtrains.profiler.replacement`) bounds every policy, but only
by knowing every future batch; no cache can reach it, so "ours against MIN" mixes the policy's
shortfall with the knowledge nobody has. When each batch draws its ids independently from one
fixed law (the independent reference model: synthetic Zipf streams such as W1's), the best a
policy that has seen only the past can do is known exactly: whatever it holds, the batch about
to come finds row ``r`` with probability ``q_r = 1 - (1 - p_r) ** draws``, independently of the
past, so its expected hits are the sum of ``q`` over the rows it holds, at most the sum over the
``cache_rows`` rows of largest ``p`` (the classic A0 policy: keep the most probable rows). The
hit rate counts a batch's unique ids, as the row cache does, so it is that sum over the sum of
every row's ``q``.

A stream that begins with an empty cache pays more: a batch can hit only rows drawn before it,
so early in a run (or for a cache larger than the rows seen so far) the bound is lower
(``after_batches``). Real traces drift and repeat ids within a session; there this is no bound,
and MIN stays the only one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = ["best_online_hit_rates"]


def best_online_hit_rates(
    probabilities: npt.ArrayLike,
    draws: int,
    cache_rows: Sequence[int] | npt.ArrayLike,
    *,
    after_batches: int | Sequence[int] | None = None,
) -> npt.NDArray[np.float64]:
    """Per cache size, the most hits per unique id a batch can expect from a cache whose policy
    does not know future batches, when every batch is ``draws`` independent draws from
    ``probabilities`` (one per row).

    Args:
        probabilities: each row's probability per draw (rows in any order); a shard's rows,
            which a batch's draws reach only in part, sum to less than 1.
        draws: ids a batch draws from this table (with repeats).
        cache_rows: cache sizes in rows.
        after_batches: the batch's place in a stream that began with an empty cache: only rows
            drawn in the ``after_batches`` batches before it can be held. Several: the mean
            over those batches (a window's; each looks up as many unique ids in expectation).
            ``None``: a cache warm forever (the most likely rows held; every row held gives 1).

    A row held when the batch comes is found with probability ``q_r = 1 - (1 - p_r) ** draws``,
    whatever came before, so the expected hits are ``sum(x_r * q_r)`` over the chances ``x_r``
    that each row is held. Those sum to at most ``cache_rows``, and each is at most the chance
    ``s_r = 1 - (1 - q_r) ** after_batches`` that the row was ever drawn (1 when warm forever);
    the best such ``x`` fills the most likely rows first up to ``s_r`` each, which is what is
    returned (over the expected unique ids, ``sum(q)``).

    Example::

        p = ZipfRankSampler(10_000_000, 1.1).rank_probabilities()
        best_online_hit_rates(p, draws=8192, cache_rows=[46_175, 544_613], after_batches=300)
    """
    p = np.asarray(probabilities, dtype=np.float64).reshape(-1)
    if p.size == 0:
        raise ValueError("probabilities must hold at least one row")
    total = float(p.sum())
    if not np.all(np.isfinite(p)) or p.min() < 0.0 or not 0.0 < total <= 1.0 + 1e-6:
        raise ValueError(
            f"probabilities must be finite, >= 0 and sum to at most 1 (a shard's rows may sum "
            f"to less), got a sum of {total!r}"
        )
    if isinstance(draws, bool) or int(draws) != draws or draws < 1:
        raise ValueError(f"draws must be an int >= 1, got {draws!r}")
    after = None if after_batches is None else np.asarray(after_batches).reshape(-1)
    if after is not None and (
        after.size == 0 or not np.issubdtype(after.dtype, np.integer) or after.min() < 0
    ):
        raise ValueError(f"after_batches must be ints >= 0 or None, got {after_batches!r}")
    sizes = np.asarray(cache_rows).reshape(-1)
    if sizes.size and (not np.issubdtype(sizes.dtype, np.integer) or sizes.min() < 0):
        raise ValueError(f"cache_rows must be ints >= 0, got {sizes.tolist()!r}")
    presence = np.sort(_chance_in(np.minimum(p, 1.0), int(draws)))[::-1]
    want = sizes.astype(np.float64)
    if after is None:
        return _fill(presence, np.ones_like(presence), want)
    rates = [_fill(presence, _chance_in(presence, int(t)), want) for t in after.tolist()]
    return np.mean(rates, axis=0)


def _fill(
    presence: npt.NDArray[np.float64], held: npt.NDArray[np.float64], want: npt.NDArray[np.float64]
) -> npt.NDArray[np.float64]:
    """The rows most likely to appear (``presence`` descending) first, each held with at most
    its chance ``held``, up to each capacity of ``want``: the hits over the unique ids."""
    room = np.concatenate(([0.0], np.cumsum(held)))
    served = np.concatenate(([0.0], np.cumsum(presence * held)))
    k = np.minimum(np.searchsorted(room, want, side="right") - 1, presence.size)
    partial = np.zeros_like(want)
    inside = k < presence.size
    partial[inside] = presence[k[inside]] * (want[inside] - room[k[inside]])
    out: npt.NDArray[np.float64] = (served[k] + partial) / float(presence.sum())
    return out


def _chance_in(p: npt.NDArray[np.float64], trials: int) -> npt.NDArray[np.float64]:
    """``1 - (1 - p) ** trials``: the chance that something of chance ``p`` happens at least
    once in ``trials`` independent tries."""
    with np.errstate(divide="ignore"):  # p = 1: log1p(-1) = -inf, surely found
        return -np.expm1(trials * np.log1p(-p))
