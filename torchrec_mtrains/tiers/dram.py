"""The DRAM tier: rows in a process-memory array, persisted to the tier's file on flush.

The file uses the shared row-file format, so a DRAM table survives a restart and can be opened
later by anything that reads row files. Only the chunks written since the last flush go back
to the file, so flushing a large, mostly-read table is cheap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.tiers.base import (
    DATA_OFFSET,
    IdArray,
    OpenMode,
    RowArray,
    RowStore,
    RowStoreError,
    gather_rows,
    scatter_rows,
)
from torchrec_mtrains.tiers.options import DramOptions, TierOptions
from torchrec_mtrains.tiers.registry import register_tier
from torchrec_mtrains.types import RowLayout

# Dirty tracking granularity: small enough that a flush after a few scattered writes moves
# little, large enough that the dirty map and the write calls stay few.
_CHUNK_BYTES = 1 << 20
# Bytes per read/write system call when moving the array to or from its file.
_IO_BYTES = 64 << 20


@register_tier
class DramStore(RowStore):
    """Rows in host memory (stored words), loaded from the file on open and written back to
    it on :meth:`flush` / :meth:`close`. New tables start zero-filled.

    Args:
        directory: existing, writable directory for the backing file.
        table: table (or shard) name.
        layout: shape of the rows.
        mode: what to do with an existing file (see :class:`OpenMode`).
        options: :class:`DramOptions` (none to set).

    Example::

        store = DramStore("/tmp/run", "t_small", RowLayout(1000, 16))
        store.write_rows([1, 2], np.ones((2, 16), np.float32))
        store.close()  # rows 1 and 2 are now in /tmp/run/t_small.dram.rows
    """

    name: ClassVar[str] = "dram"
    options_type: ClassVar[type[TierOptions]] = DramOptions
    options: DramOptions

    def __init__(
        self,
        directory: str | os.PathLike[str],
        table: str,
        layout: RowLayout,
        *,
        mode: OpenMode | str = OpenMode.OPEN_OR_CREATE,
        options: DramOptions | None = None,
    ) -> None:
        super().__init__(directory, table, layout, mode=mode, options=options)
        self._prepare_file(DATA_OFFSET)
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise self._os_error(e, "opening") from e
        # np.zeros is calloc-backed: untouched pages of a new table cost no memory.
        self._rows = np.zeros((layout.num_rows, layout.row_words), dtype=layout.word_dtype)
        self._bytes = self._rows.reshape(-1).view(np.uint8).data
        self._chunk_rows = max(1, _CHUNK_BYTES // layout.row_bytes)
        self._dirty = np.zeros(-(-layout.num_rows // self._chunk_rows), dtype=bool)
        if not self.created:
            try:
                self._load()
            except BaseException:
                os.close(self._fd)
                raise

    def mapped_rows(self) -> npt.NDArray[Any]:
        """The in-memory ``(num_rows, row_words)`` array of stored words; writes through it
        reach the file at the next :meth:`flush` once :meth:`mapped_rows_written` says so."""
        return self._rows

    def mapped_rows_written(self) -> None:
        super().mapped_rows_written()
        self._dirty[:] = True

    def _load(self) -> None:
        total = len(self._bytes)
        pos = 0
        while pos < total:
            try:
                n = os.preadv(
                    self._fd, [self._bytes[pos : pos + _IO_BYTES]], self.data_offset + pos
                )
            except OSError as e:
                raise self._os_error(e, "loading rows") from e
            if n == 0:
                raise RowStoreError(f"{self.path}: file ended after {pos} of {total} row bytes")
            pos += n

    def _read_rows(self, ids: IdArray, out: RowArray) -> tuple[int, int]:
        gather_rows(self._rows, ids, out, self.layout)
        return ids.size * self.layout.row_bytes, 0

    def _write_rows(self, ids: IdArray, rows: RowArray) -> tuple[int, int]:
        scatter_rows(self._rows, ids, rows, self.layout)
        self._dirty[ids // self._chunk_rows] = True
        return ids.size * self.layout.row_bytes, 0

    def _write_from(
        self, ids: IdArray, columns: Sequence[RowArray], at: IdArray
    ) -> tuple[int, int]:
        counted = super()._write_from(ids, columns, at)
        self._dirty[ids // self._chunk_rows] = True
        return counted

    def _flush(self) -> int:
        dirty = np.flatnonzero(self._dirty)
        if not dirty.size:
            return 0
        calls = 0
        # Coalesce runs of adjacent dirty chunks into single writes.
        breaks = np.flatnonzero(np.diff(dirty) != 1) + 1
        chunk_bytes = self._chunk_rows * self.layout.row_bytes
        for run in np.split(dirty, breaks):
            start = int(run[0]) * chunk_bytes
            end = min((int(run[-1]) + 1) * chunk_bytes, len(self._bytes))
            calls += self._write_out(start, end)
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            raise self._os_error(e, "syncing") from e
        self._dirty[dirty] = False
        return calls + 1

    def _write_out(self, start: int, end: int) -> int:
        calls = 0
        while start < end:
            stop = min(end, start + _IO_BYTES)
            try:
                n = os.pwritev(self._fd, [self._bytes[start:stop]], self.data_offset + start)
            except OSError as e:
                raise self._os_error(e, "writing rows back") from e
            calls += 1
            start += n
        return calls

    def _close(self) -> None:
        os.close(self._fd)
