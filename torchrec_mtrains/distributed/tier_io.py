"""The tier I/O of one tiered kernel: the worker thread that moves rows between the cache and
the tiers, the row copies themselves, and the counters the look-ahead pipeline reports.

Planning which rows move is the cache's business (:class:`TieredTableGroup`); this class only
carries plans out, on the caller's thread or on its one worker thread, in submission order, so
a row written back is on its tier before any later read of it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import numpy as np
import torch

from torchrec_mtrains.cache.table_cache import CachePlan
from torchrec_mtrains.distributed.copy_streams import RowCopyStreams
from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.tiers import read_rows_together
from torchrec_mtrains.tiers.base import copy_rows_to_columns

# Where the slot maps and the tiers live. The cache's rows are on the compute device (HBM on
# CUDA); the bookkeeping that maps ids to slots runs on the host beside the tiers it feeds.
HOST = torch.device("cpu")
WORKER_THREAD_PREFIX = "mtrains-tier-io"
"""Name prefix of the tier worker threads (profilers and benchmarks tell them apart by it)."""
_T = TypeVar("_T")


@dataclass
class TierIOCounters:
    """How much a tiered kernel waited for and moved rows: what the look-ahead pipeline reports
    per step (take the difference of two snapshots). Cumulative since the group was built.

    Attributes:
        stall_seconds: time the training thread was blocked on tier I/O: waiting in a forward
            for its batch's rows, or moving rows itself when I/O is not in the background. The
            time look-ahead exists to remove.
        io_seconds: time spent moving rows (write-backs, then reads), on whichever thread did
            it; with background I/O most of it overlaps training.
        rows_fetched: rows planned to be read from the tiers into the cache for batches.
        rows_written_back: dirty evicted rows planned to be written to the tiers.
        prefetched_batches: forwards that found their batch already prefetched.
        unprefetched_batches: forwards that had to plan (and, without background I/O, read)
            their rows themselves.
    """

    stall_seconds: float = 0.0
    io_seconds: float = 0.0
    rows_fetched: int = 0
    rows_written_back: int = 0
    prefetched_batches: int = 0
    unprefetched_batches: int = 0

    def __add__(self, other: TierIOCounters) -> TierIOCounters:
        return TierIOCounters(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def __sub__(self, other: TierIOCounters) -> TierIOCounters:
        return TierIOCounters(
            **{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)}
        )


class TierIOWorker:
    """Moves rows for the caches of one kernel whose rows live on ``device``.

    Attributes:
        copies: the copy stream and events that order row copies against training (CUDA).
        background: whether batches are planned and moved on the worker thread (look-ahead).
        failed: a row move raised: the cache may map rows whose read never happened, until the
            group empties it (``stop_background_io``).
        error_reported: such a failure has reached the caller: no batch may run on the cache.
    """

    def __init__(self, device: torch.device) -> None:
        self.copies = RowCopyStreams(device)
        self.background = False
        self.failed = False
        self.error_reported = False
        self._executor: ThreadPoolExecutor | None = None
        # Written by the worker and read by the training thread.
        self._counters = TierIOCounters()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------ the thread

    def submit(self, fn: Callable[..., _T], *args: Any) -> Future[_T]:
        """Runs ``fn(*args)`` on the worker thread, after everything submitted before it."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                1, thread_name_prefix=WORKER_THREAD_PREFIX, initializer=self.copies.enter_worker
            )
        return self._executor.submit(fn, *args)

    def shutdown(self) -> None:
        """Waits for submitted work and ends the thread (a later submit starts a new one)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None

    # ---------------------------------------------------------------------- the counters

    def count(self, **deltas: float) -> None:
        """Adds ``deltas`` to the named counters."""
        with self._lock:
            for name, delta in deltas.items():
                setattr(self._counters, name, getattr(self._counters, name) + delta)

    def counters(self) -> TierIOCounters:
        """A snapshot of the counters."""
        with self._lock:
            return replace(self._counters)

    # ---------------------------------------------------------------------- moving rows

    @torch.no_grad()
    def move_rows(
        self,
        pairs: list[tuple[TieredTableShard, CachePlan]],
        after: torch.cuda.Event | None = None,
        fills: Sequence[tuple[TieredTableShard, torch.Tensor, torch.Tensor]] = (),
    ) -> torch.cuda.Event | None:
        """Carries out a batch's plans: every table's write-backs first, then every table's
        reads, so a failed read never strands another table's evicted dirty rows unwritten.
        The reads of all tables are issued together (:func:`read_rows_together`). Then
        ``fills`` (shard, slots, tier rows) go into their slots: rows made, not read.

        On CUDA the copies run on this thread's current stream, after ``after`` (the slot
        release the plans rely on); returns the event that marks the rows in place."""
        started = time.perf_counter()
        self.copies.wait(after)
        try:
            for shard, plan in pairs:
                if plan.evict_slots.numel() and bool(plan.evict_dirty.any()):
                    dirty = plan.evict_dirty
                    self.write_back(shard, plan.evict_ids[dirty], plan.evict_slots[dirty])
            loads = [(shard, plan) for shard, plan in pairs if plan.load_slots.numel()]
            # Rows in host memory straight into host slots; every other table's misses in
            # shared passes of I/O (one submission round for all).
            direct = [_host_columns(sh) if sh.store.rows_in_memory else None for sh, _ in loads]
            for (shard, plan), columns in zip(loads, direct):
                if columns is not None:
                    shard.store.read_rows_into(
                        plan.load_ids.numpy(), columns, plan.load_slots.numpy()
                    )
            loads = [load for load, columns in zip(loads, direct) if columns is None]
            read = read_rows_together([(sh.store, plan.load_ids.numpy()) for sh, plan in loads])
            for (shard, plan), rows in zip(loads, read):
                self.scatter(shard, plan.load_slots, torch.from_numpy(rows))
            for shard, slots, made in fills:
                self.scatter(shard, slots, made)
        except BaseException:
            self.failed = True
            raise
        finally:
            self.count(io_seconds=time.perf_counter() - started)
        return self.copies.record()

    @staticmethod
    def write_back(shard: TieredTableShard, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Stores the cached rows in ``slots`` as the tier's rows ``ids`` (distinct): from
        host slots by the store's own copy (:meth:`RowStore.write_rows_from`), else gathered
        on the device and copied to the host first."""
        columns = _host_columns(shard)
        if columns is not None:
            shard.store.write_rows_from(ids.numpy(), columns, slots.numpy(), distinct=True)
        else:
            shard.store.write_rows(ids.numpy(), TierIOWorker.gather(shard, slots), distinct=True)

    @staticmethod
    def gather(shard: TieredTableShard, slots: torch.Tensor) -> np.ndarray[Any, Any]:
        """The cached rows in ``slots`` as tier rows: weights, then each optimizer state."""
        dev_slots = RowCopyStreams.device_copy(slots, shard.weight_slots.device)
        parts = [shard.weight_slots.index_select(0, dev_slots)]
        parts += [s.index_select(0, dev_slots) for s in shard.state_slots]
        rows = torch.cat([p.to(torch.float32) for p in parts], dim=1)
        return RowCopyStreams.host_copy(rows).numpy()

    @staticmethod
    def scatter(shard: TieredTableShard, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Puts tier ``rows`` into the cache's ``slots`` (weights and optimizer states)."""
        columns = _host_columns(shard)
        if columns is not None and rows.device.type == "cpu":
            rows_np, at = rows.numpy(), slots.numpy()
            if at.size and (int(at.min()) < 0 or int(at.max()) >= columns[0].shape[0]):
                raise IndexError(
                    f"table {shard.name!r}: a slot outside [0, {columns[0].shape[0]}) to fill"
                )
            # (ids: the rows' own order, through the same compiled copy as a store's)
            order = np.arange(rows_np.shape[0], dtype=np.int64)
            if copy_rows_to_columns(rows_np, order, columns, at):
                return
        device = shard.weight_slots.device
        dev_slots = RowCopyStreams.device_copy(slots, device)
        rows = RowCopyStreams.device_copy(rows, device)
        cols = shard.cols
        shard.weight_slots.index_copy_(0, dev_slots, rows[:, :cols].to(shard.weight_slots.dtype))
        start = cols
        for view in shard.state_slots:
            width = view.shape[1]
            view.index_copy_(0, dev_slots, rows[:, start : start + width].to(view.dtype))
            start += width


def _host_columns(shard: TieredTableShard) -> list[np.ndarray[Any, Any]] | None:
    """The shard's cache slots as numpy views (weights, then each optimizer state) where
    they are host memory of float32, which the stores' compiled row copies take; else None
    (slots on a device, or of another type: torch's copies)."""
    tensors = (shard.weight_slots, *shard.state_slots)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        return None
    return [t.detach().numpy() for t in tensors]
