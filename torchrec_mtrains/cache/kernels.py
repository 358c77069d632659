"""Compiled kernels of the row cache's per-batch bookkeeping, run without the GIL.

The tier-I/O worker plans batches while the training thread runs Python; planning in Python or
in many small torch calls holds (or keeps re-taking) the GIL, so the two threads share one core.
These numba kernels do a whole table's step (id -> slot gather, capacity check, victim choice,
map and policy updates) in one call with the GIL released. They implement exactly the semantics
of the torch path (``policies.select_lowest`` and the policies' ``on_access`` / ``on_insert``),
which stays the reference and runs wherever the kernels cannot (CUDA bookkeeping, custom
policies, no numba); the tests compare both paths plan by plan.

Victim order without scanning every slot: the slots are kept in doubly linked lists, one per
bucket (the access count for LFU, a single bucket for LRU), each sorted by ``(last_use, slot)``.
Walking the buckets in order from their heads visits slots in ascending
``(count, last_use, slot)`` order, the policies' victim order, so choosing ``k`` victims costs
``k`` plus the protected slots skipped on the way, not the cache size. A step's accessed slots
all get the newest ``last_use``, so moving them (in ascending slot order) to their buckets' tails
keeps every list sorted. LFU's periodic halving of counts merges buckets ``2c`` and ``2c + 1``
into ``c``: linear, once per ``decay_interval`` batches.

Without numba installed, ``NUMBA_AVAILABLE`` is false and the callers use the torch path.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar, cast

import numpy as np
import numpy.typing as npt

numba: Any
try:
    numba = importlib.import_module("numba")  # no type stubs: kept as Any, used only in _jit
except ImportError:  # pragma: no cover - numba is pinned in requirements/*.txt
    numba = None

NUMBA_AVAILABLE: bool = numba is not None

_F = TypeVar("_F", bound=Callable[..., Any])

I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
Flags = npt.NDArray[np.bool_]

NIL = -1  # end of a slot list

# Status codes the kernels return (the wrappers raise the matching Python errors).
OK = 0
NO_ROOM = 1  # the batch's misses cannot all get a slot
BAD_INDEX = 2  # an id or slot outside its range
NO_VICTIMS = 3  # fewer evictable slots than the capacity check counted (a broken invariant)


def _jit(fn: _F) -> _F:
    """``numba.njit(nogil=True, cache=True)``, typed for mypy; the plain function without numba
    (never called then: the callers check ``NUMBA_AVAILABLE``)."""
    if numba is None:  # pragma: no cover
        return fn
    return cast(_F, numba.njit(nogil=True, cache=True)(fn))


@_jit
def splitmix64_word(x: Any) -> Any:
    """SplitMix64's finalizer of one uint64 word (wrapping arithmetic): what virtual tables'
    id maps place ids by and their id-seeded initializer draws from."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# --------------------------------------------------------------------------- slot lists


@_jit
def _requeue(
    slots: I64,
    buckets: I64,
    step: int,
    last_use: I64,
    count: I64,
    prev: I32,
    nxt: I32,
    head: I32,
    tail: I32,
) -> None:
    """Moves each of ``slots`` (ascending, unique) out of its bucket's list (``count[s]``, or
    0 when ``count`` is empty) into bucket ``buckets[i]`` (0 when ``count`` is empty) with
    ``last_use = step``, at its ``(last_use, slot)`` place: found from the tail, which holds
    it at once since every moved slot is the newest. One loop with the list operations written
    out: a call per slot to a separately compiled helper increments and decrements the
    reference count of every array it is passed (atomic operations; numba inlining keeps them),
    which cost the cache's planning more than the moves themselves."""
    counting = count.size > 0
    for i in range(slots.size):
        s = slots[i]
        b = count[s] if counting else 0
        p = prev[s]  # unlink s from bucket b
        q = nxt[s]
        if p == NIL:
            head[b] = q
        else:
            nxt[p] = q
        if q == NIL:
            tail[b] = p
        else:
            prev[q] = p
        last_use[s] = step
        if counting:
            b = buckets[i]
            count[s] = b
        t = tail[b]  # link s into bucket b after the last (last_use, slot) below its own
        while t != NIL and (last_use[t] > step or (last_use[t] == step and t > s)):
            t = prev[t]
        if t == NIL:
            q = head[b]
            head[b] = s
        else:
            q = nxt[t]
            nxt[t] = s
        prev[s] = t
        nxt[s] = q
        if q == NIL:
            tail[b] = s
        else:
            prev[q] = s


