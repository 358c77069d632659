"""Eviction of a virtual table's ids, as TorchRec's policy objects configure it.

TorchRec 1.8's ``virtual_table_eviction_policy`` objects say *which* ids go; its CUDA backend
scans the live ids in rounds. The same rules here, per table shard:

* ``CountBasedEvictionPolicy``: each batch that trains an id adds one to its count; a round
  multiplies every live id's count by ``decay_rate`` and evicts those below
  ``eviction_threshold`` (0: never);
* ``TimestampBasedEvictionPolicy``: a round evicts ids last trained more than
  ``eviction_ttl_mins`` ago (0: never);
* ``CountTimestampMixedEvictionPolicy``: both at once: the TTL has passed *and* the decayed
  count is below the threshold (either 0: never);
* ``FeatureL2NormBasedEvictionPolicy``: ids whose weights' L2 norm is below
  ``eviction_threshold`` (0: never);
* ``FeatureScoreBasedEvictionPolicy``: each id trained adds its feature's score per value (what
  TorchRec's ``enable_auto_feature_score_collection`` attaches to each value, from
  ``feature_score_mapping`` or ``feature_score_default_value``); a round multiplies every live
  id's score by ``decay_rate`` and keeps the ``training_id_keep_count`` highest (the lowest go
  first, the least recently used first among equal scores, then the lowest id: the same
  choice after a reload), or fewer when the batch's new ids need more room. So the table stays
  nearly full of the ids used most lately, where a threshold on a count evicts every id used
  once since the last round. With ``eviction_ttl_mins`` set it is a TTL rule, as TorchRec's
  docs say; ``enable_eviction=False``: never;
* ``NoEvictionPolicy`` (or none): never.

A round runs before a batch's new ids get rows, when the shard holds more than the policy's
``training_id_eviction_trigger_count`` ids (when that is set) or when the batch's new ids would
not fit its ``max_live_rows``. It never evicts the batch's own ids, nor rows a batch in flight
holds (prefetched by the look-ahead pipeline, or between its forward and backward). An evicted
id's row is free for the next new id; trained again, the id is a new row (initial values,
optimizer state zero). ``FeatureScoreBasedEvictionPolicy`` without
``enable_auto_feature_score_collection`` takes its scores from the input's weights, which the
tiers do not read, and is refused.

A round's scans over the live rows (which may go, which rank lowest) are compiled kernels
without the GIL (:mod:`~torchrec_mtrains.cache.kernels`' numba), as they run on the tier-I/O
worker beside training; without numba, numpy's.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from torchrec.modules.embedding_configs import (
    CountBasedEvictionPolicy,
    CountTimestampMixedEvictionPolicy,
    FeatureL2NormBasedEvictionPolicy,
    FeatureScoreBasedEvictionPolicy,
    NoEvictionPolicy,
    TimestampBasedEvictionPolicy,
)

from torchrec_mtrains.cache.kernels import NUMBA_AVAILABLE, _jit

I64 = npt.NDArray[np.int64]
F64 = npt.NDArray[np.float64]

Clock = Callable[[], float]
"""Seconds, for TTLs; ``time.time`` unless a test gives another."""


class EvictionKind(str, enum.Enum):
    NONE = "none"
    COUNT = "count"
    TTL = "ttl"
    MIXED = "mixed"
    L2 = "l2"
    SCORE = "score"


class UnsupportedEvictionPolicy(ValueError):
    """A virtual table names an eviction policy the tiers do not run."""


@dataclass(frozen=True)
class EvictionRule:
    """One table's eviction rule, read from TorchRec's policy object (see the module doc)."""

    kind: EvictionKind = EvictionKind.NONE
    trigger_count: int = 0
    threshold: float = 0.0
    decay_rate: float = 1.0
    ttl_seconds: float = 0.0
    # the score rule's: ids a round keeps, and what each value of the table's features adds
    keep_count: int = 0
    score: float = 0.0

    @classmethod
    def from_policy(cls, table: str, policy: Any, features: Sequence[str] = ()) -> EvictionRule:
        """The rule ``policy`` (TorchRec's object, or None) sets for ``table``, whose
        ``features`` the score rule reads its score for."""
        if policy is None or isinstance(policy, NoEvictionPolicy):
            return cls()
        trigger = int(getattr(policy, "training_id_eviction_trigger_count", 0) or 0)
        if isinstance(policy, FeatureScoreBasedEvictionPolicy):
            rule = cls._from_score_policy(table, policy, trigger, features)
        elif isinstance(policy, CountBasedEvictionPolicy):
            rule = cls(
                EvictionKind.COUNT,
                trigger,
                threshold=float(policy.eviction_threshold),
                decay_rate=float(policy.decay_rate),
            )
        elif isinstance(policy, CountTimestampMixedEvictionPolicy):
            rule = cls(
                EvictionKind.MIXED,
                trigger,
                threshold=float(policy.eviction_threshold),
                decay_rate=float(policy.decay_rate),
                ttl_seconds=60.0 * policy.eviction_ttl_mins,
            )
        elif isinstance(policy, TimestampBasedEvictionPolicy):
            rule = cls(EvictionKind.TTL, trigger, ttl_seconds=60.0 * policy.eviction_ttl_mins)
        elif isinstance(policy, FeatureL2NormBasedEvictionPolicy):
            rule = cls(EvictionKind.L2, trigger, threshold=float(policy.eviction_threshold))
        else:
            raise UnsupportedEvictionPolicy(
                f"virtual table {table!r}: virtual_table_eviction_policy="
                f"{type(policy).__name__} is not supported on the tiers; use "
                "CountBasedEvictionPolicy, TimestampBasedEvictionPolicy, "
                "CountTimestampMixedEvictionPolicy, FeatureL2NormBasedEvictionPolicy, "
                "FeatureScoreBasedEvictionPolicy or NoEvictionPolicy"
            )
        decays = (EvictionKind.COUNT, EvictionKind.MIXED, EvictionKind.SCORE)
        if rule.kind in decays and not 0 < rule.decay_rate <= 1:
            raise UnsupportedEvictionPolicy(
                f"virtual table {table!r}: decay_rate={rule.decay_rate} must be in (0, 1]"
            )
        if rule.threshold < 0 or rule.ttl_seconds < 0 or rule.trigger_count < 0:
            raise UnsupportedEvictionPolicy(
                f"virtual table {table!r}: eviction_threshold, eviction_ttl_mins and "
                "training_id_eviction_trigger_count must not be negative"
            )
        return rule

    @classmethod
    def _from_score_policy(
        cls,
        table: str,
        policy: FeatureScoreBasedEvictionPolicy,
        trigger: int,
        features: Sequence[str],
    ) -> EvictionRule:
        def refuse(why: str) -> UnsupportedEvictionPolicy:
            return UnsupportedEvictionPolicy(
                f"virtual table {table!r}: FeatureScoreBasedEvictionPolicy {why}"
            )

        if not policy.enable_eviction:
            return cls()
        if policy.eviction_ttl_mins:  # TorchRec: a TTL rule then, not a score one
            return cls(EvictionKind.TTL, trigger, ttl_seconds=60.0 * policy.eviction_ttl_mins)
        if not policy.enable_auto_feature_score_collection:
            raise refuse(
                "with enable_auto_feature_score_collection=False takes its scores from the "
                "input's weights, which the tiers do not read; set it to True (scores from "
                "feature_score_mapping)"
            )
        if policy.training_id_keep_count <= 0:
            raise refuse(
                f"needs training_id_keep_count > 0 (got {policy.training_id_keep_count}): the "
                "ids a round keeps"
            )
        mapping = policy.feature_score_mapping or {}
        default = policy.feature_score_default_value
        scores: dict[str, float] = {}
        for feature in features:
            score = mapping.get(feature, default)
            if score is None:
                raise refuse(
                    f"has no score for feature {feature!r}: add it to feature_score_mapping "
                    "or set feature_score_default_value"
                )
            if not 0 <= float(score) < float("inf"):
                raise refuse(
                    f"gives feature {feature!r} the score {score}: use a finite score >= 0"
                )
            scores[feature] = float(score)
        if len(set(scores.values())) > 1:
            raise refuse(
                f"gives the table's features different scores ({scores}); the tiers keep one "
                "score a table"
            )
        return cls(
            EvictionKind.SCORE,
            trigger,
            decay_rate=float(policy.decay_rate),
            keep_count=int(policy.training_id_keep_count),
            score=next(iter(scores.values()), 1.0 if default is None else float(default)),
        )

    @property
    def columns(self) -> tuple[str, ...]:
        """What a state dict keeps of each row for this rule (its ``metadata`` columns): the
        statistics the rule reads, and the batches since the row was last used (eviction
        spares recent rows); nothing when the rule never evicts. The score rule keeps its
        decayed score as ``count`` (the same decay per round as a count's)."""
        if not self.evicts:
            return ()
        stats = {
            EvictionKind.COUNT: ("count",),
            EvictionKind.SCORE: ("count",),
            EvictionKind.TTL: ("last_used",),
            EvictionKind.MIXED: ("count", "last_used"),
        }.get(self.kind, ())
        return (*stats, "batches_ago")

    @property
    def evicts(self) -> bool:
        if self.kind is EvictionKind.NONE:
            return False
        if self.kind is EvictionKind.TTL:
            return self.ttl_seconds > 0
        if self.kind is EvictionKind.MIXED:
            return self.ttl_seconds > 0 and self.threshold > 0
        if self.kind is EvictionKind.SCORE:
            return self.keep_count > 0
        return self.threshold > 0


class ShardEviction:
    """The statistics one virtual table shard keeps per store row, and its rounds.

    Args:
        rule: the table's rule.
        capacity: the shard's store rows.
        clock: seconds for TTLs.
    """

    def __init__(self, rule: EvictionRule, capacity: int, clock: Clock = time.time) -> None:
        self.rule = rule
        self.clock = clock
        # uses since made (count rules) or the decayed score (the score rule)
        self.count = np.zeros(capacity, dtype=np.float64)
        self.last_used = np.zeros(capacity, dtype=np.float64)
        # the batch (counted by ``batches``, from 1) that last used each row
        self.last_batch = np.zeros(capacity, dtype=np.int64)
        self.batches = 0
        self.rounds = 0
        self.evicted = 0

    def touch(self, rows: I64, values: I64 | None = None) -> None:
        """The batch being planned trains ``rows`` (unique), with ``values`` values each (the
        score rule's; one when not given): one more use each, used now."""
        self.count[rows] += self._batch_scores(values) if self._scores else 1.0
        self.last_used[rows] = self.clock()
        self.last_batch[rows] = self.batches

    def made(self, rows: I64, values: I64 | None = None) -> None:
        """``rows`` hold new ids, used by the batch being planned: statistics start over (the
        score rule's with this batch's score)."""
        self.count[rows] = self._batch_scores(values) if self._scores else 0.0
        self.last_used[rows] = self.clock()
        self.last_batch[rows] = self.batches

    @property
    def _scores(self) -> bool:
        return self.rule.kind is EvictionKind.SCORE

    def _batch_scores(self, values: I64 | None) -> F64 | float:
        if values is None:
            return self.rule.score
        return values.astype(np.float64) * self.rule.score

    def export(self, rows: I64) -> F64:
        """The rule's :attr:`EvictionRule.columns` of ``rows``, ``(len(rows), k)`` float64."""
        values = {
            "count": lambda: self.count[rows],
            "last_used": lambda: self.last_used[rows],
            "batches_ago": lambda: (self.batches - self.last_batch[rows]).astype(np.float64),
        }
        columns = [values[name]() for name in self.rule.columns]
        return np.stack(columns, axis=1) if columns else np.zeros((len(rows), 0))

    def restore(self, rows: I64, metadata: F64) -> None:
        """Sets ``rows``' statistics from :meth:`export`'s columns (a load)."""
        for k, name in enumerate(self.rule.columns):
            column = metadata[:, k]
            if name == "count":
                self.count[rows] = column
            elif name == "last_used":
                self.last_used[rows] = column
            else:  # batches ago, kept as ages: the batch count moves on far enough for them
                ago = column.astype(np.int64)
                if len(ago):
                    self.batches = max(self.batches, int(ago.max()) + 1)
                self.last_batch[rows] = self.batches - ago

    def due(self, live: int, new: int, capacity: int) -> bool:
        """Whether a round runs before a batch bringing ``new`` ids to ``live`` ones."""
        if not self.rule.evicts:
            return False
        over_trigger = 0 < self.rule.trigger_count < live
        return over_trigger or live + new > capacity

    def select(
        self,
        live: I64,
        may_go: npt.NDArray[np.bool_],
        l2_norms: Callable[[I64], F64],
        room: int = 0,
        ids: I64 | None = None,
    ) -> I64:
        """One round over the ``live`` rows (holding ``ids``, the score rule's last tie-break;
        the rows themselves when not given): every count decays, then the rows the rule evicts
        among those that ``may_go`` are returned (the score rule's: at least ``room`` of them,
        when that many may go)."""
        self.rounds += 1
        rule = self.rule
        if rule.kind in (EvictionKind.COUNT, EvictionKind.MIXED, EvictionKind.SCORE):
            # Every row, live or not: the same products for the live ones, and a row's count
            # starts over when it is made. One pass over the array where a gather and scatter
            # of the live rows took ~1.5 ms a round on W3.
            self.count *= rule.decay_rate
        positions = np.flatnonzero(may_go)
        rows = live[positions]
        if rule.kind is EvictionKind.SCORE:
            n = max(len(live) - rule.keep_count, room)
            id_source = live if ids is None else ids
            # The later keys only for the ties left (rows[at]): most rounds need none of them.
            keys: tuple[Callable[[I64], npt.NDArray[Any]], ...] = (
                lambda at: self.last_batch[rows[at]],
                lambda at: id_source[positions[at]],
            )
            gone = rows[_smallest(self.count[rows], keys, n)]
        else:
            gone = rows[self._goes(rows, l2_norms)]
        self.evicted += len(gone)
        return gone

    def _goes(self, rows: I64, l2_norms: Callable[[I64], F64]) -> npt.NDArray[np.bool_]:
        rule = self.rule
        low_count = self.count[rows] < rule.threshold
        expired = self.clock() - self.last_used[rows] > rule.ttl_seconds
        if rule.kind is EvictionKind.COUNT:
            return low_count
        if rule.kind is EvictionKind.TTL:
            return expired
        if rule.kind is EvictionKind.MIXED:
            return low_count & expired
        if rule.kind is EvictionKind.L2:
            return l2_norms(rows) < rule.threshold
        return np.zeros(rows.shape, dtype=np.bool_)


def _smallest(
    first: npt.NDArray[Any], then: tuple[Callable[[I64], npt.NDArray[Any]], ...], n: int
) -> I64:
    """Positions of the ``n`` smallest entries by ``first``, then among its equals by each key
    of ``then`` in turn (each given the positions still tied; the last key distinct), in
    position order. A selection per key (:func:`split_at_nth_smallest`), linear in the
    entries, where a sort of a round's ~250,000 rows took 60 ms."""
    if n <= 0:
        return np.empty(0, dtype=np.int64)
    if n >= len(first):
        return np.arange(len(first), dtype=np.int64)
    chosen = np.zeros(len(first), dtype=np.bool_)
    left: I64 | None = None  # None: every position
    values = first
    for key in (None, *then):
        if key is not None:
            assert left is not None
            values = key(left)
        below, tied = split_at_nth_smallest(values, n)
        if left is not None:
            below, tied = left[below], left[tied]
        chosen[below] = True
        n -= len(below)
        left = tied
        if n <= 0:
            break
        if n >= len(left):
            chosen[left] = True
            break
    return np.flatnonzero(chosen).astype(np.int64)


_SELECT_BITS = 16  # digits of a radix select: at most 4 passes over 64-bit keys
_SIGN = np.int64(-(2**63))
_LOW_63 = np.int64(2**63 - 1)


@_jit
def _order_keys(values: F64) -> I64:
    """int64 keys whose signed order is the order of ``values`` (float64: -0.0 before 0.0,
    NaN after every number): a float's bits, the negative ones' low 63 bits flipped."""
    bits = values.view(np.int64)
    keys = np.empty(bits.shape[0], np.int64)
    for i in range(bits.shape[0]):
        b = bits[i]
        keys[i] = b if b >= 0 else b ^ _LOW_63
    return keys


@_jit
def _nth_key(keys: I64, rank: int) -> Any:
    """The key of rank ``rank`` (from 0) in ascending signed order: a radix select, most
    significant digit first, each pass over the keys still in the running. (Flipping the sign
    bit makes the unsigned order of the digits the signed order of the keys.)"""
    digits = 1 << _SELECT_BITS
    digit_mask = digits - 1
    counts = np.zeros(digits, np.int64)
    left = keys
    shift = 64 - _SELECT_BITS
    while True:
        counts[:] = 0
        for i in range(left.shape[0]):
            counts[((left[i] ^ _SIGN) >> shift) & digit_mask] += 1
        digit = 0
        while rank >= counts[digit]:
            rank -= counts[digit]
            digit += 1
        if shift == 0:  # the keys left with this last digit are all equal
            for i in range(left.shape[0]):
                if ((left[i] ^ _SIGN) & digit_mask) == digit:
                    return left[i]
        if counts[digit] < left.shape[0]:
            kept = np.empty(counts[digit], np.int64)
            k = 0
            for i in range(left.shape[0]):
                if (((left[i] ^ _SIGN) >> shift) & digit_mask) == digit:
                    kept[k] = left[i]
                    k += 1
            left = kept
        shift -= _SELECT_BITS


@_jit
def _below_and_tied(values: Any, nth: Any) -> tuple[I64, I64]:
    below = 0
    tied = 0
    for i in range(values.shape[0]):
        if values[i] < nth:
            below += 1
        elif values[i] == nth:
            tied += 1
    out_below = np.empty(below, np.int64)
    out_tied = np.empty(tied, np.int64)
    below = 0
    tied = 0
    for i in range(values.shape[0]):
        if values[i] < nth:
            out_below[below] = i
            below += 1
        elif values[i] == nth:
            out_tied[tied] = i
            tied += 1
    return out_below, out_tied


def split_at_nth_smallest(values: npt.NDArray[Any], n: int) -> tuple[I64, I64]:
    """The positions of ``values`` (float64 without NaN, or int64) below their ``n``-th
    smallest value (``1 <= n <= len(values)``), and those equal to it, each ascending: what
    ``np.partition(values, n - 1)[n - 1]`` and two comparisons give, by a radix select and two
    passes without the GIL. An eviction round splits a virtual table's ~250,000 live rows by
    their statistics: ~1.2 ms where numpy's partition takes ~2.5 ms on the tier worker's host
    (numpy's is the faster below ~30,000 values, a round's cost either way). Without numba,
    numpy's."""
    if not 1 <= n <= len(values):
        raise ValueError(f"n={n} out of range [1, {len(values)}]")
    if NUMBA_AVAILABLE and values.dtype in (np.float64, np.int64):
        values = np.ascontiguousarray(values)
        if values.dtype == np.float64:
            key = _nth_key(_order_keys(values), n - 1)
            bits = key if key >= 0 else key ^ _LOW_63  # (the inverse of _order_keys)
            nth: Any = np.array([bits], np.int64).view(np.float64)[0]
        else:
            nth = _nth_key(values, n - 1)
        return _below_and_tied(values, nth)
    nth = np.partition(values, n - 1)[n - 1]
    below = np.flatnonzero(values < nth).astype(np.int64)
    tied = np.flatnonzero(values == nth).astype(np.int64)
    return below, tied
