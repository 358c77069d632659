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
import time
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from torchrec_mtrains.cache import kernels
from torchrec_mtrains.cache.policies import (
    DEFAULT_POLICY,
    CachePolicy,
    RecencyFrequencyPolicy,
    make_policy,
)

logger: logging.Logger = logging.getLogger(__name__)


BACKENDS = ("auto", "numba", "torch")


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


class _Views(NamedTuple):
    """numpy views of a cache's CPU tensors (and its scratch flags), for the compiled kernels.
    Made once: the tensors are only ever updated in place."""

    id_to_slot: np.ndarray
    slot_to_id: np.ndarray
    dirty: np.ndarray
    pinned: np.ndarray
    holds: np.ndarray
    reserved: np.ndarray
    mark: np.ndarray


_KERNELS_READY = False


def compile_kernels() -> float:
    """Compiles the row caches' numba kernels (and the tier worker's distinct-id kernel) for
    this process, or loads them from numba's cache of earlier runs, by planning a few batches
    on two tiny caches (LRU and LFU): what
    the first batches of training would otherwise wait for, counted as tier stall. Runs once a
    process; later calls, and calls without numba, return at once.

    Returns:
        The seconds it took (0.0 when there was nothing to do).
    """
    global _KERNELS_READY
    if _KERNELS_READY or not kernels.NUMBA_AVAILABLE:
        return 0.0
    started = time.perf_counter()
    for policy in ("lru", "lfu"):
        cache = TableCache("kernels", num_rows=16, num_slots=4, policy=policy, backend="numba")
        for batch in ([1, 2], [2, 3, 4], [5, 6], [1, 7, 8]):  # hits, misses, evictions
            ids = torch.tensor(batch, dtype=torch.int64)
            cache.check_fits(ids)
            plan = cache.plan(ids)
            cache.hold(plan.slots)
            cache.mark_dirty(plan.slots)
            cache.release(plan.slots)
        cache.pin(cache.plan(torch.tensor([9], dtype=torch.int64)).slots)
        cache.clear()
    kernels.unique_with_inverse(np.array([3, 1, 3], dtype=np.int64))  # a batch's distinct ids
    _KERNELS_READY = True
    seconds = time.perf_counter() - started
    logger.info("row-cache kernels ready in %.1f s (numba keeps them for later runs)", seconds)
    return seconds


