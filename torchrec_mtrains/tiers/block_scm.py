"""The block-addressable SCM tier: a file on an NVMe / Optane SSD read and written in aligned
blocks, bypassing the page cache with ``O_DIRECT``.

Rows are packed back to back (the shared flat layout), so a row may straddle two blocks and a
block may hold parts of several rows. A batch read turns the rows into the set of blocks that
cover them, merges adjacent blocks into single I/Os and keeps ``queue_depth`` of them in flight
(see :mod:`torchrec_mtrains.tiers._blockio`): random single-row reads are bound by device IOPS,
which only a deep queue reaches. Writes read-modify-write the partially covered blocks and write
each touched block once per pass.

Block size and queue depth are also what the planner's perf model assumes of the device
(``BlockTierConfig``); :class:`BlockScmOptions` marks them as ``hardware_fields`` so that they
are built from the host topology rather than set twice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.tiers._blockio import (
    AlignedBuffer,
    BufferPool,
    I64Array,
    PassReader,
    ReadPass,
    ReadSteps,
    U8Array,
    merge_runs,
    open_block_file,
)
from torchrec_mtrains.tiers.base import DATA_OFFSET, IdArray, OpenMode, RowArray, RowStore
from torchrec_mtrains.tiers.options import BlockScmOptions, TierOptions
from torchrec_mtrains.tiers.registry import register_tier, resolve_options
from torchrec_mtrains.types import WORD_BYTES, RowLayout


@dataclass(frozen=True)
class _Geometry:
    """Where a pass's rows sit: ``blocks`` are the sorted unique blocks covering them (placed
    back to back in the buffer), ``buf_pos`` each row's byte offset in that buffer."""

    blocks: I64Array
    buf_pos: I64Array
    coverage: I64Array | None  # bytes of each block the rows cover (writes only)


_RowsView = tuple[npt.NDArray[Any], I64Array | None]