@_jit
def build_lists(last_use: I64, count: I64, num_buckets: int) -> tuple[I32, I32, I32, I32]:
    """Links every slot into its bucket (``count[s]``, or 0 when ``count`` is empty) in
    ``(last_use, slot)`` order; returns ``(prev, next, head, tail)``."""
    n = last_use.size
    prev = np.full(n, NIL, np.int32)
    nxt = np.full(n, NIL, np.int32)
    head = np.full(num_buckets, NIL, np.int32)
    tail = np.full(num_buckets, NIL, np.int32)
    order = np.argsort(last_use, kind="mergesort")  # stable: ties stay in slot order
    for i in range(n):
        s = order[i]
        b = count[s] if count.size else 0
        t = tail[b]
        prev[s] = t
        if t == NIL:
            head[b] = s
        else:
            nxt[t] = s
        tail[b] = s
    return prev, nxt, head, tail


@_jit
def _sorted_unique(slots: I64) -> I64:
    """``np.unique(slots)`` by the radix sort (:func:`_radix_sort`: ~0.04 ms for a batch's
    ~11,000 slots, where numba's ``np.sort`` took ~0.5 ms); by numba's sort when a slot is
    negative (an out-of-range slot, which the caller's check refuses after)."""
    lo, hi = 0, 0
    for i in range(slots.size):
        lo = min(lo, slots[i])
        hi = max(hi, slots[i])
    out = np.sort(slots) if lo < 0 else _radix_sort(slots, hi)
    k = 0
    for i in range(out.size):
        if i == 0 or out[i] != out[i - 1]:
            out[k] = out[i]
            k += 1
    return out[:k]


@_jit
def _halve_counts(count: I64, last_use: I64, prev: I32, nxt: I32, head: I32, tail: I32) -> None:
    """LFU aging: ``count //= 2`` for every slot, merging buckets ``2c`` and ``2c + 1`` into
    ``c`` by ``(last_use, slot)``."""
    for s in range(count.size):
        count[s] //= 2
    old_head = head.copy()
    nb = head.size
    head[:] = NIL
    tail[:] = NIL
    for c in range(nb):
        if 2 * c >= nb:
            break
        a = old_head[2 * c]
        z = old_head[2 * c + 1] if 2 * c + 1 < nb else NIL
        last = NIL
        while a != NIL or z != NIL:
            if z == NIL or (
                a != NIL and (last_use[a] < last_use[z] or (last_use[a] == last_use[z] and a < z))
            ):
                s = a
                a = nxt[a]
            else:
                s = z
                z = nxt[z]
            prev[s] = last
            if last == NIL:
                head[c] = s
            else:
                nxt[last] = s
            last = s
        if last != NIL:
            nxt[last] = NIL
            tail[c] = last


@_jit
def touch(
    slots: I64,
    step: int,
    insert: bool,
    last_use: I64,
    count: I64,
    prev: I32,
    nxt: I32,
    head: I32,
    tail: I32,
    accesses: int,
    decay_interval: int,
) -> tuple[int, int]:
    """The policies' ``on_insert`` (``insert``: count 0) or ``on_access`` (count + 1, then LFU
    aging) on ``slots``, keeping the lists sorted. ``count`` is empty for LRU. Returns
    ``(status, accesses since the last aging)``."""
    n = last_use.size
    uniq = _sorted_unique(slots)
    if uniq.size and (uniq[0] < 0 or uniq[-1] >= n):
        return BAD_INDEX, accesses
    counting = count.size > 0
    buckets = np.zeros(uniq.size if counting else 0, np.int64)  # insert: count 0
    if not insert:
        for i in range(buckets.size):
            buckets[i] = count[uniq[i]] + 1
    _requeue(uniq, buckets, step, last_use, count, prev, nxt, head, tail)
    if counting and not insert:
        accesses += 1
        if accesses >= decay_interval:
            _halve_counts(count, last_use, prev, nxt, head, tail)
            accesses = 0
    return OK, accesses


@_jit
def walk_victims(
    k: int, protected_a: Flags, protected_b: Flags, nxt: I32, head: I32, out: I64
) -> int:
    """Fills ``out[:k]`` with the first ``k`` slots in bucket-then-list order that neither flag
    array protects; returns how many it found."""
    found = 0
    for b in range(head.size):
        s = head[b]
        while s != NIL and found < k:
            if not protected_a[s] and not protected_b[s]:
                out[found] = s
                found += 1
            s = nxt[s]
        if found == k:
            break
    return found


# ----------------------------------------------------------------------------- the cache


@_jit
def capacity(ids: I64, id_to_slot: I32, reserved: Flags) -> tuple[int, int, int, int]:
    """Returns ``(status, misses, hits on unreserved slots, first bad id)`` of unique ``ids``."""
    n_rows = id_to_slot.size
    n_miss = 0
    hit_unreserved = 0
    for i in range(ids.size):
        r = ids[i]
        if r < 0 or r >= n_rows:
            return BAD_INDEX, 0, 0, r
        s = id_to_slot[r]
        if s < 0:
            n_miss += 1
        elif not reserved[s]:
            hit_unreserved += 1
    return OK, n_miss, hit_unreserved, 0


