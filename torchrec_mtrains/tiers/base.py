"""The row-store contract every storage tier implements, its file header and counters.

A *row store* holds one table (or one rank's shard of it) as ``num_rows`` fixed-size rows, each
row the table's weights followed by its optimizer state (see :class:`RowLayout`). Stores are
addressed by row id in batches: the embedding cache asks for the rows it misses and writes back
the rows it evicts, so every method takes a vector of ids.

Files created by a store share one on-disk format: a fixed header block followed by the rows,
packed back to back from ``DATA_OFFSET`` (row ``i`` starts at ``DATA_OFFSET + i * row_bytes``).
The header records the shape (rows, dim, optimizer-state width, the weights' and the state's
element types), so a file made for another table shape, dtype, tier or format version is refused
when opened. New files are created with mode 0600 and preallocated in full,
so a full device is reported when the store is created rather than as a lost write (or, for a
memory mapping, a SIGBUS) later.

How a store is opened beyond that (block size, queue depth, NUMA node, ...) is a small frozen
:class:`TierOptions` dataclass per backend, registered with the store class
(``RowStore.options_type``): one typed path from a config to a store, checked key by key.

Why one file over ~600 lines: the public methods of :class:`RowStore` check ids, shapes and
state and keep the counters before handing over to the few a backend implements, and the file
header is what :meth:`RowStore._prepare_file` creates and checks for every backend; each half
reads only with the other beside it. The registry, the options and the engines live apart
(``registry.py``, ``options.py``, ``_blockio.py``).
"""

from __future__ import annotations

import enum
import errno
import logging
import os
import stat
import struct
import threading
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.cache.kernels import NUMBA_AVAILABLE, _jit
from torchrec_mtrains.tiers.options import TierOptions, own_options
from torchrec_mtrains.types import STATE_DTYPE, RowLayout, StorageDType

logger: logging.Logger = logging.getLogger(__name__)

MAGIC = b"MTRNROWS"
# Version 2 stores the optimizer state in fp32 whatever the weights' type (as fbgemm keeps it)
# and records that type in the header. Version 1 stored the state at the weights' type: its
# files of fp32 tables hold the same bytes and are read; its files of fp16 tables are refused.
LAYOUT_VERSION = 2
# Rows start one 4 KiB block into the file so that block-aligned direct I/O of the data region
# never touches the header. Block tiers with larger blocks round this up to their block size.
DATA_OFFSET = 4096
FILE_SUFFIX = ".rows"
FILE_MODE = 0o600
CLEAR_CHUNK_BYTES = 4 * 2**20  # zeros written at once by a flat store's clear()

# magic, version, tier name, num_rows, dim, state_width, dtype code, state dtype code, row_bytes,
# data_offset, then a crc
_HEADER = struct.Struct("<8sI16sQIIBBIQ")
_HEADER_V1 = struct.Struct("<8sI16sQIIBIQ")  # no state dtype: it was the weights'
_VERSION = struct.Struct("<8sI")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEADER.size + _CRC.size

IdArray = npt.NDArray[np.int64]
RowArray = npt.NDArray[np.float32]
WordArray = npt.NDArray[Any]  # stored rows, (rows, row_words) of RowLayout.word_dtype


class OpenMode(str, enum.Enum):
    """How a store treats an existing file. Nothing already written is ever silently dropped:
    only ``TRUNCATE`` discards existing rows, and only when asked for."""

    CREATE = "create"  # the file must not exist yet
    OPEN = "open"  # the file must exist and match the layout
    OPEN_OR_CREATE = "open_or_create"  # open when present (and matching), otherwise create
    TRUNCATE = "truncate"  # create, replacing any existing file


class RowStoreError(RuntimeError):
    """A store could not be opened or used; the message names the file and the cause."""


class HeaderMismatchError(RowStoreError):
    """An existing file was made for another shape, dtype, tier or format version."""


