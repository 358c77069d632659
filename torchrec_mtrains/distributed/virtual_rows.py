"""The rows of one virtual table shard: which store row each live id holds, which ids are made
and which are evicted, batch by batch.

:class:`~torchrec_mtrains.distributed.tiered_tables.TieredTableGroup` calls
:meth:`VirtualRows.assign` while it plans a batch (on the tier-I/O worker, in batch order):
ids become store rows, after an eviction round when one is due (see
:mod:`~torchrec_mtrains.distributed.virtual_eviction`). A new id's row is never read from the
tier: the group writes its initial values (:meth:`initial_rows`) straight into its cache slot,
marked dirty, so it reaches the tier when the cache writes it back. An evicted id's row keeps
whatever the cache or the tier held until a new id takes it and is filled the same way.

An evaluated batch (planned while the module is not training) changes nothing a checkpoint or
an eviction round sees, as fbgemm's SSD embedding kernels write nothing to their table in
evaluation: its ids' statistics stay, it counts for no trigger, and an id it looks up that has
no row gets a *provisional* one (its initial values, in the cache only) that the table takes
back when the last batch holding it is released, unless a training batch trained it first. A
round runs for an evaluated batch only when its new ids do not fit the free rows otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from torchrec_mtrains.cache.id_map import EMPTY, NO_ROW, VirtualRowMap
from torchrec_mtrains.cache.kernels import NUMBA_AVAILABLE, _jit
from torchrec_mtrains.cache.table_cache import TableCache
from torchrec_mtrains.distributed.virtual_eviction import (
    Clock,
    ShardEviction,
    split_at_nth_smallest,
)
from torchrec_mtrains.distributed.virtual_tables import OPTION, VirtualShard
from torchrec_mtrains.tiers.base import RowStore

I64 = npt.NDArray[np.int64]
Flags = npt.NDArray[np.bool_]

_NO_POSITIONS = torch.empty(0, dtype=torch.int64)

PROTECTED_BATCHES = 5
"""An eviction round spares the rows of the batch being planned and of the batches planned
just before it, this many in all: so a round decides the same with or without the look-ahead
pipeline (up to 3 batches ahead, whose rows are still in flight: held, or not yet trained), and
a run trains the same either way."""


@dataclass
class EvictionRecord:
    """Ids one round evicted (global ids), and the batch it ran for (the group's count of
    planned batches, from 1)."""

    batch: int
    ids: I64


@dataclass
class ShardChanges:
    """What changed in a virtual table shard since its changes were last cleared (the last
    checkpoint), beyond the rows training wrote: rows given to an id, looked up or loaded
    (whose statistics moved), the ids evicted, and the eviction rounds and batches since."""

    touched: npt.NDArray[np.bool_]
    evicted: list[I64] = field(default_factory=list)
    rounds_before: int = 0
    batches_before: int = 0

    def evicted_ids(self) -> I64:
        """The shard-local ids evicted since, each once."""
        if not self.evicted:
            return np.empty(0, dtype=np.int64)
        return np.unique(np.concatenate(self.evicted))


@dataclass(frozen=True)
class AssignedRows:
    """What :meth:`VirtualRows.assign` did with a batch's unique ids: ``rows``, the store row
    of each; ``made``, the positions of ids given a row now (the caller fills them with their
    initial values); ``kept``, positions of ids an evaluated batch gave a provisional row that
    this training batch trains (filled already: the tier must get them); ``held``, the
    provisional rows this evaluated batch holds until it is released (:meth:`VirtualRows.release`)."""

    rows: torch.Tensor
    made: torch.Tensor
    kept: torch.Tensor
    held: I64
    train: bool
    # (for unassign) how many batches held each kept row
    kept_holds: tuple[int, ...] = ()


@dataclass
class VirtualRows:
    """Live ids, new rows and evictions of one virtual table shard.

    Args:
        name: the table's name.
        space: its id space and spec.
        clock: seconds, for TTL eviction.
    """

    name: str
    space: VirtualShard
    clock: Clock | None = None
    rows_made: int = 0
    history: list[EvictionRecord] | None = field(default=None, repr=False)
    # batches its group planned before this shard existed (a tool's offset for ``history``)
    batches_before: int = 0
    # tracked for incremental checkpoints once asked for (see track_changes)
    changes: ShardChanges | None = field(default=None, repr=False)
    # while a checkpoint of the changes is taken: the store rows it holds (see saving_changes)
    saving: I64 | None = field(default=None, repr=False)
    # store rows evaluated batches gave ids not trained, and how many unreleased batches hold
    # each (see assign and release); touched under the group's cache lock only
    provisional: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.id_map = VirtualRowMap(self.name, self.space.capacity)
        kwargs = {} if self.clock is None else {"clock": self.clock}
        self.eviction = ShardEviction(self.space.spec.eviction, self.space.capacity, **kwargs)

    # --------------------------------------------------------------- changes since a checkpoint

    def track_changes(self) -> None:
        """Starts recording what :class:`ShardChanges` holds (one byte per store row)."""
        if self.changes is None:
            self.changes = ShardChanges(np.zeros(self.space.capacity, dtype=np.bool_))
            self.clear_changes()

    def clear_changes(self) -> None:
        """Nothing changed from now on: a checkpoint (or a load) and the shard agree."""
        if self.changes is not None:
            self.changes.touched[:] = False
            self.changes.evicted.clear()
            self.changes.rounds_before = self.eviction.rounds
            self.changes.batches_before = self.eviction.batches

    def loaded(self, rows: I64, replaced_ids: I64) -> None:
        """A load gave ``rows`` their values and statistics and dropped the shard-local
        ``replaced_ids`` (live before it, perhaps live again after)."""
        if self.changes is not None:
            self.changes.touched[rows] = True
            if replaced_ids.size:
                self.changes.evicted.append(replaced_ids.copy())
        # Loaded rows are rows of their own now; rows whose ids the load dropped are free.
        for row in rows.tolist():
            self.provisional.pop(row, None)
        for row in [r for r in self.provisional if self.id_map.row_ids[r] == EMPTY]:
            del self.provisional[row]

    def changed_live_rows(self, trained: torch.Tensor | None) -> I64:
        """The store rows of live ids that changed since the changes were cleared: rows
        ``trained`` marks (a bool per store row), and rows given, looked up or loaded."""
        assert self.changes is not None
        changed = self.changes.touched.copy()
        if trained is not None:
            changed |= trained.numpy()
        changed &= self.id_map.row_ids != EMPTY
        changed[self._provisional_rows()] = False
        return np.flatnonzero(changed).astype(np.int64)

    # ------------------------------------------------------------------------ live rows

    def _provisional_rows(self) -> I64:
        return np.fromiter(self.provisional, dtype=np.int64, count=len(self.provisional))

    def live(self) -> tuple[I64, I64]:
        """Every live id (shard-local) and its store row, in row order: the rows a checkpoint
        holds (an evaluated batch's provisional rows are not live)."""
        ids, rows = self.id_map.live()
        if self.provisional:
            keep = ~np.isin(rows, self._provisional_rows())
            ids, rows = ids[keep], rows[keep]
        return ids, rows

    def live_rows_of(self, ids: I64) -> I64:
        """The store row of each shard-local id, ``NO_ROW`` where it is not live (provisional
        rows are not)."""
        rows = self.id_map.lookup(ids)
        if self.provisional:
            rows[np.isin(rows, self._provisional_rows())] = NO_ROW
        return rows

    def live_count(self) -> int:
        return len(self.id_map) - len(self.provisional)

    def record_evictions(self) -> None:
        """Keeps every round's evicted ids in :attr:`history` from now on (tests, tools)."""
        if self.history is None:
            self.history = []

    def assign(
        self,
        ids: torch.Tensor,
        cache: TableCache,
        store: RowStore,
        weight_slots: torch.Tensor,
        batch: int,
        train: bool = True,
        values: torch.Tensor | None = None,
    ) -> AssignedRows:
        """The store rows of a batch's unique ``ids`` (shard-local ids), giving new ids free
        rows, after an eviction round when one is due; provisional ones when the batch is
        evaluated (``train`` false, see the module doc). ``values``: how many of the batch's
        values each id is (what a score rule adds up). Refuses, with nothing assigned, a
        batch whose new ids do not fit even after the round."""
        ids_np = ids.numpy()
        rows = self.id_map.lookup(ids_np)
        known = rows != NO_ROW
        new = int((~known).sum())
        live = len(self.id_map)
        if train:
            self.eviction.batches += 1
            due = self.eviction.due(live, new, self.space.capacity)
        else:  # only to make room
            due = self.eviction.rule.evicts and live + new > self.space.capacity
        if due:
            room = live + new - self.space.capacity
            self._evict_round(rows[known], cache, store, weight_slots, batch, room)
        # (a round spares the batch's ids: their lookup still holds)
        assigned, made = self.id_map.assign(ids_np, OPTION, rows)
        provisional = self.provisional
        if not train:
            held_known = [r for r in assigned[known].tolist() if r in provisional]
            for row in held_known:
                provisional[row] += 1
            for row in assigned[made].tolist():
                provisional[row] = 1
            held = np.concatenate([assigned[made], np.asarray(held_known, dtype=np.int64)])
            return AssignedRows(
                torch.from_numpy(assigned), torch.from_numpy(made), _NO_POSITIONS, held, False
            )
        kept = np.empty(0, dtype=np.int64)
        if provisional:
            kept = np.flatnonzero(known & np.isin(assigned, self._provisional_rows()))
        kept_holds = tuple(provisional.pop(row) for row in assigned[kept].tolist())
        if self.changes is not None:
            self.changes.touched[assigned] = True
        fresh = np.zeros(len(assigned), dtype=np.bool_)
        fresh[made] = True
        fresh[kept] = True
        counts = None if values is None else values.numpy()
        self.eviction.touch(assigned[~fresh], None if counts is None else counts[~fresh])
        if fresh.any():
            self.eviction.made(assigned[fresh], None if counts is None else counts[fresh])
            self.rows_made += int(fresh.sum())
        return AssignedRows(
            torch.from_numpy(assigned),
            torch.from_numpy(made),
            torch.from_numpy(kept),
            np.empty(0, dtype=np.int64),
            True,
            kept_holds,
        )

    def unassign(self, ids: torch.Tensor, assigned: AssignedRows) -> None:
        """Takes back what :meth:`assign` just did for a batch's unique ``ids`` (the batch was
        refused later): the rows it made, the provisional rows it held or trained."""
        made_rows = assigned.rows[assigned.made].numpy()
        for row in made_rows.tolist():
            self.provisional.pop(row, None)
        self.id_map.remove(ids[assigned.made].numpy())
        if not assigned.train:  # the rows it made are gone already
            self.release(assigned.held[~np.isin(assigned.held, made_rows)])
            return
        kept_rows = assigned.rows[assigned.kept].tolist()
        self.provisional.update(zip(kept_rows, assigned.kept_holds))
        self.rows_made -= len(made_rows) + len(kept_rows)

    def keep(self, held: I64) -> None:
        """A batch planned for evaluation trains after all: the provisional rows it ``held``
        become rows of their own, as if it had made them."""
        rows = np.asarray([r for r in held.tolist() if self.provisional.pop(r, None)], np.int64)
        if rows.size:
            if self.changes is not None:
                self.changes.touched[rows] = True
            self.eviction.made(rows)
            self.rows_made += int(rows.size)

    def release(self, held: I64) -> None:
        """An evaluated batch is done with the provisional rows it ``held``: those no other
        batch holds (and no training batch trained since) go back to the free rows."""
        gone = []
        for row in held.tolist():
            holds = self.provisional.get(row)
            if holds is None:  # trained since
                continue
            if holds > 1:
                self.provisional[row] = holds - 1
            else:
                del self.provisional[row]
                gone.append(row)
        if gone:
            self.id_map.remove(self.id_map.row_ids[np.asarray(gone, dtype=np.int64)])

    def _evict_round(
        self,
        batch_rows: I64,
        cache: TableCache,
        store: RowStore,
        weight_slots: torch.Tensor,
        batch: int,
        room: int,
    ) -> None:
        """Evicts what the rule says among the live rows that may go
        (:func:`eviction_candidates`; ``batch_rows``: the rows of the batch being planned)."""
        live_ids, live_rows, may_go = eviction_candidates(
            self.id_map, self.eviction, batch_rows, cache
        )

        def l2_norms(rows: I64) -> npt.NDArray[np.float64]:
            return self._l2_norms(rows, cache, store, weight_slots)

        gone = self.eviction.select(live_rows, may_go, l2_norms, room, live_ids)
        if not gone.size:
            return
        gone_ids = self.id_map.row_ids[gone].copy()
        self.id_map.remove(gone_ids)
        if self.changes is not None:
            self.changes.evicted.append(gone_ids)
        if self.history is not None:
            self.history.append(EvictionRecord(batch, gone_ids + self.space.id_offset))

    @staticmethod
    def _l2_norms(
        rows: I64, cache: TableCache, store: RowStore, weight_slots: torch.Tensor
    ) -> npt.NDArray[np.float64]:
        """The weights' L2 norm of ``rows``: from the cache where it holds them (newer than
        the tier), from the tier otherwise. (A row-wise or table-wise shard holds all the
        table's columns: the norm is the row's.)"""
        dim = store.layout.dim
        out = np.empty(rows.shape, dtype=np.float64)
        slots = cache.lookup(torch.from_numpy(rows))
        cached = (slots >= 0).numpy()
        if (~cached).any():
            weights = store.read_rows(rows[~cached])[:, :dim].astype(np.float64)
            out[~cached] = np.sqrt((weights * weights).sum(axis=1))
        if cached.any():
            held = slots[torch.from_numpy(cached)].to(weight_slots.device)
            weights_t = weight_slots.index_select(0, held).to("cpu", torch.float64)
            out[cached] = weights_t.norm(dim=1).numpy()
        return out

    def initial_rows(
        self, ids: torch.Tensor, row_width: int, dim: int, col_offset: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Tier rows (float32: weights, then optimizer state zero) of new shard-local
        ``ids``: the initializer's values at their ids in the table, at the weights' type."""
        rows = torch.zeros(int(ids.numel()), row_width, dtype=torch.float32)
        weights = torch.empty(int(ids.numel()), dim, dtype=dtype)
        self.space.spec.init.fill_ids(weights, ids + self.space.id_offset, col_offset)
        rows[:, :dim] = weights.to(torch.float32)
        return rows

    def stats(self) -> dict[str, float]:
        return {
            "live_rows": float(self.live_count()),
            "max_live_rows": float(self.space.capacity),
            "rows_made": float(self.rows_made),
            "rows_evicted": float(self.eviction.evicted),
            "eviction_rounds": float(self.eviction.rounds),
        }


def eviction_candidates(
    id_map: VirtualRowMap, eviction: ShardEviction, batch_rows: I64, cache: TableCache
) -> tuple[I64, I64, Flags]:
    """Every live id of a shard, its row (ascending) and whether a round may evict it: not
    ``batch_rows`` (the batch being planned), nor rows the ``PROTECTED_BATCHES - 1`` batches
    planned before it used, nor rows a batch in flight holds in the ``cache``. One compiled
    pass over the rows (:func:`_round_candidates`), where numpy's steps (the path without
    numba) took ~6 ms a round on W3."""
    since = eviction.batches - (PROTECTED_BATCHES - 1)
    id_to_slot, reserved = cache.host_slot_maps()
    if NUMBA_AVAILABLE:
        return _round_candidates(
            id_map.row_ids,
            eviction.last_batch,
            since,
            np.ascontiguousarray(batch_rows, dtype=np.int64),
            id_to_slot,
            reserved,
        )
    live_ids, live_rows = id_map.live()
    last = eviction.last_batch[live_rows]
    may_go = ~np.isin(live_rows, batch_rows) & ~((last > 0) & (last >= since))
    slots = id_to_slot[live_rows]
    held = (slots >= 0) & reserved[slots]  # (a slot of -1 reads the last flag, masked out)
    return live_ids, live_rows, may_go & ~held


@_jit
def _round_candidates(
    row_ids: I64,
    last_batch: I64,
    since: int,
    batch_rows: I64,
    id_to_slot: npt.NDArray[np.int32],
    reserved: Flags,
) -> tuple[I64, I64, Flags]:
    """:func:`eviction_candidates`: the live ids (``row_ids`` not ``EMPTY``), their
    rows, and whether each may go: not in ``batch_rows``, not used by a batch from ``since``
    on (``last_batch``, 0: never used), not in a ``reserved`` cache slot."""
    spared = np.zeros(row_ids.shape[0], np.bool_)
    for i in range(batch_rows.shape[0]):
        spared[batch_rows[i]] = True
    n = 0
    for r in range(row_ids.shape[0]):
        if row_ids[r] != EMPTY:
            n += 1
    ids = np.empty(n, np.int64)
    rows = np.empty(n, np.int64)
    may_go = np.empty(n, np.bool_)
    j = 0
    for r in range(row_ids.shape[0]):
        if row_ids[r] == EMPTY:
            continue
        ids[j] = row_ids[r]
        rows[j] = r
        last = last_batch[r]
        go = not spared[r] and not (last > 0 and last >= since)
        slot = id_to_slot[r]
        may_go[j] = go and not (slot >= 0 and reserved[slot])
        j += 1
    return ids, rows, may_go


def compile_round_kernels() -> None:
    """Compiles an eviction round's kernels for this process (or loads them from numba's
    cache of earlier runs) now, not at the first round, mid-training."""
    if not NUMBA_AVAILABLE:
        return
    rows = np.array([0, 1], np.int64)
    _round_candidates(rows, rows, 1, rows[:1], np.array([-1, 0], np.int32), np.zeros(1, np.bool_))
    split_at_nth_smallest(np.array([0.5, 0.25]), 1)
    split_at_nth_smallest(rows, 1)