@_jit
def plan(
    ids: I64,
    step: int,
    num_free: int,
    num_reserved: int,
    id_to_slot: I32,
    slot_to_id: I64,
    dirty: Flags,
    reserved: Flags,
    mark: Flags,
    last_use: I64,
    count: I64,
    prev: I32,
    nxt: I32,
    head: I32,
    tail: I32,
    accesses: int,
    decay_interval: int,
) -> tuple[int, int, int, int, int, I64, I64, I64, I64, Flags]:
    """``TableCache.plan`` for unique ``ids`` on one table, in one call: capacity check (before
    any change), slots of hits, free slots (the suffix ``[num_slots - num_free, num_slots)``,
    filled in ascending order) then victims for the misses, map updates, ``on_insert`` of the
    loaded slots and ``on_access`` of all. ``mark`` is an all-false scratch flag per slot.

    Returns ``(status, misses, hits on unreserved slots, first bad id or free slots used,
    accesses since aging, slots, load_ids, load_slots, evict_ids, evict_dirty)``; the victims
    are ``load_slots[free slots used:]``."""
    n = ids.size
    num_slots = slot_to_id.size
    none = np.empty(0, np.int64)
    status, n_miss, hit_unreserved, bad = capacity(ids, id_to_slot, reserved)
    if status != OK:
        return status, 0, 0, bad, accesses, none, none, none, none, np.empty(0, np.bool_)
    if n_miss > num_slots - num_reserved - hit_unreserved:
        return (
            NO_ROOM,
            n_miss,
            hit_unreserved,
            0,
            accesses,
            none,
            none,
            none,
            none,
            np.empty(0, np.bool_),
        )
    slots = np.empty(n, np.int64)
    load_ids = np.empty(n_miss, np.int64)
    k = 0
    for i in range(n):
        s = id_to_slot[ids[i]]
        slots[i] = s
        if s < 0:
            load_ids[k] = ids[i]
            k += 1
    load_slots = np.empty(n_miss, np.int64)
    n_free = min(n_miss, num_free)
    first_free = num_slots - num_free
    for j in range(n_free):
        load_slots[j] = first_free + j
    n_evict = n_miss - n_free
    evict_ids = np.empty(n_evict, np.int64)
    evict_dirty = np.empty(n_evict, np.bool_)
    if n_evict > 0:
        # Protected besides the reserved slots: this batch's hits and the free slots it fills.
        for i in range(n):
            if slots[i] >= 0:
                mark[slots[i]] = True
        for j in range(n_free):
            mark[load_slots[j]] = True
        victims = load_slots[n_free:]
        found = walk_victims(n_evict, reserved, mark, nxt, head, victims)
        for i in range(n):
            if slots[i] >= 0:
                mark[slots[i]] = False
        for j in range(n_free):
            mark[load_slots[j]] = False
        if found < n_evict:  # nothing changed yet
            return (
                NO_VICTIMS,
                n_miss,
                hit_unreserved,
                0,
                accesses,
                none,
                none,
                none,
                none,
                evict_dirty,
            )
        for j in range(n_evict):
            v = victims[j]
            evict_ids[j] = slot_to_id[v]
            evict_dirty[j] = dirty[v]
            id_to_slot[slot_to_id[v]] = -1
    k = 0
    for i in range(n):
        if slots[i] < 0:
            s = load_slots[k]
            k += 1
            slots[i] = s
            id_to_slot[ids[i]] = s
            slot_to_id[s] = ids[i]
            dirty[s] = False
            mark[s] = True  # loaded: its count restarts
    # on_insert(load_slots) then on_access(slots), in one pass over the slots in ascending order.
    uniq = _sorted_unique(slots)  # (ids must be unique; a repeat must still not break the lists)
    counting = count.size > 0
    buckets = np.empty(uniq.size if counting else 0, np.int64)
    for i in range(uniq.size):
        s = uniq[i]
        if counting:
            buckets[i] = 1 if mark[s] else count[s] + 1
        mark[s] = False
    _requeue(uniq, buckets, step, last_use, count, prev, nxt, head, tail)
    if counting:
        accesses += 1
        if accesses >= decay_interval:
            _halve_counts(count, last_use, prev, nxt, head, tail)
            accesses = 0
    return (
        OK,
        n_miss,
        hit_unreserved,
        n_free,
        accesses,
        slots,
        load_ids,
        load_slots,
        evict_ids,
        evict_dirty,
    )


