"""Bookkeeping for one table's row cache: which row sits in which slot, what to load and evict.

The cache itself (the rows' weights and optimizer state) lives in the fused kernel's tensors;
this class only decides placement. For each batch it maps the batch's unique row ids to slots,
and returns a :class:`CachePlan` saying which rows must be read from the tier and which resident
rows must be evicted (and, if dirty, written back first). The caller moves the data.

The id -> slot map is a dense int32 vector over the table's rows: 4 bytes per row, about 1.5% of
a dim-64 float32 row with its optimizer state, and a single gather per batch.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

import torch

from torchrec_mtrains.cache.policies import CachePolicy, make_policy

logger: logging.Logger = logging.getLogger(__name__)


class CacheTooSmallError(ValueError):
    """A batch needs more distinct rows than the cache can hold at once."""


@dataclass
class CacheStats:
    """Per-table cache counters (rows, not bytes)."""

    lookups: int = 0  # unique ids presented, summed over batches
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    writebacks: int = 0  # dirty evicted rows written to the tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    def as_dict(self) -> dict[str, float]:
        d: dict[str, float] = {k: float(v) for k, v in asdict(self).items()}
        d["hit_rate"] = self.hit_rate
        return d


@dataclass(frozen=True)
class CachePlan:
    """What to do to make one batch's rows resident.

    Attributes:
        slots: slot of each requested unique id, aligned with the ids given to ``plan``.
        load_ids / load_slots: rows to read from the tier into these slots.
        evict_ids / evict_slots: resident rows leaving the cache (``load_slots`` reuse them).
        evict_dirty: which evicted rows were modified and must be written back first.
    """

    slots: torch.Tensor
    load_ids: torch.Tensor
    load_slots: torch.Tensor
    evict_ids: torch.Tensor
    evict_slots: torch.Tensor
    evict_dirty: torch.Tensor


class TableCache:
    """Slot map and eviction decisions for one table (shard) of ``num_rows`` rows.

    Args:
        table: name used in error messages.
        num_rows: rows in the table shard.
        num_slots: cache capacity in rows.
        policy: eviction policy name (see ``POLICIES``) or instance.

    Example::

        cache = TableCache("t0", num_rows=1_000_000, num_slots=10_000, policy="lru")
        plan = cache.plan(torch.tensor([5, 17, 99]))
        # write back plan.evict_ids[plan.evict_dirty], then read plan.load_ids into plan.load_slots
    """

    def __init__(
        self, table: str, num_rows: int, num_slots: int, policy: str | CachePolicy = "lru"
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"table {table!r}: cache must hold at least one row, got {num_slots}")
        self.table = table
        self.num_rows = num_rows
        self.num_slots = num_slots
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        self.id_to_slot = torch.full((num_rows,), -1, dtype=torch.int32)
        self.slot_to_id = torch.full((num_slots,), -1, dtype=torch.int64)
        self.dirty = torch.zeros(num_slots, dtype=torch.bool)
        self.pinned = torch.zeros(num_slots, dtype=torch.bool)
        # Reference counts of batches in flight that still need a slot (look-ahead pipeline).
        self.holds = torch.zeros(num_slots, dtype=torch.int32)
        # pinned | held, kept up to date (only the slots a call touches) so the per-batch
        # capacity check and hold/release cost O(batch), not O(cache).
        self._reserved = torch.zeros(num_slots, dtype=torch.bool)
        self._num_reserved = 0
        # Slots never filled (or emptied by clear()): once the cache is full, planning skips
        # looking for them.
        self._num_free = num_slots
        self.stats = CacheStats()
        self._step = 0

    # ----------------------------------------------------------------------------- planning

    def plan(self, ids: torch.Tensor, *, count_stats: bool = True) -> CachePlan:
        """Assigns slots to the unique row ids ``ids`` and updates the maps as if the plan's
        loads and evictions had happened. The caller must carry them out before using the
        slots (write back dirty victims, then load)."""
        ids = ids.to(torch.int64)
        slots = self.id_to_slot[ids].to(torch.int64)
        hit = slots >= 0
        miss_ids = ids[~hit]
        n_miss = int(miss_ids.numel())
        # Refuse before touching anything (maps, policy, counters): the batch never happened.
        error = self._capacity_error(ids, slots, hit)
        if error is not None:
            raise error
        self._step += 1
        if count_stats:
            self.stats.lookups += int(ids.numel())
            self.stats.misses += n_miss
            self.stats.hits += int(ids.numel()) - n_miss
        empty = torch.empty(0, dtype=torch.int64)
        if n_miss == 0:
            self.policy.on_access(slots, self._step)
            return CachePlan(slots, empty, empty, empty, empty, torch.empty(0, dtype=torch.bool))

        protected = self._reserved.clone()
        protected[slots[hit]] = True
        free = torch.nonzero(self.slot_to_id < 0).flatten() if self._num_free else empty
        load_slots = free[:n_miss]
        self._num_free -= int(load_slots.numel())
        n_evict = n_miss - int(load_slots.numel())
        if n_evict > 0:
            protected[free] = True
            victims = self.policy.choose_victims(n_evict, protected)
            load_slots = torch.cat([load_slots, victims])
        else:
            victims = empty
        evict_ids = self.slot_to_id[victims]
        evict_dirty = self.dirty[victims].clone()

        # Update the maps: victims leave, misses arrive.
        self.id_to_slot[evict_ids] = -1
        self.id_to_slot[miss_ids] = load_slots.to(torch.int32)
        self.slot_to_id[load_slots] = miss_ids
        self.dirty[load_slots] = False
        self.policy.on_insert(load_slots, self._step)
        slots[~hit] = load_slots
        self.policy.on_access(slots, self._step)
        if count_stats:
            self.stats.evictions += int(victims.numel())
            self.stats.writebacks += int(evict_dirty.sum())
        return CachePlan(slots, miss_ids, load_slots, evict_ids, victims, evict_dirty)

    def check_fits(self, ids: torch.Tensor) -> None:
        """Raises :class:`CacheTooSmallError` if :meth:`plan` would refuse the unique row ids
        ``ids``; changes nothing. Lets a caller check every table before planning any."""
        ids = ids.to(torch.int64)
        slots = self.id_to_slot[ids].to(torch.int64)
        error = self._capacity_error(ids, slots, slots >= 0)
        if error is not None:
            raise error

    def _capacity_error(
        self, ids: torch.Tensor, slots: torch.Tensor, hit: torch.Tensor
    ) -> CacheTooSmallError | None:
        """The error :meth:`plan` raises when the misses of ``ids`` cannot all get a slot.

        Slots not available to the misses are the reserved ones (pinned or held) and this
        batch's own hits; free and evictable slots are everything else."""
        n_miss = int(ids.numel()) - int(hit.sum())
        if n_miss == 0:
            return None
        hit_unreserved = int((~self._reserved[slots[hit]]).sum())
        available = self.num_slots - self._num_reserved - hit_unreserved
        if n_miss <= available:
            return None
        others = self._num_reserved - (int(hit.sum()) - hit_unreserved)
        return CacheTooSmallError(
            f"table {self.table!r}: cache of {self.num_slots} rows cannot hold this batch: "
            f"it needs {int(ids.numel())} unique rows at once while {others} slots are "
            f"pinned or held by batches in flight; a cache of at least "
            f"{int(ids.numel()) + others} rows is needed"
        )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids``, -1 where not resident. Does not touch the policy."""
        return self.id_to_slot[ids.to(torch.int64)].to(torch.int64)

    # --------------------------------------------------------------------------- mutations

    def mark_dirty(self, slots: torch.Tensor) -> None:
        self.dirty[slots] = True

    def hold(self, slots: torch.Tensor) -> None:
        """Protects ``slots`` from eviction until a matching :meth:`release` (rows of batches
        between their forward and backward, or prefetched for a batch not yet run)."""
        self.holds.index_add_(0, slots, torch.ones_like(slots, dtype=torch.int32))
        self._update_reserved(slots)

    def release(self, slots: torch.Tensor) -> None:
        self.holds.index_add_(0, slots, -torch.ones_like(slots, dtype=torch.int32))
        self._update_reserved(slots)

    def pin(self, slots: torch.Tensor) -> None:
        """Makes ``slots`` permanently resident (the profiled hot set)."""
        self.pinned[slots] = True
        self._update_reserved(slots)

    def _update_reserved(self, slots: torch.Tensor | None = None) -> None:
        """Recomputes ``pinned | held`` on ``slots`` (every slot when ``None``)."""
        if slots is None:
            torch.logical_or(self.pinned, self.holds > 0, out=self._reserved)
            self._num_reserved = int(self._reserved.sum())
            return
        slots = torch.unique(slots)  # a repeated slot must count once
        now = self.pinned[slots] | (self.holds[slots] > 0)
        self._num_reserved += int(now.sum()) - int(self._reserved[slots].sum())
        self._reserved[slots] = now

    def resident(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(ids, slots)`` of every resident row."""
        slots = torch.nonzero(self.slot_to_id >= 0).flatten()
        return self.slot_to_id[slots], slots

    def dirty_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(ids, slots)`` of resident rows modified since they were loaded/flushed."""
        slots = torch.nonzero(self.dirty).flatten()
        return self.slot_to_id[slots], slots

    def mark_clean(self, slots: torch.Tensor | None = None) -> None:
        if slots is None:
            self.dirty.zero_()
        else:
            self.dirty[slots] = False

    def clear(self) -> None:
        """Forgets every resident row (their cached values are dropped, not written back)."""
        self.id_to_slot.fill_(-1)
        self.slot_to_id.fill_(-1)
        self.dirty.zero_()
        self.pinned.zero_()
        self.holds.zero_()
        self._update_reserved()
        self._num_free = self.num_slots
        self.policy = make_policy(self.policy.name, self.num_slots)

    @property
    def num_resident(self) -> int:
        return int((self.slot_to_id >= 0).sum())