@dataclass(frozen=True)
class FileHeader:
    """The shape record at the start of every row file."""

    tier: str
    num_rows: int
    dim: int
    state_width: int
    dtype: StorageDType
    row_bytes: int
    data_offset: int
    state_dtype: StorageDType = STATE_DTYPE
    version: int = LAYOUT_VERSION

    @classmethod
    def for_layout(cls, tier: str, layout: RowLayout, data_offset: int = DATA_OFFSET) -> FileHeader:
        return cls(
            tier=tier,
            num_rows=layout.num_rows,
            dim=layout.dim,
            state_width=layout.state_width,
            dtype=layout.dtype,
            row_bytes=layout.row_bytes,
            data_offset=data_offset,
            state_dtype=layout.state_dtype,
        )

    def pack(self) -> bytes:
        """Serializes the header, padded with zeros to its block (4 KiB, or ``data_offset``
        if less). The bytes between it and ``data_offset`` are not part of it: a new file
        holds zeros there, and a padded copy would be as large as a log's index slots
        (160 MB for 10M rows), all in memory at once."""
        tier = self.tier.encode()
        if len(tier) > 16:
            raise ValueError(f"tier name {self.tier!r} longer than 16 bytes")
        body = _HEADER.pack(
            MAGIC,
            self.version,
            tier,
            self.num_rows,
            self.dim,
            self.state_width,
            self.dtype.code,
            self.state_dtype.code,
            self.row_bytes,
            self.data_offset,
        )
        raw = body + _CRC.pack(zlib.crc32(body))
        return raw + b"\0" * (min(self.data_offset, DATA_OFFSET) - len(raw))

    @classmethod
    def unpack(cls, raw: bytes, path: Path) -> FileHeader:
        """Parses a header read from ``path``; raises ``HeaderMismatchError`` naming the file."""
        if len(raw) < _VERSION.size:
            raise HeaderMismatchError(
                f"{path}: file too short for a row-store header ({len(raw)} bytes)"
            )
        magic, version = _VERSION.unpack_from(raw)
        if magic != MAGIC:
            raise HeaderMismatchError(f"{path}: not a torchrec_mtrains row file (bad magic)")
        if version not in (1, LAYOUT_VERSION):
            raise HeaderMismatchError(
                f"{path}: layout version {version}, this build reads versions 1 and "
                f"{LAYOUT_VERSION}"
            )
        struct_ = _HEADER if version == LAYOUT_VERSION else _HEADER_V1
        if len(raw) < struct_.size + _CRC.size:
            raise HeaderMismatchError(
                f"{path}: file too short for a row-store header ({len(raw)} bytes)"
            )
        body, (crc,) = raw[: struct_.size], _CRC.unpack_from(raw, struct_.size)
        if zlib.crc32(body) != crc:
            raise HeaderMismatchError(f"{path}: corrupt header (checksum mismatch)")
        fields_ = struct_.unpack(body)
        _, _, tier, num_rows, dim, state_width, dtype_code = fields_[:7]
        row_bytes, data_offset = fields_[-2:]
        try:
            dtype = StorageDType.from_code(dtype_code)
            state_dtype = StorageDType.from_code(fields_[7]) if version == LAYOUT_VERSION else dtype
        except ValueError as e:
            raise HeaderMismatchError(f"{path}: corrupt header ({e})") from None
        if version == 1 and dtype is not STATE_DTYPE:
            raise HeaderMismatchError(
                f"{path}: layout version 1 file of a {dtype.value} table, whose optimizer state "
                f"it stores in {dtype.value}; this build keeps the state in "
                f"{STATE_DTYPE.value} (as fbgemm does) and reads version 1 files of "
                f"{STATE_DTYPE.value} tables only: rebuild the table's tier file from a "
                "checkpoint (the app's run.resume does)"
            )
        return cls(
            tier=tier.rstrip(b"\0").decode(errors="replace"),
            num_rows=num_rows,
            dim=dim,
            state_width=state_width,
            dtype=dtype,
            row_bytes=row_bytes,
            data_offset=data_offset,
            state_dtype=state_dtype,
            # A version 1 file of an fp32 table holds what version 2 would (checked above).
            version=LAYOUT_VERSION,
        )

    def check_matches(self, expected: FileHeader, path: Path) -> None:
        """Raises ``HeaderMismatchError`` listing every field that differs from ``expected``."""
        diffs = [
            f"{f.name}: file has {getattr(self, f.name)!r}, expected {getattr(expected, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(expected, f.name)
        ]
        if diffs:
            raise HeaderMismatchError(
                f"{path}: file was made for another table, dtype or tier: " + "; ".join(diffs)
            )


