"""The DRAM tier: only dirty chunks go back to the file, and the file is loaded on open."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from torchrec_mtrains.tiers.dram import DramStore
from torchrec_mtrains.types import RowLayout


def _file_rows(store: DramStore) -> np.ndarray:
    layout = store.layout
    flat = np.fromfile(
        store.path,
        layout.dtype.numpy_dtype,
        layout.num_rows * layout.row_width,
        offset=store.data_offset,
    )
    return flat.reshape(layout.num_rows, layout.row_width)


def test_flush_writes_back_only_dirty_chunks(tmp_path: Path) -> None:
    layout = RowLayout(100_000, 16)  # 64-byte rows: 16384 rows per 1 MiB chunk
    with DramStore(tmp_path, "t", layout) as store:
        store.write_rows([5, 40_000, 40_001], np.ones((3, 16), np.float32))
        assert not _file_rows(store)[5].any()  # not yet persisted
        store.flush()
        # chunks 0 and 2 are not adjacent: two writes and one fdatasync
        assert store.stats.io_calls == 3
        on_disk = _file_rows(store)
        assert on_disk[[5, 40_000, 40_001]].all() and on_disk.sum() == 3 * 16
        store.flush()
        assert store.stats.io_calls == 3  # nothing dirty: no I/O at all
        store.mapped_rows()[7] = 2.0  # written in place, then said so:
        store.mapped_rows_written()
        store.flush()
        assert _file_rows(store)[7].tolist() == [2.0] * 16


def test_reopen_loads_the_rows(tmp_path: Path) -> None:
    layout = RowLayout(3000, 5, 2, "fp16")
    rows = np.random.default_rng(8).standard_normal((3000, 7)).astype(np.float16)
    with DramStore(tmp_path, "t", layout) as store:
        store.write_range(0, rows.astype(np.float32))
    with DramStore(tmp_path, "t", layout, mode="open") as again:
        assert again.mapped_rows().dtype == np.uint32  # fp16 weights packed in words
        np.testing.assert_array_equal(layout.decode(again.mapped_rows()), rows)