class TableCache:
    """Slot map and eviction decisions for one table (shard) of ``num_rows`` rows.

    Args:
        table: name used in error messages.
        num_rows: rows in the table shard.
        num_slots: cache capacity in rows.
        policy: eviction policy name (see ``POLICIES``) or instance (on ``device``).
        device: where the bookkeeping tensors live (CPU unless given).
        backend: ``"numba"``: compiled kernels that run each call without the GIL (CPU
            bookkeeping, the built-in policies); ``"torch"``: vectorized torch ops, on any
            device and with any policy; ``"auto"``: numba where possible, else torch. Both give
            the same plans and state.

    Example::

        cache = TableCache("t0", num_rows=1_000_000, num_slots=10_000, policy="lru")
        plan = cache.plan(torch.tensor([5, 17, 99]))
        # write back plan.evict_ids[plan.evict_dirty], then read plan.load_ids into plan.load_slots
    """

    def __init__(
        self,
        table: str,
        num_rows: int,
        num_slots: int,
        policy: str | CachePolicy = DEFAULT_POLICY,
        *,
        device: torch.device | str | None = None,
        backend: str = "auto",
    ) -> None:
        if num_slots <= 0:
            raise ValueError(f"table {table!r}: cache must hold at least one row, got {num_slots}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.table = table
        self.num_rows = num_rows
        self.num_slots = num_slots
        self.device = torch.device("cpu" if device is None else device)
        self._want_kernels = None if backend == "auto" else backend == "numba"
        self.policy = self._new_policy(policy)
        if self.policy.device != self.device:
            raise ValueError(
                f"table {table!r}: policy state on {self.policy.device}, bookkeeping on "
                f"{self.device}"
            )
        kernels_ok = isinstance(self.policy, RecencyFrequencyPolicy) and self.policy.uses_kernels
        if backend == "numba" and not kernels_ok:
            raise ValueError(
                f"table {table!r}: the numba backend needs numba, CPU bookkeeping and a built-in "
                f"policy (device {self.device}, policy {self.policy.name!r})"
            )
        self.backend = "numba" if kernels_ok and backend != "torch" else "torch"
        on = self.device
        self.id_to_slot = torch.full((num_rows,), -1, dtype=torch.int32, device=on)
        self.slot_to_id = torch.full((num_slots,), -1, dtype=torch.int64, device=on)
        self.dirty = torch.zeros(num_slots, dtype=torch.bool, device=on)
        self.pinned = torch.zeros(num_slots, dtype=torch.bool, device=on)
        # Reference counts of batches in flight that still need a slot (look-ahead pipeline).
        self.holds = torch.zeros(num_slots, dtype=torch.int32, device=on)
        # pinned | held, kept up to date (only the slots a call touches) so the per-batch
        # capacity check and hold/release cost O(batch), not O(cache).
        self._reserved = torch.zeros(num_slots, dtype=torch.bool, device=on)
        self._num_reserved = 0
        # Slots never filled (or emptied by clear()). Free slots are taken in ascending order
        # and only clear() empties slots, so they are always the last ``_num_free`` slots.
        self._num_free = num_slots
        self.stats = CacheStats()
        self._step = 0
        # The numba backend's arrays, made once (the per-call glue holds the GIL), with a
        # scratch flag per slot (all false between calls).
        self._np: _Views | None = None
        if self.backend == "numba":
            self._np = _Views(
                self.id_to_slot.numpy(),
                self.slot_to_id.numpy(),
                self.dirty.numpy(),
                self.pinned.numpy(),
                self.holds.numpy(),
                self._reserved.numpy(),
                np.zeros(num_slots, dtype=np.bool_),
            )

    def _new_policy(self, policy: str | CachePolicy) -> CachePolicy:
        if not isinstance(policy, str):
            return policy
        return make_policy(
            policy, self.num_slots, device=self.device, use_kernels=self._want_kernels
        )

    # ----------------------------------------------------------------------------- planning

    def plan(self, ids: torch.Tensor, *, count_stats: bool = True) -> CachePlan:
        """Assigns slots to the unique row ids ``ids`` and updates the maps as if the plan's
        loads and evictions had happened. The caller must carry them out before using the
        slots (write back dirty victims, then load).

        Misses take the free slots first (ascending), then victims in the policy's order
        (:func:`~torchrec_mtrains.cache.policies.select_lowest`), in the order of ``ids``. A
        batch that does not fit raises :class:`CacheTooSmallError` and changes nothing."""
        ids = self._int64(ids)
        step = self._step + 1
        v = self._np
        if v is not None:
            plan, n_dirty = self._plan_kernels(ids, step, v)
        else:
            plan, n_dirty = self._plan_torch(ids, step)
        self._step = step
        if count_stats:
            n, n_miss = int(ids.numel()), int(plan.load_ids.numel())
            self.stats.lookups += n
            self.stats.misses += n_miss
            self.stats.hits += n - n_miss
            self.stats.evictions += int(plan.evict_slots.numel())
            self.stats.writebacks += n_dirty
        return plan

    def _plan_torch(self, ids: torch.Tensor, step: int) -> tuple[CachePlan, int]:
        """:meth:`plan` in torch ops (any device, any policy); the reference semantics."""
        self._check_ids(ids)
        slots = self.id_to_slot[ids].to(torch.int64)
        hit = slots >= 0
        miss_ids = ids[~hit]
        n_miss = int(miss_ids.numel())
        # Refuse before touching anything (maps, policy, counters): the batch never happened.
        error = self._capacity_error(ids, slots, hit)
        if error is not None:
            raise error
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        if n_miss == 0:
            self.policy.on_access(slots, step)
            return CachePlan(slots, empty, empty, empty, empty, empty.to(torch.bool)), 0

        first_free = self.num_slots - self._num_free
        n_free = min(n_miss, self._num_free)
        load_slots = torch.arange(first_free, first_free + n_free, device=self.device)
        self._num_free -= n_free
        if n_miss > n_free:
            # Protected besides the reserved slots: this batch's hits and the free slots it
            # fills (all of them: they did not suffice).
            protected = self._reserved.clone()
            protected[slots[hit]] = True
            protected[load_slots] = True
            victims = self.policy.choose_victims(n_miss - n_free, protected)
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
        self.policy.on_insert(load_slots, step)
        slots[~hit] = load_slots
        self.policy.on_access(slots, step)
        plan = CachePlan(slots, miss_ids, load_slots, evict_ids, victims, evict_dirty)
        return plan, int(evict_dirty.sum())

    def _plan_kernels(self, ids: torch.Tensor, step: int, v: _Views) -> tuple[CachePlan, int]:
        """:meth:`plan` in one compiled call that releases the GIL (CPU, built-in policies)."""
        policy = self.policy
        assert isinstance(policy, RecencyFrequencyPolicy)
        assert policy.lists is not None
        lists = policy.lists
        ids_np = ids.contiguous().numpy()
        (status, n_miss, hit_unreserved, extra, accesses, slots, load_ids, load_slots, evict_ids,
         evict_dirty) = kernels.plan(
            ids_np,
            step,
            self._num_free,
            self._num_reserved,
            v.id_to_slot,
            v.slot_to_id,
            v.dirty,
            v.reserved,
            v.mark,
            lists.last_use,
            lists.count,
            lists.prev,
            lists.next,
            lists.head,
            lists.tail,
            policy._accesses_since_decay,
            policy._decay_interval,
        )  # fmt: skip
        if status == kernels.BAD_INDEX:
            raise self._bad_id(extra)
        if status == kernels.NO_ROOM:
            raise self._no_room(int(ids.numel()), n_miss, hit_unreserved)
        if status != kernels.OK:
            raise RuntimeError(f"table {self.table!r}: cache bookkeeping is inconsistent")
        policy._accesses_since_decay = accesses
        self._num_free -= extra
        evict_slots = load_slots[extra:]
        plan = CachePlan(
            torch.from_numpy(slots),
            torch.from_numpy(load_ids),
            torch.from_numpy(load_slots),
            torch.from_numpy(evict_ids),
            torch.from_numpy(evict_slots),
            torch.from_numpy(evict_dirty),
        )
        return plan, int(np.count_nonzero(evict_dirty))

    def check_fits(self, ids: torch.Tensor) -> None:
        """Raises :class:`CacheTooSmallError` if :meth:`plan` would refuse the unique row ids
        ``ids``; changes nothing. Lets a caller check every table before planning any."""
        ids = self._int64(ids)
        v = self._np
        if v is not None:
            status, n_miss, hit_unreserved, bad = kernels.capacity(
                ids.contiguous().numpy(), v.id_to_slot, v.reserved
            )
            if status == kernels.BAD_INDEX:
                raise self._bad_id(bad)
            if n_miss > self.num_slots - self._num_reserved - hit_unreserved:
                raise self._no_room(int(ids.numel()), n_miss, hit_unreserved)
            return
        self._check_ids(ids)
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
        if n_miss <= self.num_slots - self._num_reserved - hit_unreserved:
            return None
        return self._no_room(int(ids.numel()), n_miss, hit_unreserved)

    def _no_room(self, n_ids: int, n_miss: int, hit_unreserved: int) -> CacheTooSmallError:
        others = self._num_reserved - (n_ids - n_miss - hit_unreserved)
        return CacheTooSmallError(
            f"table {self.table!r}: cache of {self.num_slots} rows cannot hold this batch: "
            f"it needs {n_ids} unique rows at once while {others} slots are "
            f"pinned or held by batches in flight; a cache of at least "
            f"{n_ids + others} rows is needed"
        )

    def _int64(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as int64 on the bookkeeping device, without a torch call (each can hand the GIL
        to another thread and wait to get it back) when it already is."""
        if t.dtype == torch.int64 and t.device == self.device:
            return t
        return t.to(self.device, torch.int64)

    def _check_ids(self, ids: torch.Tensor) -> None:
        """Refuses ids out of range (torch would wrap negative ones around), as the kernels do."""
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= self.num_rows:
                raise self._bad_id(int(ids[(ids < 0) | (ids >= self.num_rows)][0]))

    def _bad_id(self, row: int) -> IndexError:
        """The error for the first id of a call that is out of range."""
        return IndexError(f"table {self.table!r}: row id {row} out of range [0, {self.num_rows})")

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids``, -1 where not resident. Does not touch the policy."""
        return self.id_to_slot[ids.to(self.device, torch.int64)].to(torch.int64)

    def host_slot_maps(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_]]:
        """``(id_to_slot, reserved)`` as numpy views, for compiled scans on the host: each
        row's slot (-1: not resident) and whether each slot is pinned or held. Views, not
        copies: read them under whatever guards the cache against concurrent planning."""
        if self.device.type != "cpu":
            raise ValueError(f"table {self.table!r}: the cache's bookkeeping is on {self.device}")
        return self.id_to_slot.numpy(), self._reserved.numpy()

    # --------------------------------------------------------------------------- mutations

    def mark_dirty(self, slots: torch.Tensor) -> None:
        self.dirty[slots] = True

    def hold(self, slots: torch.Tensor) -> None:
        """Protects ``slots`` from eviction until a matching :meth:`release` (rows of batches
        between their forward and backward, or prefetched for a batch not yet run)."""
        self._add_holds(slots, 1)

    def release(self, slots: torch.Tensor) -> None:
        self._add_holds(slots, -1)

    def _add_holds(self, slots: torch.Tensor, delta: int) -> None:
        v = self._np
        if v is not None:
            status, change = kernels.hold(
                self._int64(slots).contiguous().numpy(), delta, v.holds, v.pinned, v.reserved
            )
            if status != kernels.OK:
                raise IndexError(f"table {self.table!r}: slot out of range [0, {self.num_slots})")
            self._num_reserved += change
            return
        self.holds.index_add_(0, slots, torch.full_like(slots, delta, dtype=torch.int32))
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
        self.policy = self._new_policy(self.policy.name)

    @property
    def num_resident(self) -> int:
        return int((self.slot_to_id >= 0).sum())