@dataclass
class TierStats:
    """Counters every store keeps the same way, for logs and benchmarks.

    ``bytes_read``/``bytes_written`` count what moved to or from the medium (whole blocks for a
    block tier), so ``bytes_read / (rows_read * row_bytes)`` is the read amplification.
    ``io_calls`` counts system calls issued for data (reads, writes, syncs).
    """

    read_calls: int = 0
    write_calls: int = 0
    rows_read: int = 0
    rows_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    io_calls: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)

    def __add__(self, other: TierStats) -> TierStats:
        return TierStats(**{k: v + getattr(other, k) for k, v in asdict(self).items()})


class RowStore(ABC):
    """One table's rows on one tier.

    Subclasses set ``name`` and ``options_type`` (their :class:`TierOptions` dataclass) and
    implement the ``_read_rows`` / ``_write_rows`` / ``_flush`` / ``_close`` hooks; this base
    validates arguments, converts dtypes, keeps the counters and handles open modes, so every
    tier behaves alike at its edges.

    Thread safety: ``read_rows`` may be called from several threads at once; ``write_rows`` calls
    are serialized with each other by the base. A read racing a write of the same row may see
    either version; callers (the cache) never do that.

    Args:
        directory: existing, writable directory the store's file is created in.
        table: table (or shard) name; becomes the file name, so no path separators.
        layout: shape of the rows.
        mode: what to do with an existing file (see :class:`OpenMode`).
        options: the tier's options, an instance of ``options_type`` (``None``: its defaults);
            kept as :attr:`options`.

    Example::

        store = TIERS["byte_scm"]("/mnt/pmem0/run1", "t_user", RowLayout(1_000_000, 64, 1))
        store.write_rows(np.array([3, 7]), np.ones((2, 65), np.float32))
        rows = store.read_rows(np.array([7]))
        store.close()
    """

    name: ClassVar[str]
    options_type: ClassVar[type[TierOptions]]
    # The placement tier (``types.Tier``) whose device the store's file lives on, and how rows
    # lie in it: ``flat`` (row ``i`` at ``data_offset + i * row_bytes``) or another layout
    # of the same device (the log-structured block tier serves ``block_scm`` as ``log``).
    serves_tier: ClassVar[str] = ""
    file_layout: ClassVar[str] = "flat"
    options: TierOptions

    def __init__(
        self,
        directory: str | os.PathLike[str],
        table: str,
        layout: RowLayout,
        *,
        mode: OpenMode | str = OpenMode.OPEN_OR_CREATE,
        options: TierOptions | None = None,
    ) -> None:
        self.options = own_options(self.name, self.options_type, options)
        self.layout = layout
        self.table = table
        self.mode = OpenMode(mode)
        self.directory = Path(directory)
        self.path = self.directory / f"{table}.{self.name}{FILE_SUFFIX}"
        self.stats = TierStats()
        self.data_offset = DATA_OFFSET
        self.created = False
        self._stats_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._closed = False
        self._sparse_create = False  # a new file left sparse (see ByteScmOptions.preallocate)
        # Bumped by every write call: copies of the rows (checkpoint views) know when they
        # are stale.
        self.version = 0
        check_table_name(table)
        check_directory(self.directory)

    # ----------------------------------------------------------------------------- public API

    def read_rows(self, ids: npt.ArrayLike) -> RowArray:
        """Returns the rows ``ids`` as a new float32 array of shape ``(len(ids), row_width)``."""
        ids_arr = self._check_ids(ids)
        out = np.empty((ids_arr.size, self.layout.row_width), dtype=np.float32)
        if ids_arr.size:
            self._count_read(ids_arr.size, *self._read_rows(ids_arr, out))
        return out

    def _count_read(self, rows: int, moved: int, calls: int) -> None:
        """Counts one read call of ``rows`` rows that moved ``moved`` bytes in ``calls``."""
        self._count(read_calls=1, rows_read=rows, bytes_read=moved, io_calls=calls)

    def write_rows(
        self, ids: npt.ArrayLike, rows: npt.ArrayLike, *, distinct: bool = False
    ) -> None:
        """Stores ``rows[i]`` (weights then optimizer state) as row ``ids[i]``.

        Ids must be unique within one call (a repeated id would make the result depend on the
        tier); ``ValueError`` otherwise. ``distinct=True``: the caller's ids are distinct by
        construction (the rows a cache evicts: each slot holds its own id), so the sort that
        checks them is skipped (4% of the tier worker's time on W3)."""
        ids_arr = self._check_ids(ids)
        self._check_distinct(ids_arr, distinct)
        self._write_checked(ids_arr, rows)

    def _check_distinct(self, ids_arr: IdArray, distinct: bool) -> None:
        if not distinct and ids_arr.size > 1 and np.unique(ids_arr).size != ids_arr.size:
            raise ValueError(f"table {self.table!r}: write_rows ids must be unique")

    def _write_checked(self, ids_arr: IdArray, rows: npt.ArrayLike) -> None:
        rows_arr = np.ascontiguousarray(rows, dtype=np.float32)
        if rows_arr.shape != (ids_arr.size, self.layout.row_width):
            raise ValueError(
                f"table {self.table!r}: rows of shape {tuple(rows_arr.shape)} do not match "
                f"{ids_arr.size} ids of width {self.layout.row_width}"
            )
        if not ids_arr.size:
            return
        with self._write_lock:
            self.version += 1
            moved, calls = self._write_rows(ids_arr, rows_arr)
        self._count(write_calls=1, rows_written=ids_arr.size, bytes_written=moved, io_calls=calls)

    def write_rows_from(
        self,
        ids: npt.ArrayLike,
        columns: Sequence[RowArray],
        at: npt.ArrayLike,
        *,
        distinct: bool = False,
    ) -> None:
        """Stores row ``ids[i]`` as the rows ``at[i]`` of ``columns`` side by side (a cache's
        weight slots, then its optimizer-state slots: the rows it evicts). Stores what
        :meth:`write_rows` stores for those rows; where the tier's rows are host memory, by one
        compiled pass from the columns into them, without building the rows between (a third
        of the copies). ``distinct`` as for :meth:`write_rows`."""
        ids_arr = self._check_ids(ids)
        at_arr = self._check_columns(ids_arr, columns, at)
        self._check_distinct(ids_arr, distinct)
        if not ids_arr.size:
            return
        with self._write_lock:
            self.version += 1
            moved, calls = self._write_from(ids_arr, columns, at_arr)
        self._count(write_calls=1, rows_written=ids_arr.size, bytes_written=moved, io_calls=calls)

    def read_rows_into(
        self, ids: npt.ArrayLike, columns: Sequence[RowArray], at: npt.ArrayLike
    ) -> None:
        """Puts row ``ids[i]`` into the rows ``at[i]`` of ``columns`` (its first values into
        the first, and so on): the way back of :meth:`write_rows_from`, counted as a read."""
        ids_arr = self._check_ids(ids)
        at_arr = self._check_columns(ids_arr, columns, at)
        if ids_arr.size:
            self._count_read(ids_arr.size, *self._read_into(ids_arr, columns, at_arr))

    def _check_columns(
        self, ids: IdArray, columns: Sequence[RowArray], at: npt.ArrayLike
    ) -> IdArray:
        at_arr = np.asarray(at, dtype=np.int64)
        widths = [c.shape[1] if c.ndim == 2 else -1 for c in columns]
        if not columns or -1 in widths or sum(widths) != self.layout.row_width:
            raise ValueError(
                f"table {self.table!r}: columns of shapes {[c.shape for c in columns]} do not "
                f"make rows of width {self.layout.row_width}"
            )
        if at_arr.shape != ids.shape:
            raise ValueError(
                f"table {self.table!r}: {ids.size} ids need as many column rows, got shape "
                f"{at_arr.shape}"
            )
        if at_arr.size:
            limit = min(c.shape[0] for c in columns)
            lo, hi = int(at_arr.min()), int(at_arr.max())
            if lo < 0 or hi >= limit:
                bad = lo if lo < 0 else hi
                raise IndexError(
                    f"table {self.table!r}: column row {bad} out of range [0, {limit})"
                )
        return at_arr

    def read_range(self, start: int, count: int) -> RowArray:
        """Returns rows ``start .. start+count-1``: the sequential path for checkpoints."""
        self._check_range(start, count)
        return self.read_rows(np.arange(start, start + count, dtype=np.int64))

    def write_range(self, start: int, rows: npt.ArrayLike) -> None:
        """Stores consecutive rows from ``start``: the sequential path for init and restore."""
        rows_arr = np.asarray(rows)
        if rows_arr.ndim != 2:
            raise ValueError(
                f"table {self.table!r}: rows must be 2-D (count, {self.layout.row_width}), "
                f"got shape {rows_arr.shape}"
            )
        self._check_range(start, rows_arr.shape[0])
        self._check_open()
        self._write_checked(np.arange(start, start + rows_arr.shape[0], dtype=np.int64), rows_arr)

    def clear(self) -> None:
        """Makes every row read as zeros (weights and optimizer state), durably: before a
        load that writes the whole table, so a store that appends (the log) does not keep the
        old rows beside the new. A flat store writes zeros over its rows."""
        self._check_open()
        with self._write_lock:
            self.version += 1
            calls = self._clear()
        self._count(io_calls=calls)

    def flush(self) -> None:
        """Makes every completed write durable on the medium."""
        self._check_open()
        with self._write_lock:
            calls = self._flush()
        self._count(io_calls=calls)

    def close(self) -> None:
        """Flushes and releases the store; further use raises. Closing twice is a no-op.

        If the flush fails the store stays open, so no written row is silently dropped: fix
        the cause (e.g. free space) and close again."""
        if self._closed:
            return
        self.flush()
        self._close()
        self._closed = True

    @property
    def closed(self) -> bool:
        return self._closed

    def mapped_rows(self) -> WordArray | None:
        """The ``(num_rows, row_words)`` array of stored words (:attr:`RowLayout.word_dtype`)
        that *is* the store's memory, for zero-copy checkpoints; ``None`` for tiers without a
        byte-addressable copy (block tiers).

        Writes through it bypass the counters and the write lock, and it is only valid until
        :meth:`close`."""
        return None

    @property
    def rows_in_memory(self) -> bool:
        """Whether the rows are host memory (:meth:`mapped_rows`): a read is a copy, with no
        I/O for :func:`read_rows_together` to share with other stores'. (False once closed:
        reads then meet the closed store's own error.)"""
        return not self._closed and self.mapped_rows() is not None

    @classmethod
    def file_bytes(cls, layout: RowLayout, options: TierOptions | None = None) -> int:
        """The size of a new file of this store for ``layout`` (files are preallocated in full
        when created), so a job can check the free space before creating any."""
        return DATA_OFFSET + layout.total_bytes

    def export_rows(
        self,
        out: WordArray,
        chunk_rows: int = 65_536,
        written: Callable[[], None] | None = None,
    ) -> None:
        """Copies every row, in id order, into ``out`` (``(num_rows, row_words)`` stored words,
        e.g. a file mapping), ``chunk_rows`` at a time, calling ``written`` after each piece
        (e.g. to write a mapping's dirty pages out). A tier whose file is not the flat row
        array overrides this with a sequential scan of its file."""
        self._check_export_target(out)
        for start in range(0, self.layout.num_rows, chunk_rows):
            count = min(chunk_rows, self.layout.num_rows - start)
            out[start : start + count] = self.layout.encode(self.read_range(start, count))
            if written is not None:
                written()

    def _check_export_target(self, out: WordArray) -> None:
        self._check_open()
        expected = (self.layout.num_rows, self.layout.row_words)
        if out.shape != expected or out.dtype != self.layout.word_dtype:
            raise ValueError(
                f"table {self.table!r}: export target of shape {out.shape} ({out.dtype}), "
                f"expected {expected} ({self.layout.word_dtype})"
            )

    def mapped_rows_written(self) -> None:
        """Says rows were written through :meth:`mapped_rows` (which bypasses the store): a
        store that keeps a copy of its memory elsewhere (the DRAM tier's file) makes it whole
        again at the next :meth:`flush`, and :attr:`version` moves on."""
        with self._write_lock:
            self.version += 1

    def __enter__(self) -> RowStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(path={str(self.path)!r}, layout={self.layout})"

    # ------------------------------------------------------------------------ backend hooks

    @abstractmethod
    def _read_rows(self, ids: IdArray, out: RowArray) -> tuple[int, int]:
        """Fills ``out[i]`` with row ``ids[i]`` (as float32).

        Returns ``(bytes moved from the medium, I/O system calls issued)``."""

    @abstractmethod
    def _write_rows(self, ids: IdArray, rows: RowArray) -> tuple[int, int]:
        """Stores ``rows[i]`` at row ``ids[i]``; ids are unique. Returns bytes moved and calls."""

    def _write_from(
        self, ids: IdArray, columns: Sequence[RowArray], at: IdArray
    ) -> tuple[int, int]:
        """:meth:`write_rows_from` once checked: one compiled pass into the rows where they
        are host memory (:meth:`mapped_rows`) of float32 words, else the rows built and
        handed to :meth:`_write_rows`. Returns bytes moved and calls."""
        words = self.mapped_rows()
        if words is not None and copy_columns_to_rows(columns, at, words, ids):
            return ids.size * self.layout.row_bytes, 0
        rows = np.concatenate([np.asarray(c[at], dtype=np.float32) for c in columns], axis=1)
        return self._write_rows(ids, rows)

    def _read_into(self, ids: IdArray, columns: Sequence[RowArray], at: IdArray) -> tuple[int, int]:
        """:meth:`read_rows_into` once checked (see :meth:`_write_from`)."""
        words = self.mapped_rows()
        if words is not None and copy_rows_to_columns(words, ids, columns, at):
            return ids.size * self.layout.row_bytes, 0
        rows = np.empty((ids.size, self.layout.row_width), dtype=np.float32)
        counted = self._read_rows(ids, rows)
        start = 0
        for column in columns:
            width = column.shape[1]
            column[at] = rows[:, start : start + width]
            start += width
        return counted

    def _clear(self) -> int:
        """Zeroes every row, then flushes; returns the I/O calls issued. Stores that can
        forget rows without writing them override it."""
        width, calls = self.layout.row_width, 0
        chunk = max(1, CLEAR_CHUNK_BYTES // (4 * width))
        for start in range(0, self.layout.num_rows, chunk):
            count = min(chunk, self.layout.num_rows - start)
            zeros = np.zeros((count, width), dtype=np.float32)
            moved, issued = self._write_rows(np.arange(start, start + count, dtype=np.int64), zeros)
            self._count(bytes_written=moved)
            calls += issued
        return calls + self._flush()

    @abstractmethod
    def _flush(self) -> int:
        """Makes completed writes durable; returns the I/O calls issued."""

    @abstractmethod
    def _close(self) -> None:
        """Releases file handles and mappings (called after a flush)."""

    # ------------------------------------------------------------------------------ helpers

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                setattr(self.stats, key, getattr(self.stats, key) + value)

    def _check_open(self) -> None:
        if self._closed:
            raise RowStoreError(f"{self.path}: store is closed")

    def _check_ids(self, ids: npt.ArrayLike) -> IdArray:
        self._check_open()
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"table {self.table!r}: ids must be 1-D, got shape {arr.shape}")
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise TypeError(f"table {self.table!r}: ids must be integers, got {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        if arr.size:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.layout.num_rows:
                bad = lo if lo < 0 else hi
                raise IndexError(
                    f"table {self.table!r}: row id {bad} out of range [0, {self.layout.num_rows})"
                )
        return arr

    def _check_range(self, start: int, count: int) -> None:
        if start < 0 or count < 0 or start + count > self.layout.num_rows:
            raise IndexError(
                f"table {self.table!r}: rows [{start}, {start + count}) out of range "
                f"[0, {self.layout.num_rows})"
            )

    def _expected_header(self, data_offset: int = DATA_OFFSET) -> FileHeader:
        return FileHeader.for_layout(self.name, self.layout, data_offset)

    def _os_error(self, err: OSError, doing: str) -> RowStoreError:
        """Turns ``err`` into a ``RowStoreError`` naming the file; the caller raises it."""
        return os_error(self.path, err, doing)

    def _prepare_file(
        self,
        data_offset: int = DATA_OFFSET,
        file_bytes: int | None = None,
        accept_data_offset: Callable[[int], bool] | None = None,
    ) -> FileHeader:
        """Applies the open mode to :attr:`path`: creates the file (header, then every row
        preallocated as zeros) or checks the existing file's header and size.

        Args:
            data_offset: where rows start in a new file.
            file_bytes: size of a new file; defaults to ``data_offset + layout.total_bytes``
                (a block tier rounds it up to whole blocks).
            accept_data_offset: whether an existing file's data offset is usable; by default
                only ``data_offset`` itself is.

        Returns the header in effect; sets :attr:`data_offset` and :attr:`created`.
        """
        if file_bytes is None:
            file_bytes = data_offset + self.layout.total_bytes
        exists = os.path.lexists(self.path)
        if self.mode is OpenMode.CREATE and exists:
            raise RowStoreError(f"{self.path}: already exists (mode=create refuses to replace it)")
        if self.mode is OpenMode.OPEN and not exists:
            raise RowStoreError(f"{self.path}: no such row file (mode=open needs an existing one)")
        if exists and self.mode is not OpenMode.TRUNCATE:
            header = self._check_existing(data_offset, accept_data_offset)
        else:
            header = self._create_file(data_offset, file_bytes)
        self.data_offset = header.data_offset
        return header

    def _check_existing(
        self, data_offset: int, accept_data_offset: Callable[[int], bool] | None
    ) -> FileHeader:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise self._os_error(e, "opening") from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise RowStoreError(f"{self.path}: not a regular file")
            raw = os.pread(fd, HEADER_BYTES, 0)
        except OSError as e:
            raise self._os_error(e, "reading the header") from e
        finally:
            os.close(fd)
        found = FileHeader.unpack(raw, self.path)
        accept = accept_data_offset or (lambda offset: offset == data_offset)
        if accept(found.data_offset) and found.data_offset >= HEADER_BYTES:
            data_offset = found.data_offset
        found.check_matches(self._expected_header(data_offset), self.path)
        needed = data_offset + self.layout.total_bytes
        if st.st_size < needed:
            raise HeaderMismatchError(
                f"{self.path}: file is truncated: {st.st_size} bytes, the header's shape needs "
                f"{needed}"
            )
        return found

    def _create_file(self, data_offset: int, file_bytes: int) -> FileHeader:
        header = self._expected_header(data_offset)
        if self.mode is OpenMode.TRUNCATE:
            try:
                self.path.unlink(missing_ok=True)
            except OSError as e:
                raise self._os_error(e, "removing the old file") from e
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, FILE_MODE)
        except FileExistsError as e:
            raise RowStoreError(f"{self.path}: created concurrently by someone else") from e
        except OSError as e:
            raise self._os_error(e, "creating") from e
        try:
            os.fchmod(fd, FILE_MODE)  # exact mode whatever the umask
            # Allocates every block now: a full device fails here, not at a later write or, for
            # a memory mapping, as a SIGBUS when a page of a sparse file is first touched.
            if self._sparse_create:
                os.ftruncate(fd, file_bytes)
            else:
                os.posix_fallocate(fd, 0, file_bytes)
            os.pwrite(fd, header.pack(), 0)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise self._os_error(e, f"creating ({file_bytes} bytes)") from e
        os.close(fd)
        _fsync_directory(self.directory)
        self.created = True
        logger.debug("created %s (%d bytes)", self.path, file_bytes)
        return header