@register_tier
class BlockSCMStore(RowStore, PassReader):
    """Rows in a file accessed by aligned block I/O.

    Args:
        directory: existing, writable directory for the file (on the SSD).
        table: table (or shard) name.
        layout: shape of the rows.
        mode: what to do with an existing file (see :class:`OpenMode`).
        options: block size, queue depth, engine and buffer limits (:class:`BlockScmOptions`;
            defaults if ``None``). ``block_size`` and ``queue_depth`` are kept as attributes,
            ``direct`` and ``engine`` as what the store ended up using.

    Example::

        store = BlockSCMStore("/mnt/nvme0/run1", "t_big", RowLayout(100_000_000, 64, 1),
                              options=BlockScmOptions(queue_depth=64))
        rows = store.read_rows(np.random.randint(0, 100_000_000, 4096))
    """

    name: ClassVar[str] = "block_scm"
    options_type: ClassVar[type[TierOptions]] = BlockScmOptions
    options: BlockScmOptions

    def __init__(
        self,
        directory: str | os.PathLike[str],
        table: str,
        layout: RowLayout,
        *,
        mode: OpenMode | str = OpenMode.OPEN_OR_CREATE,
        options: BlockScmOptions | None = None,
    ) -> None:
        super().__init__(directory, table, layout, mode=mode, options=options)
        opts = self.options
        block_size, queue_depth, engine_kind = opts.block_size, opts.queue_depth, opts.engine
        self.block_size = block_size
        self.queue_depth = queue_depth
        self._max_io_blocks = opts.max_io_bytes // block_size
        self._max_pass_blocks = max(1, opts.max_pass_bytes // block_size)
        # The header block(s) must end on a block boundary so data I/O never touches them; an
        # existing file made with a smaller block size is usable when its offset is aligned.
        self._prepare_file(
            max(DATA_OFFSET, block_size),
            self._file_bytes(max(DATA_OFFSET, block_size)),
            accept_data_offset=lambda offset: offset % block_size == 0,
        )
        self._fd, self.direct = self._open(opts.direct)
        try:
            self._extend_to_whole_blocks()
        except BaseException:
            os.close(self._fd)
            raise
        self._start_io(engine_kind, queue_depth, opts.max_pass_bytes)

    # ------------------------------------------------------------------------------ opening

    def _file_bytes(self, data_offset: int) -> int:
        return data_offset + _rows_region_bytes(self.layout, self.block_size)

    def use_buffers(self, pool: BufferPool) -> None:
        """Takes I/O buffers from ``pool``, shared with the other stores of one tier worker,
        which moves one table's rows at a time: one pass's buffer serves them all."""
        self._buffers = pool

    @classmethod
    def file_bytes(cls, layout: RowLayout, options: TierOptions | None = None) -> int:
        opts = resolve_options(cls.name, options)
        assert isinstance(opts, BlockScmOptions)
        bs = opts.block_size
        return max(DATA_OFFSET, bs) + _rows_region_bytes(layout, bs)

    def _open(self, direct: bool) -> tuple[int, bool]:
        try:
            return open_block_file(self.path, self.block_size, self.data_offset, direct, self.name)
        except OSError as e:
            raise self._os_error(e, "opening") from e

    def _extend_to_whole_blocks(self) -> None:
        # Every I/O moves whole blocks, so the last one must lie inside the file; a file made
        # with a smaller block size may end mid-block and gets zero padding appended.
        needed = self._file_bytes(self.data_offset)
        try:
            if os.fstat(self._fd).st_size < needed:
                os.posix_fallocate(self._fd, 0, needed)
        except OSError as e:
            raise self._os_error(e, "extending to whole blocks") from e

    # --------------------------------------------------------------------------------- I/O

    def _split(self, ids: IdArray) -> tuple[IdArray | None, list[slice]]:
        """Plans passes of at most ``max_pass_bytes`` of blocks each.

        Returns ``(order, passes)``: the passes are slices of ``ids[order]`` (sorted, so that
        consecutive rows share blocks within a pass and passes share at most a boundary block),
        or of ``ids`` itself when ``order`` is ``None`` (one pass, or already sorted)."""
        bs, row_bytes, n = self.block_size, self.layout.row_bytes, ids.size
        starts = self.data_offset + ids * row_bytes
        first, last = starts // bs, (starts + row_bytes - 1) // bs
        if int((last - first).sum()) + n <= self._max_pass_blocks:
            return None, [slice(0, n)]
        order: IdArray | None = None
        if ids.size > 1 and not (np.diff(ids) >= 0).all():
            order = np.argsort(ids, kind="stable")
            first, last = first[order], last[order]
        # Blocks each sorted row adds beyond those of the rows before it.
        prev_last = np.concatenate(([-1], np.maximum.accumulate(last)[:-1]))
        added = np.maximum(last - np.maximum(first, prev_last + 1) + 1, 0)
        total = np.cumsum(added)
        budget = self._max_pass_blocks
        cuts = np.searchsorted(total, np.arange(budget, int(total[-1]), budget), side="right")
        bounds = np.unique(np.concatenate(([0], cuts, [n]))).tolist()
        return order, [slice(a, b) for a, b in pairwise(bounds)]

    def _geometry(self, ids: IdArray, with_coverage: bool) -> _Geometry:
        bs, row_bytes = self.block_size, self.layout.row_bytes
        starts = self.data_offset + ids * row_bytes
        first = starts // bs
        span = (starts + row_bytes - 1) // bs - first + 1
        if int(span.max()) == 1:
            covering, row_start = first, starts
        else:  # (row, block) pairs for rows straddling blocks
            within = np.arange(int(span.sum())) - np.repeat(np.cumsum(span) - span, span)
            covering = np.repeat(first, span) + within
            row_start = np.repeat(starts, span)
        blocks = np.unique(covering)
        buf_pos = np.searchsorted(blocks, first) * bs + starts % bs
        coverage = None
        if with_coverage:
            block_start = covering * bs
            overlap = np.minimum(row_start + row_bytes, block_start + bs) - np.maximum(
                row_start, block_start
            )
            coverage = np.bincount(
                np.searchsorted(blocks, covering), weights=overlap, minlength=blocks.size
            ).astype(np.int64)
        return _Geometry(blocks, buf_pos.astype(np.int64), coverage)

    def _rows_in(self, data: U8Array, buf_pos: I64Array) -> _RowsView:
        """The rows at ``buf_pos`` in a pass's bytes, as stored words: a plain view when they
        lie back to back (a range of ids), else a word index to gather or scatter through."""
        elements = data.view(self.layout.word_dtype)
        itemsize, width = WORD_BYTES, self.layout.row_words
        n = buf_pos.size
        first = int(buf_pos[0]) // itemsize
        if int(buf_pos[-1]) - int(buf_pos[0]) == (n - 1) * self.layout.row_bytes and (
            n == 1 or (np.diff(buf_pos) == self.layout.row_bytes).all()
        ):
            return elements[first : first + n * width].reshape(n, width), None
        return elements, (buf_pos // itemsize)[:, None] + np.arange(width, dtype=np.int64)

    def _io(self, write: bool, buf: AlignedBuffer, index: I64Array, blocks: I64Array) -> int:
        """Moves ``blocks`` (sorted, unique; ``index`` their slots in ``buf``, consecutive where
        the blocks are) between the file and the buffer in merged runs."""
        run_start, run_len = merge_runs(blocks, self._max_io_blocks)
        bs = self.block_size
        try:
            return self._engine.run(
                self._fd,
                write,
                buf,
                index[run_start] * bs,
                blocks[run_start] * bs,
                run_len * bs,
            )
        except OSError as e:
            raise self._os_error(e, "writing blocks" if write else "reading blocks") from e

    def _read_rows(self, ids: IdArray, out: RowArray) -> tuple[int, int]:
        return self._drive(self.read_passes(ids, out))

    def read_passes(self, ids: IdArray, out: RowArray) -> ReadSteps:
        order, passes = self._split(ids)
        if order is not None:
            ids = ids[order]
        bs = self.block_size
        moved = calls = 0
        for part in passes:
            geo = self._geometry(ids[part], with_coverage=False)
            nbytes = geo.blocks.size * bs
            run_start, run_len = merge_runs(geo.blocks, self._max_io_blocks)
            data, pass_calls = yield ReadPass(
                self._fd, nbytes, run_start * bs, geo.blocks[run_start] * bs, run_len * bs
            )
            calls += pass_calls
            elements, index = self._rows_in(data, geo.buf_pos)
            out[part if order is None else order[part]] = self.layout.decode(
                elements if index is None else elements[index]
            )
            moved += nbytes
        return moved, calls

    def _write_rows(self, ids: IdArray, rows: RowArray) -> tuple[int, int]:
        order, passes = self._split(ids)
        if order is not None:
            ids, rows = ids[order], rows[order]
        bs = self.block_size
        moved = calls = read_back = 0
        for part in passes:
            geo = self._geometry(ids[part], with_coverage=True)
            assert geo.coverage is not None
            nbytes = geo.blocks.size * bs
            buf = self._buffers.take(nbytes)
            try:
                partial = np.flatnonzero(geo.coverage < bs)
                if partial.size:  # blocks holding bytes of other rows: read them first
                    calls += self._io(False, buf, partial, geo.blocks[partial])
                    read_back += partial.size * bs
                elements, index = self._rows_in(buf.array[:nbytes], geo.buf_pos)
                if index is None:
                    elements[...] = self.layout.encode(rows[part])
                else:
                    elements[index] = self.layout.encode(rows[part])
                calls += self._io(True, buf, np.arange(geo.blocks.size), geo.blocks)
            finally:
                self._buffers.give(buf)
            moved += nbytes
        if read_back:
            self._count(bytes_read=read_back)
        return moved, calls

    def _flush(self) -> int:
        try:
            os.fdatasync(self._fd)
        except OSError as e:
            raise self._os_error(e, "syncing") from e
        return 1

    def _close(self) -> None:
        self._engine.close()
        os.close(self._fd)


def _rows_region_bytes(layout: RowLayout, block_size: int) -> int:
    """The rows' bytes rounded up to whole blocks: the file past its data offset."""
    return -(-layout.total_bytes // block_size) * block_size
