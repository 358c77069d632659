"""The id -> row map of a virtual table shard: which row of its store holds each live id.

A virtual table's ids come from a space of up to 2**50, far past any file, so its store holds
``capacity`` rows (the table's bound on live rows) and this map assigns one to each id when the
id is first trained, and takes it back when the id is evicted. Everything under it (the row
cache, the tiers, checkpoints of the store) then sees a dense table of ``capacity`` rows.

The map is an open-addressing hash table with linear probing (deletion by backward shift, so
no tombstones pile up under churn), sized to a power of two at least twice the capacity, and a
stack of free rows. A batch's unique ids are looked up, and the new ones given rows, in one
compiled call without the GIL (the tier-I/O worker plans batches beside the training thread);
without numba the same functions run as Python.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.cache.kernels import _jit, home_slot

I64 = npt.NDArray[np.int64]

EMPTY = -1  # a free hash slot (ids are never negative)
NO_ROW = -1  # lookup of an absent id
_MIN_SLOTS = 16


def _slots_for(capacity: int) -> int:
    return max(_MIN_SLOTS, 1 << (2 * capacity - 1).bit_length())


def map_bytes(capacity: int) -> int:
    """Host memory of a :class:`VirtualRowMap` of ``capacity`` rows, with the eviction
    statistics kept beside it (two float64 per row): what a plan sets aside for it."""
    return _slots_for(capacity) * 16 + capacity * (8 + 8 + 16)


class VirtualTableFullError(RuntimeError):
    """A batch brings more new ids than a virtual table shard has free rows."""


@_jit
def _find(keys: I64, rows: I64, ids: I64, out: I64) -> None:
    mask = keys.shape[0] - 1
    for i in range(ids.shape[0]):
        key = ids[i]
        s = home_slot(key, mask)
        out[i] = NO_ROW
        while keys[s] != EMPTY:
            if keys[s] == key:
                out[i] = rows[s]
                break
            s = (s + 1) & mask


@_jit
def _insert(
    keys: I64, rows: I64, row_ids: I64, free: I64, nfree: int, ids: I64, out: I64, made: I64
) -> int:
    """Looks up each of ``ids`` (unique), giving each absent one the top free row. Writes the
    rows to ``out``, the positions of the new ids to ``made``; returns how many were made.
    The caller has checked there are enough free rows."""
    mask = keys.shape[0] - 1
    count = 0
    for i in range(ids.shape[0]):
        key = ids[i]
        s = home_slot(key, mask)
        while keys[s] != EMPTY and keys[s] != key:
            s = (s + 1) & mask
        if keys[s] == key:
            out[i] = rows[s]
            continue
        nfree -= 1
        row = free[nfree]
        keys[s] = key
        rows[s] = row
        row_ids[row] = key
        out[i] = row
        made[count] = i
        count += 1
    return count


@_jit
def _by_home_region(ids: I64, mask: int, shift: int) -> I64:
    """The positions of ``ids`` ordered by the region of the table their home slot lies in
    (the slot's bits above ``shift``; a counting sort, stable within a region)."""
    n = ids.shape[0]
    regions = (mask >> shift) + 1
    start = np.zeros(regions + 1, dtype=np.int64)
    home = np.empty(n, dtype=np.int64)
    for i in range(n):
        home[i] = home_slot(ids[i], mask) >> shift
        start[home[i] + 1] += 1
    for r in range(regions):
        start[r + 1] += start[r]
    order = np.empty(n, dtype=np.int64)
    for i in range(n):
        order[start[home[i]]] = i
        start[home[i]] += 1
    return order


@_jit
def _remove(
    keys: I64, rows: I64, row_ids: I64, free: I64, nfree: int, ids: I64, out: I64, shift: int
) -> int:
    """Removes each of ``ids`` (unique) present, pushing its row on the free stack in the ids'
    order; writes the freed rows (``NO_ROW`` for an absent id) to ``out`` and returns the new
    free count.

    The ids are visited by the region of their home slot (:func:`_by_home_region`): a round
    removes a quarter of the live ids, which in their given order would send each probe to a
    random place of the table; by region, neighbouring probes touch neighbouring memory. The
    table comes out the same whatever the order (a backward shift leaves it as if the removed
    id had never been inserted), and so do ``out`` and the free stack."""
    mask = keys.shape[0] - 1
    order = _by_home_region(ids, mask, shift)
    for j in range(ids.shape[0]):
        i = order[j]
        key = ids[i]
        s = home_slot(key, mask)
        while keys[s] != EMPTY and keys[s] != key:
            s = (s + 1) & mask
        if keys[s] == EMPTY:
            out[i] = NO_ROW
            continue
        row = rows[s]
        out[i] = row
        row_ids[row] = EMPTY
        # Backward shift: pull later entries of the probe run into the hole when their home
        # slot does not lie cyclically in (hole, their slot].
        hole = s
        t = (s + 1) & mask
        while keys[t] != EMPTY:
            home = home_slot(keys[t], mask)
            # (home in the cyclic range (hole, t]: the entry cannot move before its home)
            stays = (hole < home <= t) if hole < t else (home > hole or home <= t)
            if not stays:
                keys[hole] = keys[t]
                rows[hole] = rows[t]
                hole = t
            t = (t + 1) & mask
        keys[hole] = EMPTY
    for i in range(ids.shape[0]):
        if out[i] != NO_ROW:
            free[nfree] = out[i]
            nfree += 1
    return nfree


def _region_shift(slots: int, ids: int) -> int:
    """The slot bits below a region for :func:`_remove`: one or two ids a region on average
    (at least one slot a region, at most the whole table one region)."""
    slot_bits = slots.bit_length() - 1
    region_bits = max(0, min(slot_bits, ids.bit_length() - 1))
    return slot_bits - region_bits


class VirtualRowMap:
    """Live ids of one virtual table shard and the store row each one holds.

    Args:
        table: the table's name (for errors).
        capacity: rows of the shard's store, the most ids live at once.
    """

    def __init__(self, table: str, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"virtual table {table!r}: capacity must be at least 1 row")
        self.table = table
        self.capacity = capacity
        slots = _slots_for(capacity)
        self._keys = np.full(slots, EMPTY, dtype=np.int64)
        self._rows = np.zeros(slots, dtype=np.int64)
        # Rows are handed out from the top of the stack: 0, 1, 2, ... on a fresh map.
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)
        self._nfree = capacity
        self.row_ids = np.full(capacity, EMPTY, dtype=np.int64)  # id held by each row

    def __len__(self) -> int:
        return self.capacity - self._nfree

    @property
    def free_rows(self) -> int:
        return self._nfree

    def lookup(self, ids: I64) -> I64:
        """The row of each id, ``NO_ROW`` where it is not live."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty_like(ids)
        _find(self._keys, self._rows, ids, out)
        return out

    def assign(
        self, ids: I64, option: str = "max_live_rows", rows: I64 | None = None
    ) -> tuple[I64, I64]:
        """Rows for ``ids`` (unique), giving new ids free rows. Returns the rows and the
        positions in ``ids`` of the ids that were new. Refuses, changing nothing, when the new
        ids outnumber the free rows (the error names the table and ``option``). ``rows``:
        their :meth:`lookup`, when the caller has it (and changed no id since)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        if rows is None:
            rows = np.empty_like(ids)
            _find(self._keys, self._rows, ids, rows)
        else:
            rows = rows.copy()
        new = int((rows == NO_ROW).sum())
        if new > self._nfree:
            raise VirtualTableFullError(
                f"virtual table {self.table!r}: a batch brings {new} new ids but only "
                f"{self._nfree} of its {self.capacity} rows are free; raise {option} or evict "
                "(a virtual_table_eviction_policy)"
            )
        made = np.empty(new, dtype=np.int64)
        if new:
            count = _insert(
                self._keys, self._rows, self.row_ids, self._free, self._nfree, ids, rows, made
            )
            self._nfree -= count
        return rows, made

    def remove(self, ids: I64) -> I64:
        """Frees the rows of ``ids`` (unique); returns them (``NO_ROW`` for ids not live)."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty_like(ids)
        shift = _region_shift(len(self._keys), len(ids))
        self._nfree = int(
            _remove(self._keys, self._rows, self.row_ids, self._free, self._nfree, ids, out, shift)
        )
        return out

    def live(self) -> tuple[I64, I64]:
        """Every live id and its row, in row order."""
        rows = np.flatnonzero(self.row_ids != EMPTY).astype(np.int64)
        return self.row_ids[rows].copy(), rows