def contiguous_start(ids: IdArray) -> int | None:
    """``ids[0]`` when ``ids`` are consecutive ascending (a range), else ``None``: tiers then
    copy a slice instead of gathering row by row, which is what checkpoints and fills do."""
    if ids.size == 0:
        return None
    first = int(ids[0])
    if int(ids[-1]) - first != ids.size - 1 or (ids.size > 1 and not (np.diff(ids) == 1).all()):
        return None
    return first


def gather_rows(rows: WordArray, ids: IdArray, out: RowArray, layout: RowLayout) -> None:
    """Copies ``rows[ids]`` (stored words) into ``out`` (float32 rows) for the tiers whose rows
    are an array (memory or a mapping): a slice for a range of ids, else a gather, decoding
    packed rows (:meth:`RowLayout.decode`)."""
    start = contiguous_start(ids)
    if start is not None:
        layout.decode(rows[start : start + ids.size], out)
    elif not layout.packed:
        np.take(rows, ids, axis=0, out=out)
    else:
        layout.decode(rows[ids], out)


def scatter_rows(rows: WordArray, ids: IdArray, values: RowArray, layout: RowLayout) -> None:
    """Stores float32 ``values`` at ``rows[ids]`` as words (a slice for a range of ids); see
    :func:`gather_rows`."""
    words = layout.encode(values)
    start = contiguous_start(ids)
    if start is not None:
        rows[start : start + ids.size] = words
    else:
        rows[ids] = words


