"""The storage side of the tiered kernel: each table shard's row store and its cache slots.

A :class:`TieredTableGroup` owns, for every table shard in one fused kernel, the row store on its
tier and the :class:`TableCache` that decides which rows sit in the fused module's (much smaller)
weight and optimizer-state tensors. Before a forward it turns the batch's row ids into cache
slots, writing evicted dirty rows back to the tier and reading missing rows in; the fused kernel
then computes and updates rows in place on the slots, exactly as it would on a whole table.

Why one file over ~600 lines: it is one class, the façade the kernel, the views, checkpoints and
the pipeline all go through, and nearly every method orders its work against the same queue of
in-flight batches on the same I/O worker; the parts with a job of their own already live
beside it (:mod:`.table_shard`, :mod:`.tier_io`, :mod:`.checkpoint_views`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torchrec.distributed.embedding_types import ShardedEmbeddingTable

from torchrec_mtrains._compat.torch_internals import tensor_version
from torchrec_mtrains.cache import kernels
from torchrec_mtrains.cache.table_cache import CachePlan, TableCache, compile_kernels
from torchrec_mtrains.distributed.checkpoint_views import TierViews
from torchrec_mtrains.distributed.copy_streams import RowCopyStreams
from torchrec_mtrains.distributed.options import (
    TieredTableOptions,
    TierStorage,
    shard_file_stem,
    tier_file_name,
)
from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.distributed.tier_io import HOST, TierIOCounters, TierIOWorker
from torchrec_mtrains.distributed.virtual_eviction import EvictionKind
from torchrec_mtrains.distributed.virtual_rows import (
    AssignedRows,
    VirtualRows,
    compile_round_kernels,
)
from torchrec_mtrains.distributed.virtual_tables import VirtualShard
from torchrec_mtrains.initializers import RowAddressedInit
from torchrec_mtrains.tiers._blockio import IDLE_PASSES, BufferPool
from torchrec_mtrains.tiers._linux import release_freed_memory
from torchrec_mtrains.tiers.base import OpenMode, compile_row_copies
from torchrec_mtrains.tiers.registry import open_store
from torchrec_mtrains.types import RowLayout, StorageDType

logger: logging.Logger = logging.getLogger(__name__)

FLUSH_CHUNK_ROWS = 16384  # rows per call when flush() or a reload moves a whole cache
# Rows a table's initialization fills at once: its chunks (a few copies of them live at once)
# are memory the plan does not hold for the table, so they stay small.
INIT_CHUNK_BYTES = 4 << 20


class TableIdError(IndexError):
    """A batch holds a row id outside its table (shard); nothing was written."""


@dataclass
class ResidentTable:
    """A table shard the kernel keeps whole (TorchRec's FUSED placement), whose changed rows
    incremental checkpoints save.

    Attributes:
        name: the table's name.
        features: indices of its features in the kernel's input.
        weights: its rows in the fbgemm module, ``(rows, cols)``.
        states: its optimizer states there, as fbgemm exposes them.
        changed: which local rows training looked up since the last checkpoint (empty until
            changes are tracked).
        watched: tensors sharing the version counters of what its state dicts hand out (the
            fbgemm module's weights and states, not ``.data``): a write through those tensors
            (fbgemm's own updates do not count) makes every row count as changed.
    """

    name: str
    features: list[int]
    weights: torch.Tensor
    states: dict[str, torch.Tensor]
    changed: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))
    watched: list[torch.Tensor] = field(default_factory=list)
    seen: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.seen = [tensor_version(t) for t in self.watched]

    @property
    def rows(self) -> int:
        return int(self.weights.shape[0])

    def written(self) -> bool:
        """Whether its state-dict tensors were written in place since the last look; looks."""
        now = [tensor_version(t) for t in self.watched]
        written, self.seen = now != self.seen, now
        return written


@dataclass
class _PlannedBatch:
    """One batch on its way through the caches: its ids split by table, then (once planned)
    each table's unique ids' slots, and the work that plans it and moves its rows."""

    values: torch.Tensor
    lengths: list[int]
    # Planned for training (else evaluation: see virtual_rows for what that changes).
    train: bool = True
    # Set once its ids are on the host and checked (see TieredTableGroup._split).
    segments: list[torch.Tensor] = field(default_factory=list)
    per_table: list[list[int]] = field(default_factory=list)
    table_ids: list[torch.Tensor] = field(default_factory=list)
    inverses: list[torch.Tensor] = field(default_factory=list)
    plans: list[CachePlan] = field(default_factory=list)  # empty until planned
    # Rows written into slots from an initializer, not read from the tier (a virtual table's
    # new ids): (shard, slots, tier rows).
    fills: list[tuple[TieredTableShard, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # An evaluated batch's provisional rows of virtual tables, per shard index, released with it.
    held_rows: list[tuple[int, npt.NDArray[np.int64]]] = field(default_factory=list)
    # The batch's ids with each tiered table's replaced by its slot (host memory, pinned when
    # the batch is on CUDA): what its forward hands fbgemm. None for a batch without ids.
    remapped: torch.Tensor | None = None
    io: Future[object] | None = None
    # An id out of its table's range, found on the worker: the batch raises it in its forward.
    id_error: TableIdError | None = None
    # CUDA only (see copy_streams): the asynchronous copy of its ids to the host, the slot
    # releases its copies must follow, and the end of its copies, which its forward waits for.
    host_ids: torch.Tensor | None = None
    ids_ready: torch.cuda.Event | None = None
    after_release: torch.cuda.Event | None = None
    rows_ready: torch.cuda.Event | None = None


def _unique_with_inverse(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, return_inverse=True)`` (sorted) for a table's ids in host memory,
    by :func:`kernels.unique_with_inverse`: ~0.16 ms for 16,384 ids, where numpy's takes
    ~0.8 ms and torch's, which sorts (id, position) pairs, longer still; the tier worker runs it
    once per table and batch."""
    uniq, inverse = kernels.unique_with_inverse(ids.numpy())
    return torch.from_numpy(uniq), torch.from_numpy(inverse)


def _same_ids(held: torch.Tensor, given: torch.Tensor) -> bool:
    """Whether ``given`` holds the ids of ``held``, a prefetched batch's (which keeps their
    memory alive): the same memory, as when the pipeline hands a forward the very tensors it
    prefetched, or else equal values (comparing values on CUDA blocks the host until the GPU
    has produced them: only a caller whose forwards do not present the prefetched tensors
    pays for it)."""
    same_memory = (
        held.device == given.device
        and held.dtype == given.dtype
        and held.shape == given.shape
        and held.stride() == given.stride()
        and held.data_ptr() == given.data_ptr()
    )
    return same_memory or torch.equal(held, given.to(held.device))


def _split_states(
    states: dict[str, torch.Tensor], cache_rows: int
) -> tuple[list[str], list[torch.Tensor], list[tuple[int, ...]]]:
    keys, views, shapes = [], [], []
    for key, tensor in states.items():
        if tensor.numel() == 1 and cache_rows != 1:
            raise ValueError(
                f"optimizer state {key!r} is a single value per table; tiered tables support "
                "optimizers whose state is per row (SGD, Adagrad, row-wise Adagrad)"
            )
        keys.append(key)
        shapes.append(tuple(tensor.shape[1:]))
        views.append(tensor.view(cache_rows, -1))
    return keys, views, shapes


class TieredTableGroup:
    """The tiered tables of one fused kernel, in the kernel's table order.

    Args:
        tables: the kernel's sharded table configs.
        feature_table_map: table index of each input feature, in feature order; -1 for a
            feature of a table outside the group (the kernel's resident tables), whose ids
            :meth:`remap` returns unchanged.
        resident: the kernel's resident tables, whose changed rows :meth:`track_changes`
            records too (their features are found by ``ResidentTable.features``).
        weight_slots: per table, the fused module's weight view (``split_embedding_weights()``).
        states: per table, the fused module's optimizer states (``get_optimizer_state()``).
        options: placement of each table (tier, cache size, policy), aligned with ``tables``.
        storage: where tier files go.
        rank: this process's rank (files are per rank).
        virtual: per table, its id space when it is a virtual table shard (``tables`` then
            describe its store, see :mod:`~torchrec_mtrains.distributed.virtual_tables`).
    """

    def __init__(
        self,
        tables: list[ShardedEmbeddingTable],
        feature_table_map: list[int],
        weight_slots: list[torch.Tensor],
        states: list[dict[str, torch.Tensor]],
        options: list[TieredTableOptions],
        storage: TierStorage,
        rank: int,
        resident: Sequence[ResidentTable] = (),
        virtual: Sequence[VirtualShard | None] = (),
    ) -> None:
        self.storage = storage
        self.feature_table_map = feature_table_map
        self.resident = list(resident)
        self.shards: list[TieredTableShard] = []
        spaces = list(virtual) or [None] * len(tables)
        for table, weight, state, placed, space in zip(
            tables, weight_slots, states, options, spaces
        ):
            if table.local_rows == 0:
                raise ValueError(
                    f"table {table.name!r}: rank {rank}'s row-wise shard of it holds no rows "
                    f"({table.num_embeddings} rows over more ranks): a table on a tier needs a "
                    "row on every rank it is sharded over; give it more rows or shard it "
                    "table- or column-wise"
                )
            directory = storage.directory(placed.tier, rank)
            cache_rows = int(weight.shape[0])
            keys, views, shapes = _split_states(state, cache_rows)
            dtype = StorageDType.parse(weight.dtype)
            layout = RowLayout(
                num_rows=table.local_rows,
                dim=table.local_cols,
                state_width=sum(v.shape[1] for v in views),
                dtype=dtype,
            )
            row_off, col_off = _offsets(table)
            file_name = shard_file_stem(table.name, row_off, col_off)
            # The tier's options name the store (file layout) that keeps its rows.
            store_options = storage.options_for(placed.tier)
            existed = (
                directory / tier_file_name(table.name, row_off, col_off, store_options.tier)
            ).exists()
            store = open_store(
                placed.tier.value,
                directory,
                file_name,
                layout,
                mode=storage.open_mode,
                options=store_options,
            )
            created = storage.open_mode is OpenMode.TRUNCATE or not existed
            self.shards.append(
                TieredTableShard(
                    name=table.name,
                    store=store,
                    cache=TableCache(table.name, table.local_rows, cache_rows, placed.cache_policy),
                    weight_slots=weight,
                    state_slots=views,
                    state_keys=keys,
                    state_shapes=shapes,
                    row_offset=row_off,
                    col_offset=col_off,
                    created=created,
                    virtual=None if space is None else VirtualRows(table.name, space),
                )
            )
            if space is not None and not created:
                raise ValueError(
                    f"virtual table {table.name!r}: its tier file exists, but which ids its rows "
                    "hold is not kept with it; build the model on new tier files (another "
                    "TierStorage root, or open_mode='truncate') and load its state dict"
                )
        if any(shard.cache.backend == "numba" for shard in self.shards):
            compile_kernels()  # now, not while the first batches wait for their rows
            compile_row_copies()  # (and for the rows they move)
        if any(shard.virtual is not None for shard in self.shards):
            compile_round_kernels()  # (and the first eviction round)
        # One pool of I/O buffers for the group's block stores: its worker moves one table's
        # rows at a time, so a pass's buffer in use and one idle serve every table.
        pass_bytes = [
            int(getattr(s.store.options, "max_pass_bytes", 0))
            for s in self.shards
            if hasattr(s.store, "use_buffers")
        ]
        if pass_bytes:
            pool = BufferPool(keep_bytes=IDLE_PASSES * max(pass_bytes))
            for shard in self.shards:
                use_buffers = getattr(shard.store, "use_buffers", None)
                if use_buffers is not None:
                    use_buffers(pool)
        self.device = weight_slots[0].device if weight_slots else HOST
        self.io = TierIOWorker(self.device)
        self.views = TierViews(self.shards, storage.checkpoint_chunk_rows)
        # The event of the last slot release on the training stream (CUDA): copies that reuse
        # released slots wait for it.
        self._released: torch.cuda.Event | None = None
        self._pending: deque[_PlannedBatch] = deque()
        self._in_flight: _PlannedBatch | None = None
        self._awaiting_backward = False
        self._hot_rows: dict[int, torch.Tensor] = {}
        self._repin = False
        # Guards the caches' maps, holds and dirty flags: batches are planned on the I/O worker
        # while the training thread releases and marks the running batch's slots. Take it
        # through _locked(), which first carries out what the training thread deferred.
        self._cache_lock = threading.Lock()
        # The training thread's releases and marks, in order, deferred while the worker held
        # the lock (see _defer): whoever takes the lock next carries them out first.
        self._deferred: deque[Callable[[], None]] = deque()
        # Per shard, which rows a training batch made resident since the last
        # clear_changes() (None: not tracked). See track_changes().
        self._changed: list[torch.Tensor] | None = None
        self._planned_batches = 0  # batches planned so far (virtual tables' eviction records)

    # --------------------------------------------------------------------------- per batch

    def _split(self, batch: _PlannedBatch, ids: torch.Tensor) -> None:
        """Splits a batch's ids (int64, in host memory) by feature and by table into
        ``batch.segments``, ``batch.per_table`` and ``batch.table_ids``, checking every id
        against its table (raises :class:`TableIdError` naming the first one out of range)."""
        segments = list(torch.split(ids, batch.lengths))
        per_table: list[list[int]] = [[] for _ in self.shards]
        for feature, table_idx in enumerate(self.feature_table_map):
            if table_idx >= 0:  # -1: a table outside the group (its ids pass through)
                per_table[table_idx].append(feature)
        table_ids: list[torch.Tensor] = []
        for shard, features in zip(self.shards, per_table):
            t_ids = torch.cat([segments[f] for f in features]) if features else ids[:0]
            if t_ids.numel():
                lo, hi = int(t_ids.min()), int(t_ids.max())
                space = None if shard.virtual is None else shard.virtual.space
                rows, offset = (
                    (shard.local_rows, shard.row_offset)
                    if space is None
                    else (space.ids, space.id_offset)
                )
                if lo < 0 or hi >= rows:
                    bad = lo if lo < 0 else hi
                    where = f" (global row {bad + offset})" if offset else ""
                    raise TableIdError(
                        f"table {shard.name!r}: row id {bad}{where} out of range "
                        f"[0, {rows}) of this shard; nothing was written"
                    )
            table_ids.append(t_ids)
        batch.segments, batch.per_table, batch.table_ids = segments, per_table, table_ids

    def _plan_batch(
        self, values: torch.Tensor, lengths_per_feature: list[int], train: bool
    ) -> _PlannedBatch:
        """Checks one batch's ids, then plans it on every table (holding its slots) and moves
        its rows in. With background I/O both the planning and the I/O run on the worker, so
        the training thread only checks ids; otherwise everything runs here.

        Ids on CUDA, with background I/O, are not even checked here: reading them would block
        the host until the GPU has produced them. They go to the host by an asynchronous copy
        the worker waits for, and the worker checks them; an id out of range then raises in the
        batch's forward, before its lookup, and nothing of the batch is read or written."""
        self._check_no_reported_error()
        self.absorb_view_writes()
        batch = _PlannedBatch(values, list(lengths_per_feature), train)
        if self.io.background and values.device.type == "cuda":
            batch.host_ids, batch.ids_ready = RowCopyStreams.to_host(values)
            batch.io = self.io.submit(self._check_plan_and_move, batch)
            return batch
        self._split(batch, values.to(HOST, torch.int64))
        if self.io.background:
            batch.io = self.io.submit(self._plan_and_move, batch)
            return batch
        self._plan(batch)  # a batch that cannot fit raises here, before anything moves
        started = time.perf_counter()
        try:
            self._move_batch_rows(batch)
        except BaseException as e:
            self._release(batch)  # its rows never arrived: the batch does not run
            self.io.error_reported |= isinstance(e, Exception)
            raise
        finally:
            self.io.count(stall_seconds=time.perf_counter() - started)
        return batch

    def _plan(self, batch: _PlannedBatch) -> None:
        """Assigns the batch's unique ids slots on every table and holds them; refuses (changing
        nothing) when any table's cache cannot take the batch."""
        if self._repin:
            self._repin = False
            for index, ids in self._hot_rows.items():
                self._pin(index, ids, inline=True)
        uniques = [_unique_with_inverse(t) for t in batch.table_ids]
        self._planned_batches += batch.train
        made: list[tuple[int, torch.Tensor, AssignedRows]] = []
        with self._locked():
            # Virtual tables' ids become rows first; an eviction round reads which slots the
            # batches in flight hold, which the training thread releases under this lock.
            if any(shard.virtual is not None for shard in self.shards):
                uniques, made = self._assign_rows(batch, uniques)
            # Every table must fit before any is planned: planning updates a cache's maps.
            try:
                for shard, (uniq, _) in zip(self.shards, uniques):
                    shard.cache.check_fits(uniq)
            except BaseException:
                self._unassign_rows(made)
                batch.held_rows = []
                raise
            plans = [shard.cache.plan(uniq) for shard, (uniq, _) in zip(self.shards, uniques)]
            for shard, plan in zip(self.shards, plans):
                shard.cache.hold(plan.slots)
            batch.after_release = self._released
            if made:
                plans, new_rows = self._take_made_rows(plans, made, batch)
        # Their initial values need no lock: the training thread waits on the cache lock.
        for shard, slots, ids in new_rows if made else ():
            virtual, layout = shard.virtual, shard.store.layout
            assert virtual is not None
            rows = virtual.initial_rows(
                ids, layout.row_width, layout.dim, shard.col_offset, layout.dtype.torch_dtype
            )
            batch.fills.append((shard, slots, rows))
        batch.inverses = [inverse for _, inverse in uniques]
        batch.plans = plans
        batch.remapped = self._remapped(batch)
        self.io.count(
            rows_fetched=sum(int(p.load_ids.numel()) for p in plans),
            rows_written_back=sum(int(p.evict_dirty.sum()) for p in plans),
        )

    def _assign_rows(
        self, batch: _PlannedBatch, uniques: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[
        list[tuple[torch.Tensor, torch.Tensor]], list[tuple[int, torch.Tensor, AssignedRows]]
    ]:
        """Turns each virtual shard's unique ids into its store rows (see
        :meth:`VirtualRows.assign`); ``batch.table_ids`` become rows too. Returns the rows and,
        per virtual shard, its unique ids and what was assigned. A shard without room for its
        new ids refuses the batch, with nothing assigned on any shard."""
        out = list(uniques)
        made: list[tuple[int, torch.Tensor, AssignedRows]] = []
        try:
            for index, shard in enumerate(self.shards):
                if shard.virtual is None:
                    continue
                uniq, inverse = uniques[index]
                values = None
                if shard.virtual.eviction.rule.kind is EvictionKind.SCORE:
                    values = torch.bincount(inverse, minlength=len(uniq))
                assigned = shard.virtual.assign(
                    uniq,
                    shard.cache,
                    shard.store,
                    shard.weight_slots,
                    self._planned_batches,
                    batch.train,
                    values,
                )
                made.append((index, uniq, assigned))
                out[index] = (assigned.rows, inverse)
        except BaseException:
            self._unassign_rows(made)
            raise
        for index, shard in enumerate(self.shards):
            if shard.virtual is not None:
                rows, inverse = out[index]
                batch.table_ids[index] = rows[inverse]
        batch.held_rows = [(index, a.held) for index, _, a in made if a.held.size]
        return out, made

    def _unassign_rows(self, made: list[tuple[int, torch.Tensor, AssignedRows]]) -> None:
        for index, ids, assigned in made:
            virtual = self.shards[index].virtual
            assert virtual is not None
            virtual.unassign(ids, assigned)

    def _take_made_rows(
        self,
        plans: list[CachePlan],
        made: list[tuple[int, torch.Tensor, AssignedRows]],
        batch: _PlannedBatch,
    ) -> tuple[list[CachePlan], list[tuple[TieredTableShard, torch.Tensor, torch.Tensor]]]:
        """New ids' rows go into their slots from their initializer, not from the tier: they
        leave the plans' loads. A training batch's are marked dirty (so the tier gets them when
        the cache writes them back), as are the provisional rows it trains; an evaluated
        batch's provisional rows never reach the tier. Returns the plans and, per shard, the
        slots and ids to fill (the batch's ``fills``, whose values the caller computes).
        Called with the cache lock held."""
        plans = list(plans)
        fills = []
        for index, ids, assigned in made:
            shard, plan = self.shards[index], plans[index]
            if batch.train and assigned.kept.numel():
                shard.cache.mark_dirty(plan.slots[assigned.kept])
            if not assigned.made.numel():
                continue
            slots = plan.slots[assigned.made]
            # (a mask over the cache's slots: ~7x faster than torch.isin at W3's sizes)
            made_slot = torch.zeros(shard.cache.num_slots, dtype=torch.bool, device=slots.device)
            made_slot[slots] = True
            keep = ~made_slot[plan.load_slots]
            plans[index] = dataclasses.replace(
                plan, load_ids=plan.load_ids[keep], load_slots=plan.load_slots[keep]
            )
            if batch.train:
                shard.cache.mark_dirty(slots)
            fills.append((shard, slots, ids[assigned.made]))
        return plans, fills

    @staticmethod
    def _remapped(batch: _PlannedBatch) -> torch.Tensor | None:
        """The batch's ids with its tiered tables' replaced by their slots, in host memory
        (pinned for a batch on CUDA, so that its forward copies them without a host sync)."""
        out: list[torch.Tensor] = list(batch.segments)
        if not out:
            return None
        for plan, inverse, features in zip(batch.plans, batch.inverses, batch.per_table):
            slots = plan.slots[inverse]
            for f, part in zip(features, torch.split(slots, [batch.lengths[f] for f in features])):
                out[f] = part
        remapped = torch.cat(out)
        return remapped.pin_memory() if batch.values.device.type == "cuda" else remapped

    def _check_plan_and_move(self, batch: _PlannedBatch) -> None:
        """The worker's part of a prefetch whose ids were on CUDA: once their copy has reached
        the host, check them (an id out of range is kept for the batch's forward to raise),
        then plan and move as :meth:`_plan_and_move`."""
        RowCopyStreams.synchronize(batch.ids_ready)
        assert batch.host_ids is not None
        try:
            self._split(batch, batch.host_ids)
        except TableIdError as e:
            batch.id_error = e
            return
        self._plan_and_move(batch)

    def _plan_and_move(self, batch: _PlannedBatch) -> None:
        """The worker's part of a prefetch: plan, then write back and read (in FIFO order with
        every other batch's, so a row written back is on its tier before it is read again)."""
        self._plan(batch)
        self._move_batch_rows(batch)

    def _move_batch_rows(self, batch: _PlannedBatch) -> None:
        batch.rows_ready = self.io.move_rows(
            list(zip(self.shards, batch.plans)), batch.after_release, batch.fills
        )

    def _check_no_reported_error(self) -> None:
        if self.io.error_reported:
            raise RuntimeError(
                "an earlier tier I/O failed, so cached rows may be invalid; call "
                "stop_background_io() (the look-ahead pipeline does on error) before training on"
            )

    def prefetch(
        self, values: torch.Tensor, lengths_per_feature: list[int], train: bool = True
    ) -> None:
        """Plans a batch that will run later and starts reading its missing rows in the
        background (cDLRM's look-ahead). Its rows stay resident until the batch has run; the
        forward that presents the same ids uses them without waiting for the tier.

        Prefetches are consumed in order. Ids are checked here (a bad id raises now), except
        ids on CUDA, which the worker checks once they reach the host without blocking this
        thread (a bad one raises in the batch's forward); planning and I/O run on one worker
        thread, in submission order, so a row written back is always
        on the tier before it can be read again, and a batch that does not fit the cache
        raises in its own forward. ``train``: whether the batch will train (the module's mode
        when it is prefetched; see :meth:`remap` when the forward's differs)."""
        self._pending.append(self._plan_batch(values, lengths_per_feature, train))

    def remap(
        self, values: torch.Tensor, lengths_per_feature: list[int], train: bool
    ) -> torch.Tensor:
        """Returns ``values`` (row ids, features back to back) with each id replaced by its
        cache slot, after making every row resident (using a matching prefetch if any).

        All ids are checked before anything moves, so a bad id leaves the tier untouched.
        The batch's rows stay held until the next batch is remapped, i.e. until its backward
        has updated them. A batch prefetched for evaluation that trains keeps the rows its
        virtual tables' new ids were given (one prefetched for training that is evaluated
        keeps them too: they are made)."""
        self._check_no_reported_error()
        self.absorb_view_writes()
        batch = self._take_prefetched(values, lengths_per_feature)
        # The previous batch's backward is done: its rows may be evicted from here on.
        self._release_in_flight(wait=False)
        if batch is None:
            self.io.count(unprefetched_batches=1)
            batch = self._plan_batch(values, lengths_per_feature, train)
        else:
            self.io.count(prefetched_batches=1)
        started = time.perf_counter()
        try:
            self._wait(batch)
        except BaseException as e:
            # A worker error or an interrupt: the batch does not run, so its rows are free
            # again (I/O still queued for them finishes first: the worker keeps FIFO order).
            self._release(batch)
            self.io.error_reported |= isinstance(e, Exception)
            raise
        finally:
            self.io.count(stall_seconds=time.perf_counter() - started)
        if batch.id_error is not None:
            raise batch.id_error  # found on the worker: nothing of the batch was planned
        self.io.copies.wait(batch.rows_ready)
        self._in_flight = batch
        self._awaiting_backward = train
        if train:
            self._defer(functools.partial(self._mark_trained, batch))
            if self._changed is not None:
                for changed, ids in zip(self._changed, batch.table_ids):
                    changed[ids] = True
                for table in self.resident:
                    for f in table.features:
                        table.changed[batch.segments[f]] = True
        if batch.remapped is None:
            return values
        # From pinned memory on CUDA: enqueued on the training stream, no host sync.
        return batch.remapped.to(values.device, non_blocking=True)

    def backward_started(self, grad: torch.Tensor) -> None:
        """Gradient hook on the kernel's output: the fused backward is about to update the
        running batch's rows, so a flush after it need not keep them dirty."""
        self._awaiting_backward = False

    def _take_prefetched(
        self, values: torch.Tensor, lengths_per_feature: list[int]
    ) -> _PlannedBatch | None:
        if not self._pending:
            return None
        head = self._pending[0]
        if head.lengths != list(lengths_per_feature) or not _same_ids(head.values, values):
            logger.warning(
                "forward ids differ from the next prefetched batch; planning them now "
                "(prefetch batches in the order they run)"
            )
            return None
        return self._pending.popleft()

    @staticmethod
    def _wait(batch: _PlannedBatch) -> None:
        if batch.io is not None:
            batch.io.result()  # re-raises a worker exception with its traceback

    def _release(self, batch: _PlannedBatch) -> None:
        with self._locked():
            self._release_locked(batch)

    def _release_locked(self, batch: _PlannedBatch, released: Any = None) -> None:
        """Frees the batch's slots (a batch whose planning failed holds none) and provisional
        rows; ``released``: the event after which its work on the device is done (CUDA)."""
        if released is not None:
            self._released = released
        for shard, plan in zip(self.shards, batch.plans):
            shard.cache.release(plan.slots)
        for index, rows in batch.held_rows:
            virtual = self.shards[index].virtual
            assert virtual is not None
            virtual.release(rows)
        batch.held_rows = []

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the cache lock, having carried out what :meth:`_defer` left."""
        with self._cache_lock:
            self._run_deferred()
            yield

    def _run_deferred(self) -> None:
        while self._deferred:  # (with the cache lock held)
            self._deferred.popleft()()

    def _catch_up(self) -> None:
        """Carries out every deferred update: before the caches are read without the lock."""
        with self._locked():
            pass

    def _defer(self, update: Callable[[], None]) -> None:
        """Leaves the training thread's ``update`` of the caches to whoever takes the lock
        next (the worker, before it plans a batch; a flush; ...): the training thread never
        waits for the worker's planning, and with background I/O it leaves the work itself to
        the worker (its share of a step's CPU, ~1.5% on W3). Without a worker it carries the
        update out now if the lock is free. Whatever reads the caches takes the lock first,
        so it sees every update deferred before."""
        self._deferred.append(update)
        if not self.io.background and self._cache_lock.acquire(blocking=False):
            try:
                self._run_deferred()
            finally:
                self._cache_lock.release()

    def _mark_trained(self, batch: _PlannedBatch) -> None:
        """The batch trains: its rows will differ from their tiers' (see :meth:`remap`)."""
        for shard, plan in zip(self.shards, batch.plans):
            shard.cache.mark_dirty(plan.slots)
        self._keep_held_rows(batch)

    def _keep_held_rows(self, batch: _PlannedBatch) -> None:
        """A batch planned for evaluation trains: the provisional rows it holds become rows of
        their own (their slots are marked dirty by the caller). Called with the cache lock."""
        for index, rows in batch.held_rows:
            virtual = self.shards[index].virtual
            assert virtual is not None
            virtual.keep(rows)
        batch.held_rows = []

    def _release_in_flight(self, wait: bool = True) -> None:
        """Releases the batch that ran last; without ``wait``, deferred (see :meth:`_defer`)."""
        if self._in_flight is None:
            return
        batch, self._in_flight = self._in_flight, None
        # Enqueued work of that batch (its backward) may still use the slots on the GPU.
        release = functools.partial(self._release_locked, batch, self.io.copies.record())
        if wait:
            with self._locked():
                release()
        else:
            self._defer(release)

    def io_counters(self) -> TierIOCounters:
        """A snapshot of the group's I/O counters (see :class:`TierIOCounters`)."""
        return self.io.counters()

    def drain(self) -> None:
        """Waits for all queued tier I/O (prefetches stay queued for their batches)."""
        for batch in self._pending:
            self._wait(batch)

    def cancel_prefetches(self) -> None:
        """Drops queued prefetches after their I/O finished, releasing their rows."""
        while self._pending:
            batch = self._pending.popleft()
            self._wait(batch)
            self._release(batch)

    @property
    def background_io(self) -> bool:
        return self.io.background

    @background_io.setter
    def background_io(self, enabled: bool) -> None:
        """Runs prefetch I/O on a worker thread (the look-ahead pipeline turns this on);
        turning it off waits for queued I/O and ends the thread."""
        self.drain()
        self.io.background = enabled
        if not enabled:
            self.io.shutdown()

    def stop_background_io(self) -> BaseException | None:
        """Ends look-ahead whatever state it is in (after an error or an interrupt too).

        Waits for every queued tier I/O, so a write-back under way always completes and no row
        on a tier is left half written; drops the prefetched batches and their holds; stops the
        worker thread; turns background I/O off. If any row move failed, the cache may map rows
        whose read never happened: the dirty rows (whose cached values are valid) are written
        back and the caches emptied, so later batches read every row from its tier.

        Returns:
            The first I/O error met while waiting (its batch never ran), or None.
        """
        error: BaseException | None = None
        while self._pending:
            batch = self._pending.popleft()
            try:
                self._wait(batch)
            except Exception as e:
                error = error or e
            self._release(batch)
        self.io.shutdown()
        self.io.background = False
        if self.io.failed:
            self.io.failed = self.io.error_reported = False
            self._release_in_flight()
            self.flush(keep_in_flight_dirty=False)
            for shard in self.shards:
                shard.cache.clear()
            self._repin = bool(self._hot_rows)
            logger.warning("tier I/O failed: dirty rows written back, caches emptied")
        # Whatever failed (I/O, or planning a batch that did not fit) is dealt with: the caches
        # hold only rows that arrived, and nothing is held for batches that will not run.
        self.io.error_reported = False
        return error

    @torch.no_grad()
    def apply(self, shard: TieredTableShard, plan: CachePlan) -> None:
        """Carries out ``plan``: writes dirty victims back, then reads the missing rows in;
        returns once the rows are in the cache."""
        with self._locked():
            after = self._released
        self.io.copies.synchronize(self.io.move_rows([(shard, plan)], after))

    # ------------------------------------------------------------------------ whole tables

    @torch.no_grad()
    def flush(self, keep_in_flight_dirty: bool = True) -> None:
        """Writes every dirty cached row back and makes the tiers durable; rows stay cached.

        Rows of a training batch whose backward has not run yet stay marked dirty (unless
        ``keep_in_flight_dirty`` is false), since the backward will still update them."""
        self.absorb_view_writes()
        self.drain()
        self._catch_up()  # the marks the training thread deferred
        for i, shard in enumerate(self.shards):
            ids, slots = shard.cache.dirty_rows()
            # In chunks: a copy of every dirty row at once could be as large as the cache, and
            # the flush at the end of a run must fit the memory training fitted in.
            for start in range(0, int(ids.numel()), FLUSH_CHUNK_ROWS):
                part = slice(start, start + FLUSH_CHUNK_ROWS)
                self.io.write_back(shard, ids[part], slots[part])
                shard.cache.mark_clean(slots[part])
            if keep_in_flight_dirty and self._in_flight is not None and self._awaiting_backward:
                # The running batch's backward has yet to update its rows.
                shard.cache.mark_dirty(self._in_flight.plans[i].slots)
            shard.store.flush()

    def sync_views(self) -> None:
        """Flushes, then brings the views (:class:`TierViews`) up to date: before anything
        reads the tables through them (a state dict, the optimizer's state, a checkpoint load
        that writes only some of their columns)."""
        self.flush()
        self.views.refresh()

    # ------------------------------------------------------------ rows changed by training

    def track_changes(self) -> None:
        """Starts recording which rows training changes (every row a training batch makes
        resident, and every row of a resident table a training batch looks up), for
        checkpoints that write only those (see ``distributed.incremental``). Costs one byte per
        row of this rank's shards, so it is off until asked for."""
        if self._changed is None:
            self._changed = [
                torch.zeros(shard.local_rows, dtype=torch.bool, device=HOST)
                for shard in self.shards
            ]
            for table in self.resident:
                table.changed = torch.zeros(table.rows, dtype=torch.bool, device=HOST)
            for shard in self.shards:
                if shard.virtual is not None:  # rows looked up or made, ids evicted
                    shard.virtual.track_changes()

    def changed_rows(self, index: int) -> torch.Tensor | None:
        """Which local rows of shard ``index`` training changed since :meth:`clear_changes`, as
        a boolean mask over the shard's rows (``None`` when changes are not tracked)."""
        return None if self._changed is None else self._changed[index]

    def clear_changes(self) -> None:
        """Marks every row unchanged: the tiers (after a flush) and the latest checkpoint agree."""
        if self._changed is not None:
            for changed in self._changed:
                changed.zero_()
            for table in self.resident:
                table.changed.zero_()
            for shard in self.shards:
                if shard.virtual is not None:
                    shard.virtual.clear_changes()

    # ------------------------------------------------------------ writes through the views

    def absorb_view_writes(self, loaded: bool = False) -> None:
        """Takes in what was written in place through the views (:class:`TierViews`: the
        tensors ``state_dict()`` and the fused optimizer's state hand out): the tier gets it,
        and so do the cached rows, as TorchRec's FUSED kernel, whose state-dict tensors alias
        its weights, would have them. Runs before anything reads or writes the rows (a batch's
        planning, a flush, a state dict); costs a version check per part of each table when
        nothing was written.

        Each part written (the weights, or an optimizer state) is taken whole from the view:
        exact when the view was taken after the rows last trained (``state_dict()`` syncs the
        tiers), the case of ``copy_state_dict`` or ``dcp.load(model.state_dict())``. A write
        through tensors taken *before* later training steps (a stale state dict) cannot be told
        from the rows those steps changed since; it wins over them, and a warning names the
        table (take the state dict again after training, then write).

        Args:
            loaded: the writes are a checkpoint load's (this package's own loaders): they do
                not count as rows changed by training for incremental checkpoints.
        """
        written = [(i, parts) for i in range(len(self.shards)) if (parts := self.views.written(i))]
        for table in self.resident:  # kept whole in fbgemm's module: only its changes to note
            if table.written() and self._changed is not None and not loaded:
                table.changed[:] = True
        if not written:
            return
        self.drain()  # queued moves finish first: nothing writes a tier meanwhile
        for batch in self._pending:  # (on CUDA: their rows' copies into the cache too)
            self.io.copies.wait(batch.rows_ready)
        self._catch_up()  # the marks the training thread deferred
        for index, parts in written:
            shard = self.shards[index]
            stale = self.views.store_writes(index, parts)
            columns = [self.views.part_columns(index, part) for part in parts]
            overridden = self._reload_cached(shard, columns)
            if (stale or overridden) and not loaded:
                since = (
                    f"{overridden} of its cached rows trained since"
                    if overridden
                    else "training changed its tier since"
                )
                logger.warning(
                    "table %r: its %s were written through tensors a state_dict() handed out "
                    "before %s; the written values replace those of every row (take the state "
                    "dict again after training to write some rows only)",
                    shard.name,
                    ", ".join(parts),
                    since,
                )
            if self._changed is not None and not loaded:
                self._changed[index][:] = True  # which rows the write changed is unknown
            self.views.mark_seen(index)

    @torch.no_grad()
    def _reload_cached(self, shard: TieredTableShard, columns: Sequence[slice]) -> int:
        """Re-reads the row values ``columns`` of every cached row of ``shard`` from its tier,
        keeping the others (the cache's, which may be newer). Returns how many of those rows
        were dirty (trained since they were last written back), now overridden."""
        resident_ids, resident_slots = shard.cache.resident()
        wanted = [(c, t) for c, t in self._targets(shard) if any(c == w for w in columns)]
        if not wanted or not resident_ids.numel():
            return 0
        overridden = int(shard.cache.dirty[resident_slots].sum())
        device = shard.weight_slots.device
        for first in range(0, int(resident_ids.numel()), FLUSH_CHUNK_ROWS):
            ids = resident_ids[first : first + FLUSH_CHUNK_ROWS]
            rows = torch.from_numpy(shard.store.read_rows(ids.numpy()))
            dev_slots = resident_slots[first : first + FLUSH_CHUNK_ROWS].to(device)
            for cols, tensor in wanted:
                tensor.index_copy_(0, dev_slots, rows[:, cols].to(device, tensor.dtype))
        return overridden

    # ------------------------------------------------------------ rows read and set by id

    def _rows_by_id(self, index: int, local_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``local_ids`` of shard ``index`` checked (in range, no repeats) and, per id, its cache
        slot or -1, once every queued move has finished (so neither a tier nor a slot changes
        until the next batch is planned). What was written through the views is taken in
        first."""
        shard = self.shards[index]
        if shard.virtual is not None:
            raise NotImplementedError(
                f"table {shard.name!r}: rows of a virtual table are set by id only through its "
                "state dict"
            )
        ids = local_ids.to(HOST, torch.int64).flatten()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= shard.local_rows):
            bad = int(ids[(ids < 0) | (ids >= shard.local_rows)][0])
            raise TableIdError(
                f"table {shard.name!r}: row id {bad} out of range [0, {shard.local_rows})"
            )
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"table {shard.name!r}: row ids to set repeat an id")
        self.absorb_view_writes()
        self.drain()
        for batch in self._pending:
            self.io.copies.wait(batch.rows_ready)
        with self._locked():
            return ids, shard.cache.lookup(ids).to(HOST)

    def _targets(self, shard: TieredTableShard) -> list[tuple[slice, torch.Tensor]]:
        """Each part of a row (weights, then each optimizer state): its values' columns and the
        fbgemm tensor holding it for the cached rows."""
        out = [(slice(0, shard.cols), shard.weight_slots)]
        start = shard.cols
        for view in shard.state_slots:
            out.append((slice(start, start + int(view.shape[1])), view))
            start += int(view.shape[1])
        return out

    @torch.no_grad()
    def read_weights(self, index: int, local_ids: torch.Tensor) -> torch.Tensor:
        """The weights of rows ``local_ids`` of shard ``index`` as training left them (a cached
        row's from its slot, others' from the tier), ``(n, cols)`` at the table's dtype on the
        compute device."""
        shard = self.shards[index]
        ids, slots = self._rows_by_id(index, local_ids)
        out = torch.empty(
            ids.numel(), shard.cols, dtype=shard.weight_slots.dtype, device=self.device
        )
        cached = slots >= 0
        if bool(cached.any()):
            where = torch.nonzero(cached).flatten().to(self.device)
            out[where] = shard.weight_slots[slots[cached].to(self.device)]
        if not bool(cached.all()):
            rows = torch.from_numpy(shard.store.read_rows(ids[~cached].numpy()))
            where = torch.nonzero(~cached).flatten().to(self.device)
            out[where] = rows[:, : shard.cols].to(self.device, out.dtype)
        return out

    @torch.no_grad()
    def set_rows(
        self,
        index: int,
        local_ids: torch.Tensor,
        weights: torch.Tensor | None = None,
        zero_states: bool = False,
    ) -> None:
        """Sets rows ``local_ids`` of shard ``index`` where they live: their weights to
        ``weights`` (``(n, cols)``, or one row for all) when given, their optimizer states to
        zero when ``zero_states``. A cached row is set in its slot (and written back later), any
        other on its tier, as TorchRec's FUSED kernel would set its rows in place (fbgemm's
        ``reset_embedding_weight_momentum``, writes through its registered weight). The rows
        count as changed for incremental checkpoints."""
        shard = self.shards[index]
        ids, slots = self._rows_by_id(index, local_ids)
        if not ids.numel() or (weights is None and not zero_states):
            return
        parts = self._targets(shard)
        if weights is not None:
            weights = weights.to(shard.weight_slots.dtype).expand(ids.numel(), shard.cols)
        values: list[tuple[slice, torch.Tensor, torch.Tensor]] = []  # columns, fbgemm's, new
        if weights is not None:
            values.append((*parts[0], weights))
        if zero_states:
            values.extend((cols, slots_of, torch.zeros(())) for cols, slots_of in parts[1:])
        cached = slots >= 0
        if bool(cached.any()):
            where = torch.nonzero(cached).flatten()
            dev_slots = slots[cached].to(self.device)
            for _, tensor, new in values:
                part = new[where.to(new.device)] if new.dim() else new
                tensor[dev_slots] = part.to(self.device, tensor.dtype)
            with self._locked():
                shard.cache.mark_dirty(slots[cached].to(shard.cache.device))
        if not bool(cached.all()):
            where = torch.nonzero(~cached).flatten()
            on_tier = ids[where].numpy()
            width = shard.store.layout.row_width
            # Rows whose every column is set are written without reading them first (a
            # managed-collision reset under row-wise Adagrad: weights and momentum).
            whole = (
                weights is not None
                and (zero_states or len(parts) == 1)
                and parts[-1][0].stop == width
            )
            rows = (
                torch.empty(len(on_tier), width, dtype=torch.float32)
                if whole
                else torch.from_numpy(shard.store.read_rows(on_tier))
            )
            for cols, tensor, new in values:
                part = new[where.to(new.device)] if new.dim() else new
                # Through the slots' dtype, so a tier row holds what a slot would.
                rows[:, cols] = part.to(tensor.dtype).to(HOST, torch.float32)
            shard.store.write_rows(on_tier, rows.numpy())
        if self._changed is not None:
            self._changed[index][ids] = True

    def purge(self) -> None:
        """Writes dirty rows back, then empties the caches, so the next batch reads every row
        from the tier (used after a checkpoint load wrote the tier directly)."""
        self.cancel_prefetches()
        self.flush(keep_in_flight_dirty=False)
        self.views.refresh()  # a load may write only some columns of the views
        self._release_in_flight()
        for shard in self.shards:
            shard.cache.clear()
        # Hot rows come back with the next batch: a checkpoint load may still be writing the
        # tier (TorchRec purges before its state is copied in).
        self._repin = bool(self._hot_rows)

    @torch.no_grad()
    def initialize(
        self, shard: TieredTableShard, init_fn: Callable[[torch.Tensor], Any], chunk_rows: int
    ) -> None:
        """Fills a table shard's weights chunk by chunk with ``init_fn`` and zeroes its
        optimizer state, never holding more than ``chunk_rows`` rows, nor
        :data:`INIT_CHUNK_BYTES` of them, in memory. An ``init_fn`` that fills rows by their
        place in the table (:class:`RowAddressedInit`) is told where each chunk lies, so the
        shard gets the rows any other placement would give it."""
        shard.cache.clear()
        layout = shard.store.layout
        chunk_rows = max(1, min(chunk_rows, INIT_CHUNK_BYTES // (4 * layout.row_width)))
        for start in range(0, layout.num_rows, chunk_rows):
            count = min(chunk_rows, layout.num_rows - start)
            rows = torch.zeros(count, layout.row_width, dtype=torch.float32)
            weights = torch.empty(count, layout.dim, dtype=layout.dtype.torch_dtype)
            if isinstance(init_fn, RowAddressedInit):
                init_fn.fill(weights, shard.row_offset + start, shard.col_offset)
            else:
                init_fn(weights)
            rows[:, : layout.dim] = weights.to(torch.float32)
            shard.store.write_range(start, rows.numpy())
        shard.store.flush()
        release_freed_memory()  # the chunks' memory, kept by the C heap otherwise

    def pin_hot_rows(self, index: int, local_ids: torch.Tensor) -> None:
        """Loads the rows ``local_ids`` of shard ``index`` and keeps them resident for good
        (FAE's hot set, from an access profile). They still count in hits, and are written
        back when dirty at flush."""
        shard = self.shards[index]
        ids = torch.unique(local_ids.to(torch.int64))
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= shard.local_rows):
            raise TableIdError(
                f"table {shard.name!r}: hot row ids must lie in [0, {shard.local_rows})"
            )
        if ids.numel() >= shard.cache.num_slots:
            raise ValueError(
                f"table {shard.name!r}: {ids.numel()} hot rows do not fit a cache of "
                f"{shard.cache.num_slots} rows with room for a batch; pin fewer rows or "
                "raise the cache size"
            )
        self._hot_rows[index] = ids
        self._pin(index, ids)

    def _pin(self, index: int, ids: torch.Tensor, inline: bool = False) -> None:
        """Loads ``ids`` and pins them: on this thread when ``inline`` (the worker itself, or no
        background I/O), else on the worker, after the I/O queued before it."""
        shard = self.shards[index]
        with self._locked():
            shard.cache.check_fits(ids)
            plan = shard.cache.plan(ids, count_stats=False)
        if inline or not self.io.background:
            self.apply(shard, plan)
        else:
            self.io.submit(self.apply, shard, plan).result()
        with self._locked():
            shard.cache.pin(plan.slots)

    def close(self) -> None:
        self.cancel_prefetches()
        self._release_in_flight()
        self.io.shutdown()
        self.views.close()
        for shard in self.shards:
            shard.store.close()

    def __iter__(self) -> Iterator[TieredTableShard]:
        return iter(self.shards)

    def stats(self) -> dict[str, dict[str, float]]:
        """Counters per table shard, keyed ``<table>`` (``<table>@<row>,<col>`` for shards
        other than the first)."""
        out: dict[str, dict[str, float]] = {}
        for shard in self.shards:
            key = shard.name
            if key in out or shard.row_offset or shard.col_offset:
                key = f"{shard.name}@{shard.row_offset},{shard.col_offset}"
            out[key] = shard.stats()
        return out


def _offsets(table: ShardedEmbeddingTable) -> tuple[int, int]:
    md = table.local_metadata
    if md is None or not md.shard_offsets:
        return 0, 0
    offsets = [*list(md.shard_offsets), 0, 0]
    return int(offsets[0]), int(offsets[1])


def tiered_groups(model: nn.Module) -> list[TieredTableGroup]:
    """Every tiered kernel's table group in ``model`` on this rank (TorchRec hides the lookups
    from ``named_modules()``, so the tiered sharded modules list them)."""
    out: list[TieredTableGroup] = []
    for module in model.modules():
        groups = getattr(module, "tiered_groups", None)
        if callable(groups):
            out.extend(groups())
    return out