@_jit
def hold(slots: I64, delta: int, holds: I32, pinned: Flags, reserved: Flags) -> tuple[int, int]:
    """Adds ``delta`` to the hold count of each of ``slots`` (a repeated slot counts each time)
    and refreshes ``reserved = pinned | holds > 0`` there. Returns ``(status, change in the
    number of reserved slots)``; changes nothing on a bad slot."""
    n = holds.size
    for i in range(slots.size):
        if slots[i] < 0 or slots[i] >= n:
            return BAD_INDEX, 0
    for i in range(slots.size):
        holds[slots[i]] += delta
    change = 0
    for i in range(slots.size):
        s = slots[i]
        now = pinned[s] or holds[s] > 0
        if now != reserved[s]:
            reserved[s] = now
            change += 1 if now else -1
    return OK, change


# ------------------------------------------------------------------ a batch's distinct ids


@_jit
def home_slot(key: int, mask: int) -> Any:
    """Home slot of ``key`` in an open-addressing table of ``mask + 1`` slots (a power of two):
    SplitMix64's finalizer, on int64 (wrapping), masked. The virtual tables' id maps and
    :func:`unique_with_inverse` place ids by it."""
    return np.int64(splitmix64_word(np.uint64(key)) & np.uint64(mask))


_RADIX_BITS = 11  # 2,048 buckets: a batch's ~10**4 ids in 4 passes for ids below 2**44


@_jit
def _radix_sort(values: I64, hi: int) -> I64:
    """``values`` (none negative, none above ``hi``) in ascending order: least significant
    digit first, ``_RADIX_BITS`` a pass, as many passes as ``hi`` has digits."""
    n = values.shape[0]
    src = values.copy()
    dst = np.empty_like(src)
    counts = np.zeros(1 << _RADIX_BITS, np.int64)
    digit_mask = (1 << _RADIX_BITS) - 1
    shift = 0
    while (hi >> shift) > 0:
        counts[:] = 0
        for i in range(n):
            counts[(src[i] >> shift) & digit_mask] += 1
        total = 0
        for b in range(counts.shape[0]):
            c = counts[b]
            counts[b] = total
            total += c
        for i in range(n):
            b = (src[i] >> shift) & digit_mask
            dst[counts[b]] = src[i]
            counts[b] += 1
        src, dst = dst, src
        shift += _RADIX_BITS
    return src


@_jit
def _unique_with_inverse(ids: I64) -> tuple[bool, I64, I64]:
    """:func:`unique_with_inverse` for ids none negative; ``False`` first (and nothing else
    computed) when one is."""
    n = ids.shape[0]
    size = 16
    while size < 2 * n:
        size *= 2
    mask = size - 1
    keys = np.full(size, -1, np.int64)  # -1: a free slot (ids here are never negative)
    slot_of = np.empty(n, np.int64)  # each position's hash slot
    distinct = np.empty(n, np.int64)  # in the order first seen
    u, hi = 0, 0
    for i in range(n):
        key = ids[i]
        if key < 0:
            return False, ids[:0], ids[:0]
        s = home_slot(key, mask)
        while keys[s] != -1 and keys[s] != key:
            s = (s + 1) & mask
        if keys[s] == -1:
            keys[s] = key
            distinct[u] = key
            u += 1
            hi = max(hi, key)
        slot_of[i] = s
    uniq = _radix_sort(distinct[:u], hi)
    rank = np.empty(size, np.int64)  # a hash slot's id -> its place in ``uniq``
    for k in range(u):
        key = uniq[k]
        s = home_slot(key, mask)
        while keys[s] != key:
            s = (s + 1) & mask
        rank[s] = k
    inverse = np.empty(n, np.int64)
    for i in range(n):
        inverse[i] = rank[slot_of[i]]
    return True, uniq, inverse


def unique_with_inverse(ids: I64) -> tuple[I64, I64]:
    """``np.unique(ids, return_inverse=True)`` (sorted distinct ids, and each id's place among
    them), in one call without the GIL: a hash table finds the distinct ids, a radix sort
    orders only them. The tier worker runs it on every table of every batch beside the
    training thread: ~0.16 ms for 16,384 ids where numpy's, which sorts every position, takes
    ~0.8 ms and holds the GIL between its steps. Negative ids, and no numba, take numpy's."""
    if NUMBA_AVAILABLE and ids.size:
        ok, uniq, inverse = _unique_with_inverse(np.ascontiguousarray(ids, dtype=np.int64))
        if ok:
            return uniq, inverse
    uniq, inverse = np.unique(ids, return_inverse=True)
    return uniq, inverse.astype(np.int64, copy=False).reshape(-1)