_NO_COLUMNS = np.empty((0, 0), dtype=np.float32)


def _compiled_columns(rows: WordArray, columns: Sequence[RowArray]) -> list[RowArray] | None:
    """The two column blocks the compiled copies take (the second empty for one block), or
    None where they do not apply: no numba, a type other than float32 (packed words, fp16
    slots), more than two blocks, blocks whose widths do not add up to the rows' (the kernel
    checks no bound: a caller's other path refuses those)."""
    if not NUMBA_AVAILABLE or not 1 <= len(columns) <= 2 or rows.dtype != np.float32:
        return None
    if any(c.dtype != np.float32 or c.ndim != 2 for c in columns):
        return None
    if rows.ndim != 2 or sum(c.shape[1] for c in columns) != rows.shape[1]:
        return None
    return [columns[0], columns[1] if len(columns) == 2 else _NO_COLUMNS]


def copy_columns_to_rows(
    columns: Sequence[RowArray], at: IdArray, rows: WordArray, ids: IdArray
) -> bool:
    """``rows[ids[i]] = concat(c[at[i]] for c in columns)`` by one compiled pass without the
    GIL; false, with nothing copied, where it does not apply (see :func:`_compiled_columns`).
    Ids and column rows are the caller's to check."""
    blocks = _compiled_columns(rows, columns)
    if blocks is None:
        return False
    _copy_between(rows, ids, blocks[0], blocks[1], at, True)
    return True


