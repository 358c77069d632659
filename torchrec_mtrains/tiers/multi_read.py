"""Reads of several tables' rows issued together: one submission pass for all their blocks.

A tier worker serves every tiered table of a kernel. Read one table at a time, each table's
misses are a pass of their own: its I/Os are submitted, the queue drains to its last I/O (the
device idles at the tail) and the next table starts. :func:`read_rows_together` issues the
passes of every block store in one list of I/Os across their files, up to one pass's buffer
(``max_pass_bytes``), so the queue stays full across tables and the engine's system calls are
made once for all of them. What each store reads, and the rows it returns, are unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.tiers._blockio import BlockIOError, PassReader, ReadPass, ReadSteps
from torchrec_mtrains.tiers.base import IdArray, RowArray, RowStore

__all__ = ["read_rows_together"]

_ALIGN = 4096  # each store's part of a shared buffer starts on a page (O_DIRECT alignment)


@dataclass
class _Reading:
    """One store's read in progress: its pass generator and the pass it waits for."""

    store: RowStore
    reader: PassReader
    ids: IdArray
    steps: ReadSteps
    reads: ReadPass


def read_rows_together(requests: Sequence[tuple[RowStore, npt.ArrayLike]]) -> list[RowArray]:
    """``[store.read_rows(ids) for store, ids in requests]``, with the block stores' I/O
    issued together (see the module docstring); stores that read otherwise (memory, mapped
    files) read on their own. Counters are kept per store, as :meth:`RowStore.read_rows` keeps
    them (a shared pass's system calls are shared out by the stores' I/Os).

    Stores merge when they share an engine kind and queue depth; the first one's engine and
    buffer pool run the shared passes (a tier worker's stores share one pool).

    Raises:
        RowStoreError: an I/O failed, naming the file of the store it belonged to; every
            read of the call is closed first.
    """
    out: list[RowArray | None] = [None] * len(requests)
    groups: dict[tuple[type, int], list[_Reading]] = {}
    started: list[_Reading] = []
    try:
        for i, (store, ids) in enumerate(requests):
            if not isinstance(store, PassReader):
                out[i] = store.read_rows(ids)
                continue
            ids_arr = store._check_ids(ids)
            rows = np.empty((ids_arr.size, store.layout.row_width), dtype=np.float32)
            out[i] = rows
            if not ids_arr.size:
                continue
            steps = store.read_passes(ids_arr, rows)
            try:
                first = next(steps)
            except StopIteration as done:  # nothing on the device to read (unwritten rows)
                store._count_read(ids_arr.size, *done.value)
                continue
            reading = _Reading(store, store, ids_arr, steps, first)
            started.append(reading)
            key = (type(store._engine), store._engine.depth)
            groups.setdefault(key, []).append(reading)
        for group in groups.values():
            _read_group(group)
    finally:
        for reading in started:
            reading.steps.close()  # releases what an unfinished read holds
    read = [rows for rows in out if rows is not None]
    assert len(read) == len(requests)
    return read


def _read_group(readings: list[_Reading]) -> None:
    """Runs the passes of stores sharing an engine kind, several stores' passes per round."""
    engine, pool = readings[0].reader._engine, readings[0].reader._buffers
    limit = min(r.store.options.max_pass_bytes for r in readings)  # type: ignore[attr-defined]  # block stores: BlockIOOptions
    active = list(readings)
    while active:
        batch: list[_Reading] = []
        bases: list[int] = []
        total = 0
        for r in active:
            size = -(-r.reads.nbytes // _ALIGN) * _ALIGN
            if batch and total + size > limit:
                break
            batch.append(r)
            bases.append(total)
            total += size
        buf = pool.take(total)
        try:
            counts = [r.reads.lengths.size for r in batch]
            fds = np.repeat(np.array([r.reads.fd for r in batch], dtype=np.int64), counts)
            buf_offsets = np.concatenate(
                [r.reads.buf_offsets + base for r, base in zip(batch, bases)]
            )
            file_offsets = np.concatenate([r.reads.file_offsets for r in batch])
            lengths = np.concatenate([r.reads.lengths for r in batch])
            try:
                calls = engine.run(fds, False, buf, buf_offsets, file_offsets, lengths)
            except BlockIOError as e:
                owner = batch[int(np.searchsorted(np.cumsum(counts), e.index, side="right"))]
                raise owner.store._os_error(e, "reading blocks") from e
            except OSError as e:  # not one I/O's (the engine's own): the first file stands in
                raise batch[0].store._os_error(e, "reading blocks") from e
            shares = _share(calls, counts)
            rest = active[len(batch) :]
            for r, base, share in zip(batch, bases, shares):
                try:
                    r.reads = r.steps.send((buf.array[base : base + r.reads.nbytes], share))
                    rest.append(r)
                except StopIteration as done:
                    r.store._count_read(r.ids.size, *done.value)
            active = rest
        finally:
            pool.give(buf)


def _share(calls: int, counts: list[int]) -> list[int]:
    """``calls`` shared out in proportion to ``counts`` (whole calls, summing to ``calls``)."""
    total = sum(counts)
    shares = [calls * n // total for n in counts]
    shares[0] += calls - sum(shares)
    return shares
