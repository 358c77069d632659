"""The log-structured block tier: rows appended to segments of a file in whole blocks.

Why: the block tier writes a row back in place, and a 260-byte row (dim 64 fp32 plus a
row-wise Adagrad state) is a read-modify-write of its 4 KiB block, so a batch of 4k evicted
rows costs ~8k random 4 KiB I/Os. Here a batch of rows is packed densely (rows may straddle
blocks, never segments) and appended at the head of the log in one contiguous write, split
into ``max_io_bytes`` pieces kept in flight by the block I/O engine; nothing is ever read to be
written. Reads look the newest copy up in an in-memory index and coalesce rows that share or
neighbour blocks, as the block tier does. That index is the row -> slot map alone, int32 while
the file's slots fit (4 bytes a row): which rows a segment holds, which compaction and export
need, is found by scanning it, once per batch of segments.

The price is dead space: a rewritten row leaves its old copy behind. Compaction copies the live
rows of the emptiest segments to the head so the file stays within ``max_space_amplification``
times the table's row bytes. It runs inline, no thread: before a write when free segments run
short (on segments written since the last flush, the only ones it can free at once), and in
:meth:`flush` before the checkpoint that frees what it emptied.

Crash safety: the index is persisted by ``flush()`` into one of two checkpoint slots
(alternating, each with a generation number and a CRC over the whole slot) after the data is
synced, so after a kill at any moment reopening finds exactly the rows of the last completed
flush. Until the next flush, no segment the last checkpoint still points into is overwritten:
those are *pinned*; rows written since the flush go only to free segments or the unused tail
of the head segment, and are ignored on reopen. Rows rewritten between flushes therefore pin
their flushed copies; when that is more than the bound leaves room for, the file grows past it
(with one warning) and shrinks back at a later flush.

On-disk format (one file, ``<table>.log_block_scm.rows``)::

    0                          FileHeader (tier "log_block_scm"), zero padded to 4 KiB
    4096                       checkpoint slot 0 } header (_CKPT), CRC32, then the index:
    4096 + checkpoint_bytes    checkpoint slot 1 } num_rows little-endian int64 slots (-1: zero)
    data_offset                segment 0, segment 1, ... (segment_bytes each)

A row's slot ``s`` lies at ``data_offset + (s // segment_slots) * segment_bytes +
(s % segment_slots) * row_bytes``. ``data_offset`` (in the FileHeader) is block aligned.

Why one file of this size: one class whose state (the row -> slot index, the segment table, the
pins, the head) every operation (append, read, compaction, checkpoint, export, recovery) updates
under one write lock and one set of invariants; split into modules, each part would reach into
the others' private state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from numpy.lib.stride_tricks import sliding_window_view

from torchrec_mtrains.tiers._blockio import (
    AlignedBuffer,
    BufferPool,
    I64Array,
    PassReader,
    ReadPass,
    ReadSteps,
    merge_runs,
    open_block_file,
    warn_once,
)
from torchrec_mtrains.tiers.base import (
    DATA_OFFSET,
    HeaderMismatchError,
    IdArray,
    OpenMode,
    RowArray,
    RowStore,
    RowStoreError,
    TierStats,
)
from torchrec_mtrains.tiers.options import LogBlockScmOptions, TierOptions
from torchrec_mtrains.tiers.registry import register_tier, resolve_options
from torchrec_mtrains.types import WORD_BYTES, RowLayout

_logger: logging.Logger = logging.getLogger(__name__)

CKPT_MAGIC = b"MTRNLOGI"
# magic, generation, block_size, segment_blocks, segments, head segment, head slot, num_rows,
# row_bytes; then a CRC32 over those fields and the index.
_CKPT = struct.Struct("<8sQIIQqqQI")
_CRC = struct.Struct("<I")
CKPT_HEADER_BYTES = _CKPT.size + _CRC.size
assert CKPT_HEADER_BYTES % 8 == 0  # the index that follows is int64-aligned

_RESERVE_SEGMENTS = 3  # capacity beyond the live rows however small the table: head, spare, slack
_MIN_SEGMENTS = 16  # a small table still spreads over this many segments, so it compacts finely
_MIN_GAIN = 8  # a compaction victim frees at least 1/8 of a segment
_FLUSH_ROUNDS = 4  # compaction + checkpoint rounds one flush may run
_SCAN_CHUNK = 1 << 22  # rows of the index scanned at once (bounds the scan's scratch memory)
_FREE, _USED = 0, 1

U8Array = npt.NDArray[np.uint8]
SlotArray = npt.NDArray[np.signedinteger[Any]]  # the row -> slot map: int32 or int64


def index_dtype(file_slots: int) -> type[np.signedinteger[Any]]:
    """The row -> slot map's element type for a file of ``file_slots`` row slots: int32 while
    every slot fits (2^31 slots of a 260-byte row is ~520 GiB), else int64."""
    return np.int32 if file_slots <= np.iinfo(np.int32).max else np.int64


def index_bytes_per_row(num_rows: int, max_space_amplification: float) -> int:
    """Host memory the store's index takes per table row: its row -> slot map, the only
    per-row state it keeps (which row a slot holds is found by scanning that map)."""
    slots = math.ceil(max_space_amplification * num_rows) + 1
    return int(np.dtype(index_dtype(slots)).itemsize)


@dataclass(frozen=True)
class ScanBatch:
    """Consecutive segments of a log file read in one sequential pass, the live rows they
    hold, and the store version they were counted at (a write since makes them stale)."""

    first_segment: int
    segments: int
    rows: int
    version: int


@dataclass(frozen=True)
class LogGeometry:
    """Where everything lies in a log file of one table, block size and segment size."""

    block_size: int
    row_bytes: int
    num_rows: int
    segment_bytes: int
    segment_slots: int  # rows one segment holds
    checkpoint_bytes: int  # one checkpoint slot
    data_offset: int  # segment 0

    @classmethod
    def for_layout(cls, layout: RowLayout, block_size: int, segment_bytes: int) -> LogGeometry:
        bs, rb = block_size, layout.row_bytes
        live_blocks = -(-layout.total_bytes // bs)
        # Small tables get small segments, so compaction works at a finer grain than the table.
        seg_blocks = min(segment_bytes // bs, max(1, -(-live_blocks // _MIN_SEGMENTS)))
        seg_blocks = max(seg_blocks, -(-rb // bs))  # a segment holds at least one row
        page = max(4096, bs)
        ckpt = -(-(CKPT_HEADER_BYTES + 8 * layout.num_rows) // page) * page
        data_offset = -(-(DATA_OFFSET + 2 * ckpt) // bs) * bs
        return cls(
            bs, rb, layout.num_rows, seg_blocks * bs, seg_blocks * bs // rb, ckpt, data_offset
        )

    @property
    def segment_blocks(self) -> int:
        return self.segment_bytes // self.block_size

    def checkpoint_offset(self, index: int) -> int:
        return DATA_OFFSET + index * self.checkpoint_bytes

    def capacity(self, max_space_amplification: float) -> int:
        """Segments the bound allows, but never fewer than the live rows need plus a reserve."""
        live_segments = -(-self.num_rows // self.segment_slots)
        bound = int(max_space_amplification * self.num_rows * self.row_bytes) // self.segment_bytes
        return max(bound, live_segments + _RESERVE_SEGMENTS)

    def offsets(self, slots: SlotArray) -> I64Array:
        """File byte offsets of ``slots``."""
        seg, within = np.divmod(slots.astype(np.int64, copy=False), self.segment_slots)
        return self.data_offset + seg * self.segment_bytes + within * self.row_bytes


@dataclass
class LogStats:
    """What the log did beyond the rows it was asked to move (also in :class:`TierStats`'s
    byte and I/O counts): compaction, checkpoints and growth past the space bound."""

    compacted_rows: int = 0
    compaction_bytes_read: int = 0
    compaction_bytes_written: int = 0
    segments_reclaimed: int = 0
    checkpoints: int = 0
    checkpoint_bytes: int = 0
    grown_segments: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class _Checkpoint:
    generation: int
    head_segment: int
    head_slot: int
    loc: SlotArray = field(repr=False)


class _ReadGate:
    """Lets reads run concurrently with each other and with appends, and lets the writer wait
    for the reads that started before a segment was freed before it overwrites that segment
    (a read holds the slots it looked up until its I/O completes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._epoch = 0
        self._active: dict[int, int] = {}

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        with self._cond:
            epoch = self._epoch
            self._active[epoch] = self._active.get(epoch, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                left = self._active[epoch] - 1
                if left:
                    self._active[epoch] = left
                else:
                    del self._active[epoch]
                    self._cond.notify_all()

    def drain(self) -> None:
        """Waits until every read that started before this call has finished."""
        with self._cond:
            epoch = self._epoch
            self._epoch += 1
            self._cond.wait_for(lambda: all(e > epoch for e in self._active))


@register_tier
class LogBlockSCMStore(RowStore, PassReader):
    """Rows in a log of segments accessed by aligned block I/O (see the module docstring).

    Args:
        directory: existing, writable directory for the file (on the SSD).
        table: table (or shard) name.
        layout: shape of the rows.
        mode: what to do with an existing file (see :class:`OpenMode`).
        options: :class:`LogBlockScmOptions` (defaults if ``None``). ``block_size``,
            ``queue_depth``, ``direct`` and ``engine`` are kept as attributes, as the block
            tier does; :attr:`geometry` says where things lie, :attr:`log_stats` what the log did.

    Example::

        store = LogBlockSCMStore("/mnt/nvme0/run1", "t_big", RowLayout(100_000_000, 64, 1))
        store.write_rows(ids, rows)  # one sequential append
        store.flush()  # the index is durable: a crash from here on reopens to these rows
    """

    name: ClassVar[str] = "log_block_scm"
    options_type: ClassVar[type[TierOptions]] = LogBlockScmOptions
    serves_tier: ClassVar[str] = "block_scm"
    file_layout: ClassVar[str] = "log"
    options: LogBlockScmOptions

    def __init__(
        self,
        directory: str | os.PathLike[str],
        table: str,
        layout: RowLayout,
        *,
        mode: OpenMode | str = OpenMode.OPEN_OR_CREATE,
        options: LogBlockScmOptions | None = None,
    ) -> None:
        super().__init__(directory, table, layout, mode=mode, options=options)
        opts = self.options
        self.block_size = opts.block_size
        self.queue_depth = opts.queue_depth
        self.geometry = geo = LogGeometry.for_layout(layout, opts.block_size, opts.segment_bytes)
        self.capacity = geo.capacity(opts.max_space_amplification)
        self._max_io_blocks = opts.max_io_bytes // opts.block_size
        self._max_pass_blocks = max(1, opts.max_pass_bytes // opts.block_size)
        self._prepare_file(
            geo.data_offset,
            geo.data_offset + self.capacity * geo.segment_bytes,
            accept_data_offset=lambda offset: True,  # checked below, naming the option
        )
        if self.data_offset != geo.data_offset:
            raise HeaderMismatchError(
                f"{self.path}: rows start at byte {self.data_offset}, where this table with "
                f"block_size={opts.block_size} would have them at {geo.data_offset}: the file "
                f"was made with another block size; set tier 'log_block_scm' option "
                f"'block_size' to the one it was made with"
            )
        try:
            self._fd, self.direct = open_block_file(
                self.path, opts.block_size, geo.data_offset, opts.direct, self.name
            )
        except OSError as e:
            raise self._os_error(e, "opening") from e
        # Idle buffers for a read's and an append's pass; larger ones (a checkpoint of the
        # index is 8 bytes a row) are not pooled.
        self._start_io(opts.engine, opts.queue_depth, opts.max_pass_bytes)
        self._gate = _ReadGate()
        self.log_stats = LogStats()
        self._generation = 0
        self._checkpointed_version = self.version  # the rows the last checkpoint recorded
        self._freed_since_drain = False
        # Live rows' ids by segment, for reading the table batch by batch (_segment_rows).
        self._by_segment: tuple[int, npt.NDArray[np.signedinteger[Any]], I64Array] | None = None
        try:
            self._recover()
        except BaseException:
            self._close()
            raise
        self._remove_stale_spills()
        self.log_stats = LogStats()  # opening is not the work a benchmark measures
        self.stats = TierStats()

    # ------------------------------------------------------------------------ public extras

    @property
    def segments(self) -> int:
        """Segments in the file now (more than :attr:`capacity` only while grown)."""
        return int(self._state.size)

    @property
    def file_data_bytes(self) -> int:
        """Bytes of the file's data region: what ``max_space_amplification`` bounds."""
        return self.segments * self.geometry.segment_bytes

    @property
    def live_rows(self) -> int:
        """Rows written at least once (the others read as zeros and take no space)."""
        return int(self._live.sum())

    def use_buffers(self, pool: BufferPool) -> None:
        """Takes I/O buffers from ``pool``, shared with the other stores of one tier worker,
        which moves one table's rows at a time: one pass's buffer serves them all."""
        self._buffers = pool

    @classmethod
    def file_bytes(cls, layout: RowLayout, options: TierOptions | None = None) -> int:
        opts = resolve_options(cls.name, options)
        assert isinstance(opts, LogBlockScmOptions)
        geo = LogGeometry.for_layout(layout, opts.block_size, opts.segment_bytes)
        return geo.data_offset + geo.capacity(opts.max_space_amplification) * geo.segment_bytes

    def export_rows(
        self,
        out: npt.NDArray[Any],
        chunk_rows: int = 65_536,
        written: Callable[[], None] | None = None,
    ) -> None:
        """Copies every row into ``out`` (``(num_rows, row_words)`` stored words, e.g. a
        file mapping) by sequential I/O only: reading rows by id would be one random read
        per row, and writing them into ``out`` in the log's order would touch its pages at
        random (under a memory cap, a mapping much larger than memory then rereads a page for
        every row). So a table larger than one pass (``max_pass_bytes``) is exported in two:
        one scan of the segments holding rows spills each row to the file of its id range,
        next to the tier file, then each range is read back and written to ``out`` in id
        order, and ``written`` is called after it. Rows never written are zeros in ``out``
        where their range holds rows, and left as they are elsewhere (a new file holds
        zeros). Writes wait meanwhile; reads go on. (``chunk_rows`` is unused.) Spill files
        a killed export leaves behind are removed when the file is next opened."""
        self._check_export_target(out)
        rb, n = self.geometry.row_bytes, self.layout.num_rows
        dtype = self.layout.word_dtype
        range_rows = max(1, self.options.max_pass_bytes // (rb + 8))
        with self._write_lock, self._gate.reading():
            if range_rows >= n:
                for owners, raw in self._scan_rows():
                    out[owners] = raw.view(dtype).reshape(owners.size, -1)
                if written is not None:
                    written()
                return
            with tempfile.TemporaryDirectory(
                prefix=self._spill_prefix(), dir=self.directory
            ) as spill:
                ranges = self._spill_by_id_range(Path(spill), range_rows)
                for k, (ids_file, rows_file) in sorted(ranges.items()):
                    first = k * range_rows
                    ids = np.fromfile(ids_file, dtype="<i8")
                    rows = np.fromfile(rows_file, dtype=np.uint8).reshape(ids.size, rb)
                    ids_file.unlink()
                    rows_file.unlink()
                    slab = np.zeros((min(range_rows, n - first), rb), dtype=np.uint8)
                    slab[ids - first] = rows
                    out[first : first + slab.shape[0]] = slab.view(dtype).reshape(slab.shape[0], -1)
                    if written is not None:
                        written()

    def _spill_prefix(self) -> str:
        return f".{self.path.name}.export."

    def _remove_stale_spills(self) -> None:
        """Removes the spill folders of exports whose process was killed: each can hold a
        copy of the table. A tier file has one user at a time, so any found at open are
        stale."""
        prefix = self._spill_prefix()  # matched as text: a table's name may hold glob characters
        for stale in self.directory.iterdir():
            if not (stale.name.startswith(prefix) and stale.is_dir()):
                continue
            size = sum(f.stat().st_size for f in stale.iterdir() if f.is_file())
            shutil.rmtree(stale, ignore_errors=True)
            _logger.warning(
                "%s: removed %s (%d bytes), left by an export that did not finish",
                self.path,
                stale,
                size,
            )

    def scan_batches(self) -> list[ScanBatch]:
        """The live rows of the log as runs of consecutive segments of at most
        ``max_pass_bytes``, each read in one sequential pass (:meth:`read_scan_batch`): how a
        checkpoint streams the table, in the log's order, without reading a row at random."""
        sb = self.geometry.segment_bytes
        holding = np.flatnonzero(self._live > 0)
        run = max(1, self.options.max_pass_bytes // sb)
        breaks = np.flatnonzero(np.diff(holding) != 1) + 1
        out = []
        for group in np.split(holding, breaks):
            for first in range(0, group.size, run):
                segs = group[first : first + run]
                rows = int(self._live[segs].sum())
                out.append(ScanBatch(int(segs[0]), int(segs.size), rows, self.version))
        return out

    def read_scan_batch(self, batch: ScanBatch) -> tuple[I64Array, npt.NDArray[Any]]:
        """The ids and rows (float32 ``(rows, row_width)``: weights, then optimizer state) of
        one of :meth:`scan_batches`, segment by segment (ids ascending within one).

        Raises:
            RowStoreError: when the table was written since the batches were listed (they no
                longer describe it), naming the file.
        """
        with self._write_lock, self._gate.reading():
            self._check_scan(batch)
            owners, raw = self._read_segments(batch.first_segment, batch.segments)
        if owners.size != batch.rows:
            raise RowStoreError(
                f"{self.path}: segments {batch.first_segment}..+{batch.segments} hold "
                f"{owners.size} rows, the segment table says {batch.rows}"
            )
        return owners, self.layout.decode(raw.reshape(owners.size, -1))

    def scan_batch_ids(self, batch: ScanBatch) -> I64Array:
        """The ids of one of :meth:`scan_batches`, in the order :meth:`read_scan_batch` gives
        its rows, from the index alone (no data is read)."""
        with self._write_lock:
            self._check_scan(batch)
            owners, _ = self._segment_rows(batch.first_segment, batch.segments)
        return owners

    def _check_scan(self, batch: ScanBatch) -> None:
        if self.version != batch.version:
            raise RowStoreError(
                f"{self.path}: written since its scan was planned (version {batch.version}, "
                f"now {self.version}); nothing may write a table while it is saved"
            )

    def _read_segments(self, first: int, count: int) -> tuple[I64Array, U8Array]:
        """The rows whose newest copy lies in segments ``first ..+count``, read in one
        sequential pass: ids and raw rows (``(rows, row_bytes)`` bytes), segment by segment."""
        geo = self.geometry
        ss, sb, rb = geo.segment_slots, geo.segment_bytes, geo.row_bytes
        region = self._read_region(geo.data_offset + first * sb, count * sb)
        owners, slots = self._segment_rows(first, count)
        # (segment, slot, byte) view of the run: no per-byte index to build.
        packed = region.reshape(count, sb)[:, : ss * rb].reshape(count, ss, rb)
        return owners, packed[slots // ss - first, slots % ss]

    def _segment_rows(self, first: int, count: int) -> tuple[I64Array, I64Array]:
        """The rows whose newest copy lies in segments ``first ..+count``, ids and slots,
        segment by segment. They come from every live row's id grouped by segment, made by one
        scan of the index and kept until the next write: a table read batch by batch would
        otherwise scan the whole index once per batch (~850 times for a 14M-row table)."""
        if self._by_segment is None or self._by_segment[0] != self.version:
            self._by_segment = None  # the stale grouping's memory first
            self._by_segment = (self.version, *self._group_by_segment())
        _, ids, starts = self._by_segment
        picked = ids[starts[first] : starts[first + count]].astype(np.int64)
        return picked, self._loc[picked].astype(np.int64)

    def _group_by_segment(self) -> tuple[npt.NDArray[np.signedinteger[Any]], I64Array]:
        """Every live row's id, grouped by the segment of its newest copy (ids ascending
        within one), and where each segment's group starts: 4 bytes a live row (8 past 2^31
        rows), scratch memory bounded by the scan's chunks."""
        ss = self.geometry.segment_slots
        starts = np.concatenate(([0], np.cumsum(self._live))).astype(np.int64)
        width = np.int32 if self.layout.num_rows < 2**31 else np.int64
        ids: npt.NDArray[np.signedinteger[Any]] = np.empty(int(starts[-1]), dtype=width)
        fill = starts[:-1].copy()
        loc = self._loc
        for start in range(0, loc.size, _SCAN_CHUNK):
            piece = loc[start : start + _SCAN_CHUNK]
            live = np.flatnonzero(piece >= 0)
            segment = piece[live] // ss
            order = np.argsort(segment, kind="stable")
            segment, live = segment[order], live[order] + start
            found, first, counts = np.unique(segment, return_index=True, return_counts=True)
            rank = np.arange(segment.size) - np.repeat(first, counts)
            ids[fill[segment] + rank] = live
            fill[found] += counts
        return ids, starts

    def _scan_rows(self) -> Iterator[tuple[I64Array, U8Array]]:
        """Every live row of the log, batch by batch (:meth:`scan_batches`): ids and raw rows
        (``(count, row_bytes)`` bytes)."""
        for batch in self.scan_batches():
            yield self._read_segments(batch.first_segment, batch.segments)

    def _spill_by_id_range(self, directory: Path, range_rows: int) -> dict[int, tuple[Path, Path]]:
        """Appends every live row to the files of its id range (``range_rows`` ids each) in
        ``directory``: its id and its bytes. Returns the files by range."""
        files: dict[int, tuple[Path, Path]] = {}
        for owners, raw in self._scan_rows():
            order = np.argsort(owners // range_rows, kind="stable")
            owners, raw = owners[order], raw[order]
            keys = owners // range_rows
            cuts = np.flatnonzero(np.diff(keys)) + 1
            for part in np.split(np.arange(owners.size), cuts):
                if not part.size:
                    continue
                k = int(keys[part[0]])
                pair = files.setdefault(k, (directory / f"{k}.ids", directory / f"{k}.rows"))
                try:
                    with open(pair[0], "ab") as f:
                        owners[part].astype("<i8").tofile(f)
                    with open(pair[1], "ab") as f:
                        raw[part].tofile(f)
                except OSError as e:
                    raise self._os_error(e, f"spilling rows to {directory} for an export") from e
        return files

    # ----------------------------------------------------------------------- state & recovery

    def _recover(self) -> None:
        """Loads the newest valid checkpoint (none for a new file) and rebuilds the segment
        table from it; segments written after it are free again."""
        geo = self.geometry
        segments = (self._file_size() - geo.data_offset) // geo.segment_bytes
        ckpt = None if self.created else self._load_checkpoint(segments)
        if ckpt is None:
            slots = max(segments, self.capacity) * geo.segment_slots
            loc = np.full(self.layout.num_rows, -1, dtype=index_dtype(slots))
            ckpt = _Checkpoint(0, -1, 0, loc)
        self._install(ckpt, segments)
        if segments < self.capacity:  # a new file is made at capacity; this grows older ones
            self._resize(self.capacity)
        if ckpt.generation == 0:
            self._checkpoint()

    def _install(self, ckpt: _Checkpoint, segments: int) -> None:
        ss = self.geometry.segment_slots
        self._loc = ckpt.loc.astype(index_dtype(max(segments, self.capacity) * ss), copy=False)
        self._generation = ckpt.generation
        self._live = np.zeros(segments, dtype=np.int64)
        for start in range(0, self._loc.size, _SCAN_CHUNK):  # bounds the scratch memory
            piece = self._loc[start : start + _SCAN_CHUNK]
            self._live += np.bincount(piece[piece >= 0] // ss, minlength=segments)
        self._state = np.where(self._live > 0, _USED, _FREE).astype(np.int8)
        self._pinned = self._live > 0
        self._head = ckpt.head_segment
        self._head_slot = ckpt.head_slot
        if self._head >= 0:
            self._state[self._head] = _USED
        self._tail = self._zero_prefix()

    def _zero_prefix(self) -> U8Array:
        """The head block's bytes before the head slot when no row of it is in memory (after a
        seal those bytes are padding, never a row that must be kept)."""
        if self._head < 0:
            return np.zeros(0, dtype=np.uint8)
        return np.zeros(self._head_slot * self.geometry.row_bytes % self.block_size, np.uint8)

    def _load_checkpoint(self, segments: int) -> _Checkpoint | None:
        """The newest checkpoint whose CRC holds; ``None`` when none was ever completed. (The
        older slot may point at segments truncated since: only the newest is checked.) Slots
        are read a pass at a time into the row -> slot map, never whole."""
        geo = self.geometry
        heads = [self._read_region(geo.checkpoint_offset(i), self.block_size) for i in (0, 1)]
        found = {i: h for i in (0, 1) if (h := self._header_of(heads[i])) is not None}
        order = sorted(found, key=lambda i: -found[i][1])
        for i in order:
            ckpt = self._read_checkpoint(i, segments)
            if ckpt is not None:
                return ckpt
        if self._never_checkpointed(heads):
            return None
        raise RowStoreError(
            f"{self.path}: corrupt index: neither checkpoint slot passes its checksum; the "
            f"rows cannot be located (reopen with mode=truncate to start the table over)"
        )

    @staticmethod
    def _never_checkpointed(raw: list[U8Array]) -> bool:
        # A file killed while being created: both slots zero, or only the first checkpoint
        # (written before the constructor returns, holding no rows) torn.
        headers = [bytes(r[: _CKPT.size]) for r in raw]
        if all(not any(h) for h in headers):
            return True
        torn = [h for h in headers if any(h)]
        return len(torn) == 1 and torn[0][:8] == CKPT_MAGIC and _CKPT.unpack(torn[0])[1] == 1

    @staticmethod
    def _header_of(raw: U8Array) -> tuple[Any, ...] | None:
        fields = _CKPT.unpack(bytes(raw[: _CKPT.size]))
        return fields if fields[0] == CKPT_MAGIC else None

    def _read_checkpoint(self, index: int, segments: int) -> _Checkpoint | None:
        """Slot ``index`` as a checkpoint, ``None`` when its checksum fails. Raises when it
        holds and describes another file, or points outside ``segments``."""
        geo, n = self.geometry, self.layout.num_rows
        offset = geo.checkpoint_offset(index)
        head = self._read_region(offset, self.block_size)
        fields = self._header_of(head)
        assert fields is not None
        _, gen, bs, seg_blocks, _, head_seg, head_slot, num_rows, row_bytes = fields
        if (num_rows, row_bytes) != (n, geo.row_bytes):
            if not self._crc_holds(offset, head, num_rows):
                return None
            raise RowStoreError(
                f"{self.path}: corrupt index: a checkpoint for {num_rows} rows of {row_bytes} "
                f"bytes in a file whose header says {n} rows of {geo.row_bytes} bytes"
            )
        limit = segments * geo.segment_slots
        loc = np.empty(n, dtype=index_dtype(max(segments, self.capacity) * geo.segment_slots))
        (expected,) = _CRC.unpack_from(head.data, _CKPT.size)
        crc = zlib.crc32(bytes(head[: _CKPT.size]))
        taken = np.zeros(limit, dtype=np.bool_)  # which slots a row points at: none twice
        bad = False
        for start, end in self._slot_pieces():
            piece = self._read_region(offset + start, end - start)
            first = max(start, CKPT_HEADER_BYTES)
            last = min(end, CKPT_HEADER_BYTES + 8 * n)
            if first >= last:
                continue
            raw = piece[first - start : last - start]
            crc = zlib.crc32(raw.data, crc)
            values = raw.view("<i8")
            rows = slice((first - CKPT_HEADER_BYTES) // 8, (last - CKPT_HEADER_BYTES) // 8)
            used = values[values >= 0]
            if (values < -1).any() or (used >= limit).any():
                bad = True
                continue
            if taken[used].any() or np.unique(used).size != used.size:
                bad = True
            taken[used] = True
            loc[rows] = values
        if crc != expected:
            return None
        if bs != geo.block_size:
            raise HeaderMismatchError(
                f"{self.path}: the file was made with block_size={bs}; tier 'log_block_scm' "
                f"option 'block_size' is {geo.block_size} (use the file's)"
            )
        if seg_blocks != geo.segment_blocks:
            raise HeaderMismatchError(
                f"{self.path}: the file's segments are {seg_blocks * bs} bytes; tier "
                f"'log_block_scm' option 'segment_bytes'={self.options.segment_bytes} gives "
                f"{geo.segment_bytes} for this table (use the file's)"
            )
        if bad or not -1 <= head_seg < segments or not 0 <= head_slot <= geo.segment_slots:
            raise RowStoreError(
                f"{self.path}: corrupt index: a checkpoint with a valid checksum points outside "
                f"the file's {segments} segments or twice at one slot"
            )
        return _Checkpoint(gen, head_seg, head_slot, loc)

    def _crc_holds(self, offset: int, head: U8Array, num_rows: int) -> bool:
        """Whether a slot whose header names ``num_rows`` rows passes its checksum."""
        (expected,) = _CRC.unpack_from(head.data, _CKPT.size)
        crc = zlib.crc32(bytes(head[: _CKPT.size]))
        size = CKPT_HEADER_BYTES + 8 * num_rows
        step = self._max_pass_blocks * self.block_size
        for start in range(0, size, step):
            end = min(start + step, size)
            nbytes = -(-end // self.block_size) * self.block_size - start
            piece = self._read_region(offset + start, nbytes)
            lo = max(start, CKPT_HEADER_BYTES)
            crc = zlib.crc32(piece[lo - start : end - start].data, crc)
        return crc == expected

    # ---------------------------------------------------------------------------- raw I/O

    def _file_size(self) -> int:
        try:
            return os.fstat(self._fd).st_size
        except OSError as e:
            raise self._os_error(e, "reading the file size") from e

    def _run(
        self,
        write: bool,
        buf: AlignedBuffer,
        buf_offsets: I64Array,
        file_offsets: I64Array,
        lengths: I64Array,
    ) -> int:
        try:
            return self._engine.run(self._fd, write, buf, buf_offsets, file_offsets, lengths)
        except OSError as e:
            raise self._os_error(e, "writing blocks" if write else "reading blocks") from e

    def _pieces(self, offset: int, nbytes: int) -> tuple[I64Array, I64Array, I64Array]:
        """A contiguous, block-aligned region as I/Os of at most ``max_io_bytes``: buffer
        offsets, file offsets and lengths."""
        step = self._max_io_blocks * self.block_size
        starts = np.arange(0, nbytes, step, dtype=np.int64)
        return starts, offset + starts, np.minimum(step, nbytes - starts)

    def _read_region(self, offset: int, nbytes: int) -> U8Array:
        pooled = nbytes <= self.options.max_pass_bytes
        buf = self._buffers.take(nbytes) if pooled else AlignedBuffer(nbytes)
        try:
            calls = self._run(False, buf, *self._pieces(offset, nbytes))
            self._count(bytes_read=nbytes, io_calls=calls)
            return buf.array[:nbytes].copy()
        finally:
            if pooled:
                self._buffers.give(buf)

    def _sync(self) -> int:
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            raise self._os_error(e, "syncing") from e
        return 1

    # -------------------------------------------------------------------------------- reads

    def _read_rows(self, ids: IdArray, out: RowArray) -> tuple[int, int]:
        return self._drive(self.read_passes(ids, out))

    def read_passes(self, ids: IdArray, out: RowArray) -> ReadSteps:
        with self._gate.reading():
            slots = self._loc[ids]
            hit = slots >= 0
            if hit.all():
                return (yield from self._gather_passes(slots, out))
            out[~hit] = 0.0  # never written: a new table reads as zeros
            if not hit.any():
                return 0, 0
            rows = np.empty((int(hit.sum()), self.layout.row_width), np.float32)
            moved_calls = yield from self._gather_passes(slots[hit], rows)
            out[hit] = rows
            return moved_calls

    def _gather(self, slots: I64Array) -> tuple[npt.NDArray[Any], int, int]:
        """Rows at ``slots`` as stored words; returns the rows, bytes and calls."""
        out = np.empty((slots.size, self.layout.row_words), self.layout.word_dtype)
        moved, calls = self._drive(self._gather_passes(slots, out, decode=False))
        return out, moved, calls

    def _gather_passes(
        self, slots: I64Array, out: npt.NDArray[Any], decode: bool = True
    ) -> ReadSteps:
        """Rows at ``slots`` into ``out`` (float32 rows, or stored words unless ``decode``),
        reading the blocks that cover them in merged runs, in passes of at most
        ``max_pass_bytes``."""
        bs, rb = self.block_size, self.geometry.row_bytes
        offsets = self.geometry.offsets(slots)
        order = None
        if offsets.size > 1 and not (np.diff(offsets) >= 0).all():
            order = np.argsort(offsets, kind="stable")
            offsets = offsets[order]
        first, last = offsets // bs, (offsets + rb - 1) // bs
        moved = calls = 0
        for part in self._passes(first, last):
            blocks, buf_pos = _cover(first[part], last[part], offsets[part] % bs, bs)
            nbytes = blocks.size * bs
            run_start, run_len = merge_runs(blocks, self._max_io_blocks)
            data, pass_calls = yield ReadPass(
                self._fd, nbytes, run_start * bs, blocks[run_start] * bs, run_len * bs
            )
            calls += pass_calls
            elements = data.view(self.layout.word_dtype)
            dest = np.arange(part.start, part.stop) if order is None else order[part]
            # Every row_words-long window of the buffer, as a view: taking the windows that
            # start at the rows' words copies each row whole (no index per element).
            windows = sliding_window_view(elements, self.layout.row_words)
            words = windows[buf_pos // WORD_BYTES]
            out[dest] = self.layout.decode(words) if decode else words
            moved += nbytes
        return moved, calls

    def _passes(self, first: I64Array, last: I64Array) -> list[slice]:
        """Slices of offset-sorted rows whose covering blocks fit ``max_pass_bytes``."""
        n = first.size
        prev_last = np.concatenate(([-1], np.maximum.accumulate(last)[:-1]))
        added = np.maximum(last - np.maximum(first, prev_last + 1) + 1, 0)
        total = np.cumsum(added)
        budget = self._max_pass_blocks
        if int(total[-1]) <= budget:
            return [slice(0, n)]
        cuts = np.searchsorted(total, np.arange(budget, int(total[-1]), budget), side="right")
        bounds = np.unique(np.concatenate(([0], cuts, [n]))).tolist()
        return [slice(a, b) for a, b in pairwise(bounds)]

    # ------------------------------------------------------------------------------- writes

    def _write_rows(self, ids: IdArray, rows: RowArray) -> tuple[int, int]:
        raw = self.layout.encode(rows).view(np.uint8).reshape(ids.size, -1)
        # Rows whose append (with a partial block at each end of each segment it spans) fits
        # one pass's buffer.
        geo, budget = self.geometry, self._max_pass_blocks * self.block_size
        padding = 2 * self.block_size * (budget // geo.segment_bytes + 2)
        per_pass = max(1, (budget - padding) // geo.row_bytes)
        moved = calls = 0
        for start in range(0, ids.size, per_pass):
            part = slice(start, start + per_pass)
            count = raw[part].shape[0]
            self._make_room(count)
            m, c = self._append(ids[part], raw[part])
            moved, calls = moved + m, calls + c
        return moved, calls

    def _available(self) -> int:
        """Slots writable now without compaction: the head's rest and the free segments."""
        ss = self.geometry.segment_slots
        head_room = ss - self._head_slot if self._head >= 0 else 0
        return head_room + int(np.count_nonzero(self._state == _FREE)) * ss

    def _make_room(self, count: int) -> None:
        """Frees segments until ``count`` rows fit with a segment to spare for compaction:
        compacts segments written since the last flush (the others are pinned by it), the
        emptiest first and as many per scan of the index as one evacuation can take, or grows
        the file past the bound when none has enough dead rows."""
        ss = self.geometry.segment_slots
        need = count + ss
        while (available := self._available()) < need:
            victims = self._batch_of_victims(-(-(need - available) // ss), pinned_ok=False)
            if not victims.size:
                self._grow(-(-(need - available) // ss))
                return
            self._evacuate(victims)

    def _append(self, ids: IdArray, raw: U8Array) -> tuple[int, int]:
        """Writes ``raw`` rows as the next slots of the log, in one engine call, then points
        the index at them. Returns bytes written and calls."""
        bs, rb, ss = self.block_size, self.geometry.row_bytes, self.geometry.segment_slots
        continuing = self._head >= 0 and self._head_slot < ss
        prefix = self._tail if continuing else np.zeros(0, dtype=np.uint8)
        pieces = self._claim(ids.size)
        regions = [_Region.of(seg, a, k, rb, bs) for seg, a, k in pieces]
        nbytes = sum(r.nbytes for r in regions)
        buf = self._buffers.take(nbytes)
        try:
            io: list[tuple[I64Array, I64Array, I64Array]] = []
            pos = done = 0
            for i, region in enumerate(regions):
                view = buf.array[pos : pos + region.nbytes]
                view[: region.skip] = prefix if i == 0 else 0
                view[region.skip : region.end] = raw[done : done + region.count].reshape(-1)
                view[region.end :] = 0
                b, f, n = self._pieces(self._region_offset(region), region.nbytes)
                io.append((b + pos, f, n))
                pos, done = pos + region.nbytes, done + region.count
            buf_offsets, file_offsets, lengths = (np.concatenate(col) for col in zip(*io))
            calls = self._run(True, buf, buf_offsets, file_offsets, lengths)
            self._tail = self._tail_of(buf.array[pos - regions[-1].nbytes : pos], regions[-1].end)
        except BaseException:
            self._head, self._head_slot = -1, 0  # head block unknown: use a new one
            raise
        finally:
            self._buffers.give(buf)
        new = [np.arange(s * ss + a, s * ss + a + k, dtype=np.int64) for s, a, k in pieces]
        self._point(ids, np.concatenate(new))
        return nbytes, calls

    def _region_offset(self, region: _Region) -> int:
        geo = self.geometry
        return (
            geo.data_offset
            + region.segment * geo.segment_bytes
            + region.first_block * geo.block_size
        )

    def _tail_of(self, region: U8Array, end: int) -> U8Array:
        """The bytes of the region's last block up to ``end``: what the next append must
        write again before its first row when it starts in that block."""
        if end % self.block_size == 0:
            return np.zeros(0, dtype=np.uint8)
        return region[end // self.block_size * self.block_size : end].copy()

    def _claim(self, count: int) -> list[tuple[int, int, int]]:
        """Reserves the next ``count`` slots: ``(segment, first slot, rows)`` pieces, the
        head's rest first, then free segments (lowest first, so the file's tail empties)."""
        ss = self.geometry.segment_slots
        pieces = []
        while count:
            if self._head < 0 or self._head_slot >= ss:
                self._head, self._head_slot = self._allocate(), 0
            k = min(count, ss - self._head_slot)
            pieces.append((self._head, self._head_slot, k))
            self._head_slot += k
            count -= k
        return pieces

    def _allocate(self) -> int:
        free = np.flatnonzero(self._state == _FREE)
        if not free.size:
            raise RowStoreError(f"{self.path}: internal error: no free segment to append to")
        if self._freed_since_drain:  # reads that looked up rows there before must finish
            self._gate.drain()
            self._freed_since_drain = False
        segment = int(free[0])
        self._state[segment] = _USED
        return segment

    def _point(self, ids: IdArray, new: I64Array) -> None:
        """Points ``ids`` at ``new`` slots (now on the medium) and frees segments left empty."""
        self._by_segment = None  # rows moved: the grouping is stale (and its memory freed now)
        ss = self.geometry.segment_slots
        old = self._loc[ids]
        old = old[old >= 0]
        self._loc[ids] = new
        self._live += np.bincount(new // ss, minlength=self._live.size)
        emptied = old // ss
        self._live -= np.bincount(emptied, minlength=self._live.size)
        self._free_empty(np.unique(emptied))

    def _free_empty(self, segments: I64Array) -> None:
        """Frees those of ``segments`` that hold no row and no row of the last checkpoint."""
        empty = segments[(self._live[segments] == 0) & ~self._pinned[segments]]
        empty = empty[(self._state[empty] == _USED) & (empty != self._head)]
        if empty.size:
            self._state[empty] = _FREE
            self._freed_since_drain = True
            self.log_stats.segments_reclaimed += int(empty.size)

    # --------------------------------------------------------------------------- compaction

    def _victims(self, pinned_ok: bool) -> I64Array:
        """Segments whose compaction frees a useful share of them, emptiest first: at a flush
        (``pinned_ok``: freed by the next checkpoint) 1/8; between flushes, where only
        segments written since the last one can be freed, 1/4 (copying fuller segments costs
        more I/O than the space is worth: the file grows instead until the next flush)."""
        ss = self.geometry.segment_slots
        candidates = (self._state == _USED) & (self._live > 0)
        candidates &= self._live <= ss - max(1, ss // (_MIN_GAIN if pinned_ok else _MIN_GAIN // 2))
        if not pinned_ok:
            candidates &= ~self._pinned
        if self._head >= 0:
            candidates[self._head] = False
        found = np.flatnonzero(candidates)
        return found[np.argsort(self._live[found], kind="stable")]

    def _rows_between(self, first_slot: int, end_slot: int) -> tuple[I64Array, I64Array]:
        """The rows whose newest copy lies in slots ``first_slot`` up to ``end_slot``: ids and
        slots, in slot order."""
        return self._scan(lambda loc: (loc >= first_slot) & (loc < end_slot))

    def _rows_in(self, segments: I64Array) -> tuple[I64Array, I64Array]:
        """The rows whose newest copy lies in ``segments``: ids and slots, in slot order."""
        if segments.size == 1:
            ss, first = self.geometry.segment_slots, int(segments[0])
            return self._rows_between(first * ss, (first + 1) * ss)
        wanted = np.zeros(self.segments + 1, dtype=bool)  # the last entry: loc -1 (no copy)
        wanted[segments] = True
        ss = self.geometry.segment_slots
        return self._scan(lambda loc: wanted[loc // ss])

    def _scan(
        self, select: Callable[[SlotArray], npt.NDArray[np.bool_]]
    ) -> tuple[I64Array, I64Array]:
        """Ids whose slot ``select`` keeps (a mask over a piece of the row -> slot map) and
        their slots, in slot order. The map is scanned in pieces to bound scratch memory."""
        loc = self._loc
        found = [
            np.flatnonzero(select(loc[start : start + _SCAN_CHUNK])) + start
            for start in range(0, loc.size, _SCAN_CHUNK)
        ]
        ids = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        slots = loc[ids].astype(np.int64)
        order = np.argsort(slots, kind="stable")
        return ids[order].astype(np.int64, copy=False), slots[order]

    def _evacuate(self, segments: I64Array) -> None:
        """Copies the live rows of ``segments`` to the head (the caller made room for them)."""
        ids, slots = self._rows_in(segments)
        if not ids.size:
            return
        rows, read, read_calls = self._gather(slots)
        written, write_calls = self._append(ids, rows.view(np.uint8).reshape(ids.size, -1))
        self._count(bytes_read=read, bytes_written=written, io_calls=read_calls + write_calls)
        stats = self.log_stats
        stats.compacted_rows += int(ids.size)
        stats.compaction_bytes_read += read
        stats.compaction_bytes_written += written

    def _grow(self, segments: int) -> None:
        warn_once(
            f"log-grow-{self.path}",
            "%s: rows rewritten since the last flush() pin their flushed copies, and too few "
            "rows written since are dead to reclaim: the file grows past tier 'log_block_scm' "
            "option 'max_space_amplification'=%s until a later flush() (flush more often or "
            "raise it)",
            self.path,
            self.options.max_space_amplification,
        )
        extra = max(segments, self.capacity // 16)
        self._resize(self.segments + extra)
        self.log_stats.grown_segments += extra

    def _resize(self, segments: int) -> None:
        """Extends or truncates the file to ``segments`` (truncated ones must be free)."""
        geo, old = self.geometry, self.segments
        try:
            if segments > old:
                os.posix_fallocate(self._fd, 0, geo.data_offset + segments * geo.segment_bytes)
            else:
                os.ftruncate(self._fd, geo.data_offset + segments * geo.segment_bytes)
        except OSError as e:
            raise self._os_error(e, f"resizing to {segments} segments") from e
        extra = segments - old
        if extra >= 0:
            wide = index_dtype(segments * geo.segment_slots)
            if self._loc.dtype != wide:  # the file outgrew int32 slots
                self._loc = self._loc.astype(wide)
            self._live = np.concatenate((self._live, np.zeros(extra, np.int64)))
            self._state = np.concatenate((self._state, np.full(extra, _FREE, np.int8)))
            self._pinned = np.concatenate((self._pinned, np.zeros(extra, bool)))
        else:
            self._live, self._state = self._live[:segments], self._state[:segments]
            self._pinned = self._pinned[:segments]

    def _clear(self) -> int:
        """Forgets every row without writing one: all segments free, an empty index
        checkpointed at once (a kill after it reopens an empty table, never rows in segments
        about to be reused), the file back to its bound."""
        self._gate.drain()  # reads that looked rows up finish before their segments are reused
        self._freed_since_drain = False
        self._by_segment = None
        self._loc[:] = -1
        self._live[:] = 0
        self._state[:] = _FREE
        self._head, self._head_slot = -1, 0
        self._tail = self._zero_prefix()
        return self._checkpoint() + self._shrink()

    # ------------------------------------------------------------------------ flush & close

    def _flush(self) -> int:
        """Compacts, then checkpoints: one checkpoint records the written rows and frees the
        segments compaction emptied. Another round (and checkpoint) only while rows sit past
        the bound or the free target is missed, and the last round moved rows or freed room
        for compaction to move more."""
        if self._checkpointed_version == self.version and self.segments <= self.capacity:
            # Nothing written since the last checkpoint, nothing past the bound: it stands
            # (a flush at every state dict or purge would rewrite an index of 8 bytes a row).
            self._buffers.clear()
            return 0
        calls = 0
        for _ in range(_FLUSH_ROUNDS):
            moved = self._compact_for_flush()
            free = self._available()
            calls += self._checkpoint()
            progress = moved or self._available() > free
            short = self._free_after_checkpoint() < self._free_target()
            if not (progress and (short or self._live[self.capacity :].any())):
                break
        # A flush ends bulk work (a table's initial fill, compaction, a load): its pass-sized
        # buffers would otherwise stay resident through training, which needs far smaller ones.
        self._buffers.clear()
        return calls + self._shrink()

    def _seal_head(self) -> None:
        """Moves the head past its last written block, so no later append rewrites a block
        holding rows a checkpoint makes durable (a torn rewrite could lose them, and after a
        reopen the head block's earlier bytes are not in memory)."""
        if self._head < 0:
            return
        rb, bs = self.geometry.row_bytes, self.block_size
        end = self._head_slot * rb
        if end % bs:  # first slot starting in a block no written row reaches into
            self._head_slot = _ceil_div(_ceil_div(end, bs) * bs, rb)
        if self._head_slot >= self.geometry.segment_slots or self._head >= self.capacity:
            self._head, self._head_slot = -1, 0
        self._tail = self._zero_prefix()

    def _checkpoint(self) -> int:
        """Makes the data durable, then the index, into the older checkpoint slot; then
        unpins what the previous checkpoint held and frees segments left empty.

        The slot is written in pass-sized pieces, its first block (header and checksum) last:
        an index of ``num_rows`` int64s (80 MB for 10M rows) is never built whole in memory,
        and until the header lands the slot fails its checksum, so a kill meanwhile leaves the
        other, newer slot in force."""
        geo, n = self.geometry, self.layout.num_rows
        self._seal_head()
        calls = self._sync()
        gen = self._generation + 1
        header = _CKPT.pack(
            CKPT_MAGIC, gen, geo.block_size, geo.segment_blocks, self.segments,
            self._head, self._head_slot, n, geo.row_bytes,
        )  # fmt: skip
        offset = geo.checkpoint_offset(gen % 2)
        pieces = self._slot_pieces()
        crc = zlib.crc32(header)
        first = self._buffers.take(pieces[0][1] - pieces[0][0])
        try:
            crc = self._fill_slot_piece(first, *pieces[0], crc)
            for start, end in pieces[1:]:
                buf = self._buffers.take(end - start)
                try:
                    crc = self._fill_slot_piece(buf, start, end, crc)
                    calls += self._run(True, buf, *self._pieces(offset + start, end - start))
                finally:
                    self._buffers.give(buf)
            head = first.array[:CKPT_HEADER_BYTES]
            head[: _CKPT.size] = np.frombuffer(header, np.uint8)
            head[_CKPT.size :] = np.frombuffer(_CRC.pack(crc), np.uint8)
            size = pieces[0][1] - pieces[0][0]
            calls += self._run(True, first, *self._pieces(offset, size))
        finally:
            self._buffers.give(first)
        calls += self._sync()
        self._generation = gen
        self._checkpointed_version = self.version
        self._count(bytes_written=geo.checkpoint_bytes)
        self.log_stats.checkpoints += 1
        self.log_stats.checkpoint_bytes += geo.checkpoint_bytes
        self._pinned = self._live > 0
        self._free_empty(np.flatnonzero(self._state == _USED))
        return calls

    def _slot_pieces(self) -> list[tuple[int, int]]:
        """A checkpoint slot's byte ranges of at most one pass each, block aligned."""
        total, bs = self.geometry.checkpoint_bytes, self.block_size
        step = max(bs, self._max_pass_blocks * bs)
        return [(a, min(a + step, total)) for a in range(0, total, step)]

    def _fill_slot_piece(self, buf: AlignedBuffer, start: int, end: int, crc: int) -> int:
        """Writes bytes ``start .. end`` of the slot image (header space, then the index as
        little-endian int64, then zeros) into ``buf``; returns the checksum carried over the
        index bytes it holds."""
        out = buf.array[: end - start]
        out[:] = 0
        n = self.layout.num_rows
        first = max(start, CKPT_HEADER_BYTES)
        last = min(end, CKPT_HEADER_BYTES + 8 * n)
        if first >= last:
            return crc
        rows = slice((first - CKPT_HEADER_BYTES) // 8, (last - CKPT_HEADER_BYTES) // 8)
        part = out[first - start : last - start]
        part.view("<i8")[:] = self._loc[rows]
        return zlib.crc32(part.data, crc)

    def _free_target(self) -> int:
        """Free segments a flush leaves: half the dead space the bound allows, so the writes
        until the next flush rarely need the segments it pins."""
        dead_share = 1.0 - 1.0 / self.options.max_space_amplification
        return max(2, math.ceil(self.capacity * dead_share / 2))

    def _free_after_checkpoint(self) -> int:
        """Segments within the bound that are free, or will be once a checkpoint unpins them."""
        state, live = self._state[: self.capacity], self._live[: self.capacity]
        empty = (state == _FREE) | ((state == _USED) & (live == 0))
        if 0 <= self._head < self.capacity:
            empty[self._head] = False
        return int(np.count_nonzero(empty))

    def _compact_for_flush(self) -> bool:
        """Moves the rows of segments past the bound, then of the emptiest segments until
        the free target is in reach; the checkpoint that follows frees them. Returns whether
        it moved anything."""
        moved = False
        spilled = np.flatnonzero(self._live[self.capacity :] > 0) + self.capacity
        pending = spilled[spilled != self._head]
        pending = pending[np.argsort(self._live[pending], kind="stable")]
        while (batch := self._fitting(pending)).size:
            self._evacuate(batch)
            moved = True
            pending = pending[batch.size :]
        while (short := self._free_target() - self._free_after_checkpoint()) > 0:
            victims = self._batch_of_victims(short)
            if not victims.size:
                break
            self._evacuate(victims)
            moved = True
        return moved

    def _batch_of_victims(self, short: int, pinned_ok: bool = True) -> I64Array:
        """The emptiest victims (see :meth:`_victims`) that gain ``short`` free segments net,
        as many as :meth:`_fitting` lets one evacuation take."""
        victims = self._fitting(self._victims(pinned_ok))
        gained = np.arange(1, victims.size + 1) - np.cumsum(self._live[victims]) / (
            self.geometry.segment_slots
        )
        enough = np.flatnonzero(gained >= short)
        return victims[: int(enough[0]) + 1] if enough.size else victims

    def _fitting(self, segments: I64Array) -> I64Array:
        """The longest prefix of ``segments`` whose live rows fit the room there is and one
        pass's buffer (``max_pass_bytes``; the first alone may exceed it), so that one scan
        of the index finds the rows of them all."""
        moved = np.cumsum(self._live[segments])
        fits = moved <= self._available()
        fits[1:] &= moved[1:] * self.geometry.row_bytes <= self.options.max_pass_bytes
        return segments if fits.all() else segments[: int(np.argmin(fits))]

    def _shrink(self) -> int:
        """Truncates free segments past the bound off the end of the file."""
        keep = self.segments
        while keep > self.capacity and self._state[keep - 1] == _FREE and keep - 1 != self._head:
            keep -= 1
        if keep == self.segments:
            return 0
        if self._freed_since_drain:
            self._gate.drain()
            self._freed_since_drain = False
        self._resize(keep)
        return 1

    def _close(self) -> None:
        self._engine.close()
        os.close(self._fd)


@dataclass(frozen=True)
class _Region:
    """The blocks one append writes in one segment: ``count`` rows from slot ``first``,
    ``skip`` bytes after the region's first block start, ending ``end`` bytes into it."""

    segment: int
    count: int
    first_block: int
    skip: int
    end: int
    nbytes: int

    @classmethod
    def of(cls, segment: int, first: int, count: int, row_bytes: int, block_size: int) -> _Region:
        start, stop = first * row_bytes, (first + count) * row_bytes
        first_block = start // block_size
        base = first_block * block_size
        nbytes = -(-stop // block_size) * block_size - base
        return cls(segment, count, first_block, start - base, stop - base, nbytes)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _cover(
    first: I64Array, last: I64Array, within: I64Array, block_size: int
) -> tuple[I64Array, I64Array]:
    """The sorted unique blocks covering rows spanning ``first..last`` (placed back to back
    in a buffer) and each row's byte position in that buffer."""
    span = last - first + 1
    if int(span.max()) == 1:
        covering = first
    else:
        within_row = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
        covering = np.repeat(first, span) + within_row
    blocks = np.unique(covering)
    return blocks, np.searchsorted(blocks, first) * block_size + within