def copy_rows_to_columns(
    rows: WordArray, ids: IdArray, columns: Sequence[RowArray], at: IdArray
) -> bool:
    """The way back of :func:`copy_columns_to_rows`: each column block ``c[at[i]]`` gets its
    part of ``rows[ids[i]]``."""
    blocks = _compiled_columns(rows, columns)
    if blocks is None:
        return False
    _copy_between(rows, ids, blocks[0], blocks[1], at, False)
    return True


@_jit
def _copy_between(
    rows: RowArray, ids: IdArray, first: RowArray, second: RowArray, at: IdArray, into_rows: bool
) -> None:
    """Row ``ids[i]`` of ``rows`` is ``first[at[i]]`` then ``second[at[i]]``: copied into
    ``rows`` when ``into_rows``, out of it otherwise."""
    width = first.shape[1]
    for i in range(ids.shape[0]):
        row, slot = ids[i], at[i]
        for j in range(width):
            if into_rows:
                rows[row, j] = first[slot, j]
            else:
                first[slot, j] = rows[row, j]
        for j in range(second.shape[1]):
            if into_rows:
                rows[row, width + j] = second[slot, j]
            else:
                second[slot, j] = rows[row, width + j]


def compile_row_copies() -> None:
    """Compiles (or loads from numba's cache) the row copies for C-ordered arrays, as the
    tier worker first meets them: before training, not in its first batch."""
    if not NUMBA_AVAILABLE:
        return
    rows, ids = np.zeros((2, 3), np.float32), np.arange(2, dtype=np.int64)
    first, second = np.zeros((2, 2), np.float32), np.zeros((2, 1), np.float32)
    for blocks in ([first, second], [rows]):
        copy_columns_to_rows(blocks, ids, rows, ids)
        copy_rows_to_columns(rows, ids, blocks, ids)


def check_table_name(table: str) -> None:
    """Refuses names that would place a file outside the store's directory."""
    if not table or "/" in table or "\0" in table or table in (".", "..") or os.sep in table:
        raise ValueError(f"invalid table name {table!r}: must be a plain file-name component")


def check_directory(directory: Path) -> None:
    """Raises ``RowStoreError`` naming ``directory`` unless it exists and is writable."""
    if not directory.exists():
        raise RowStoreError(f"tier directory {directory} does not exist")
    if not directory.is_dir():
        raise RowStoreError(f"tier directory {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        # access() answers for root too (read-only mounts and immutable directories refuse
        # even root), so name the likely cause.
        try:
            read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        cause = "read-only file system" if read_only else "permission denied or immutable"
        raise RowStoreError(f"tier directory {directory} is not writable ({cause})")


def os_error(path: Path, err: OSError, doing: str) -> RowStoreError:
    """A ``RowStoreError`` for ``err`` raised while ``doing`` something to ``path``."""
    if err.errno == errno.ENOSPC:
        return RowStoreError(f"{path}: device full while {doing}: no space left on the device")
    if err.errno == errno.EDQUOT:
        return RowStoreError(f"{path}: disk quota exceeded while {doing}")
    if err.errno == errno.EROFS:
        return RowStoreError(f"{path}: read-only file system while {doing}")
    return RowStoreError(f"{path}: {doing} failed: {err.strerror or err}")


def _fsync_directory(directory: Path) -> None:
    # Makes a new file's directory entry durable; some file systems refuse fsync on
    # directories, which only weakens crash durability of the entry, so it is logged.
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        logger.debug("cannot open %s to fsync it: %s", directory, e)
        return
    try:
        os.fsync(fd)
    except OSError as e:
        logger.debug("fsync of directory %s failed: %s", directory, e)
    finally:
        os.close(fd)
