"""The block tier: block geometry, I/O merging, read-modify-write, engines and fallbacks."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tier_helpers import exact_rows, uring_refusal

from torchrec_mtrains.tiers import (
    HeaderMismatchError,
    OpenMode,
    RowStoreError,
    _blockio,
    _linux,
    _uring,
)
from torchrec_mtrains.tiers import block_scm as block_module
from torchrec_mtrains.tiers._blockio import (
    AioEngine,
    AlignedBuffer,
    IOEngineKind,
    ThreadEngine,
    UringEngine,
)
from torchrec_mtrains.tiers.block_scm import BlockSCMStore
from torchrec_mtrains.tiers.options import BlockScmOptions
from torchrec_mtrains.types import RowLayout


def _store(
    tmp_path: Path, layout: RowLayout, mode: str = "open_or_create", **options: Any
) -> BlockSCMStore:
    return BlockSCMStore(tmp_path, "t", layout, mode=mode, options=BlockScmOptions(**options))


@pytest.mark.parametrize("block_size", [512, 1024, 4096, 16384])
@pytest.mark.parametrize("width", [1, 13, 128, 1000])  # 4 .. 4000 bytes: straddling and huge
def test_rows_straddling_blocks_round_trip(tmp_path: Path, block_size: int, width: int) -> None:
    rng = np.random.default_rng(block_size + width)
    layout = RowLayout(257, width)
    expected = exact_rows(rng, 257, width, "fp32")
    with _store(tmp_path, layout, block_size=block_size, mode="truncate") as store:
        assert store.data_offset == max(4096, block_size)
        assert store.data_offset % block_size == 0
        for ids in np.array_split(rng.permutation(257), 5):  # scattered partial-block writes
            store.write_rows(ids, expected[ids])
        probe = rng.integers(0, 257, 300)
        np.testing.assert_array_equal(store.read_rows(probe), expected[probe])
    size = (tmp_path / "t.block_scm.rows").stat().st_size
    assert (size - store.data_offset) % block_size == 0  # whole blocks only


def test_adjacent_blocks_merge_into_one_io(tmp_path: Path) -> None:
    layout = RowLayout(10_000, 32)  # 128-byte rows: 32 per 4 KiB block
    with _store(tmp_path, layout, engine="threads") as store:
        store.read_range(64, 96)  # rows 64..159: blocks 2, 3, 4 of the data region
        assert (store.stats.io_calls, store.stats.bytes_read) == (1, 3 * 4096)
        store.read_rows([0, 32 * 10, 32 * 20, 5])  # blocks 0, 10, 20: three separate I/Os
        assert (store.stats.io_calls, store.stats.bytes_read) == (4, 6 * 4096)


def test_long_runs_are_split_to_spread_over_the_queue(tmp_path: Path) -> None:
    layout = RowLayout(10_000, 32)
    with _store(tmp_path, layout, engine="threads", max_io_bytes=8192) as store:
        store.read_range(0, 32 * 10)  # 10 blocks, 2 per I/O
        assert store.stats.io_calls == 5


def test_partial_blocks_are_read_before_written_whole_blocks_are_not(tmp_path: Path) -> None:
    layout = RowLayout(1000, 128)  # 512-byte rows: 8 per 4 KiB block
    rng = np.random.default_rng(4)
    base = exact_rows(rng, 1000, 128, "fp32")
    with _store(tmp_path, layout, engine="threads") as store:
        store.write_range(0, base)
        before = store.stats.bytes_read
        store.write_range(8, base[:16])  # exactly blocks 1 and 2: no read-back
        assert store.stats.bytes_read == before
        store.write_rows([20], base[:1])  # row 20 shares block 2 with rows 16..23
        assert store.stats.bytes_read == before + 4096
        expected = base.copy()
        expected[8:24] = base[:16]
        expected[20] = base[0]
        np.testing.assert_array_equal(store.read_range(0, 1000), expected)


def test_a_write_touches_each_block_once(tmp_path: Path) -> None:
    layout = RowLayout(1000, 100)  # 400-byte rows: several rows share each block
    with _store(tmp_path, layout, engine="threads") as store:
        ids = np.array([11, 10, 12, 13, 300])  # unsorted, 10..13 share blocks
        store.write_rows(ids, np.ones((5, 100), np.float32))
        blocks = {(store.data_offset + i * 400 + k) // 4096 for i in ids for k in (0, 399)}
        assert store.stats.bytes_written == len(blocks) * 4096


def test_small_pass_budget_splits_batches_correctly(tmp_path: Path) -> None:
    layout = RowLayout(3000, 24)
    rng = np.random.default_rng(5)
    expected = exact_rows(rng, 3000, 24, "fp32")
    with _store(tmp_path, layout, block_size=512, max_pass_bytes=4 * 512) as store:
        ids = rng.permutation(3000)
        store.write_rows(ids, expected[ids])
        probe = rng.integers(0, 3000, 2000)
        np.testing.assert_array_equal(store.read_rows(probe), expected[probe])


def test_runs_helper() -> None:
    starts, lengths = _blockio.merge_runs(np.array([1, 2, 3, 7, 9, 10], dtype=np.int64), 2)
    assert starts.tolist() == [0, 2, 3, 4]
    assert lengths.tolist() == [2, 1, 1, 2]


@pytest.mark.parametrize("bad", [256, 1000, 0, 4097])
def test_block_size_must_be_a_power_of_two_of_at_least_512(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ValueError, match=f"power of two >= 512, got {bad}"):
        _store(tmp_path, RowLayout(4, 2), block_size=bad)
    with pytest.raises(ValueError, match="queue_depth"):
        _store(tmp_path, RowLayout(4, 2), queue_depth=0)
    with pytest.raises(ValueError, match="'bogus'"):
        _store(tmp_path, RowLayout(4, 2), engine="bogus")


def test_files_open_with_other_block_sizes_when_aligned(tmp_path: Path) -> None:
    layout = RowLayout(99, 5)  # 20-byte rows: the file ends mid 4 KiB block at 512 bytes
    rows = exact_rows(np.random.default_rng(6), 99, 5, "fp32")
    with _store(tmp_path, layout, block_size=512) as small:
        small.write_range(0, rows)
    with _store(tmp_path, layout, block_size=4096, mode="open") as big:  # 4096 % 4096 == 0
        np.testing.assert_array_equal(big.read_range(0, 99), rows)
    with pytest.raises(HeaderMismatchError, match="data_offset"):
        _store(tmp_path, layout, block_size=8192, mode="open")  # 4096 is not 8192-aligned


def test_o_direct_refusal_falls_back_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_open = os.open

    def refuse_direct(path: Any, flags: int, *args: Any) -> int:
        if flags & _blockio._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(block_module.os, "open", refuse_direct)
    monkeypatch.setattr(_blockio, "_warned", set())
    caplog.set_level(logging.WARNING)
    rows = np.arange(40, dtype=np.float32).reshape(10, 4)
    for table in ("a", "b"):
        with BlockSCMStore(tmp_path, table, RowLayout(10, 4)) as store:
            assert not store.direct
            assert store.engine == "threads"  # AIO is synchronous on buffered files
            store.write_range(0, rows)
            np.testing.assert_array_equal(store.read_rows([9, 0]), rows[[9, 0]])
    warnings = [r for r in caplog.records if "O_DIRECT" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING


def test_misaligned_direct_io_falls_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_blockio, "_direct_read_works", lambda fd, block_size, offset: False)
    with BlockSCMStore(
        tmp_path, "t", RowLayout(10, 4), options=BlockScmOptions(block_size=512)
    ) as store:
        assert not store.direct
        store.write_rows([3], np.ones((1, 4), np.float32))
        assert store.read_rows([3]).sum() == 4


def test_direct_io_is_used_where_supported(tmp_path: Path) -> None:
    with BlockSCMStore(tmp_path, "t", RowLayout(10, 4)) as store:
        flags = int(
            (Path(f"/proc/self/fdinfo/{store._fd}").read_text().split("flags:")[1].split()[0]), 8
        )
        if not store.direct:
            pytest.skip(f"{tmp_path} does not support O_DIRECT")
        assert flags & _blockio._O_DIRECT
        assert store.engine == ("aio" if uring_refusal() else "uring")


def test_missing_aio_falls_back_to_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def no_aio() -> Any:
        raise OSError(errno.ENOSYS, "no AIO here")

    def no_uring(entries: int) -> Any:
        raise OSError(errno.ENOSYS, "no io_uring here")

    monkeypatch.setattr(_linux, "syscall_fn", no_aio)
    monkeypatch.setattr(_uring, "Ring", no_uring)
    monkeypatch.setattr(_blockio, "_warned", set())
    with BlockSCMStore(tmp_path, "t", RowLayout(10, 4)) as store:
        assert store.engine == "threads"
    assert "native AIO unavailable" in caplog.text
    with pytest.raises(RowStoreError, match=r"t\.block_scm\.rows: setting up the aio I/O engine"):
        BlockSCMStore(
            tmp_path, "t", RowLayout(10, 4), options=BlockScmOptions(engine=IOEngineKind.AIO)
        )


def test_io_errors_name_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = BlockSCMStore(tmp_path, "t", RowLayout(10, 4))

    def full(*args: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store._engine, "run", full)
    with pytest.raises(RowStoreError, match=r"t\.block_scm\.rows: device full while"):
        store.write_range(0, np.ones((10, 4), np.float32))
    monkeypatch.undo()
    store.close()


@pytest.mark.parametrize("engine_cls", [AioEngine, ThreadEngine, UringEngine])
def test_engines_move_blocks_and_report_errors(tmp_path: Path, engine_cls: type) -> None:
    if engine_cls is UringEngine and uring_refusal():
        pytest.skip(uring_refusal())
    path = tmp_path / "raw"
    data = np.random.default_rng(7).integers(0, 255, 64 * 1024, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDWR)
    engine = engine_cls(4)
    buf = AlignedBuffer(8 * 4096)
    try:
        offsets = np.array([15, 2, 7, 8], dtype=np.int64) * 4096
        lengths = np.array([4096, 4096, 8192, 4096], dtype=np.int64)
        slots = np.array([0, 1, 2, 4], dtype=np.int64) * 4096
        calls = engine.run(fd, False, buf, slots, offsets, lengths)
        # AIO submits the four at once and reaps them, io_uring does both in one call;
        # threads make one syscall per I/O.
        assert calls >= {AioEngine: 2, UringEngine: 1, ThreadEngine: 4}[engine_cls]
        for slot, off, n in zip(slots, offsets, lengths):
            np.testing.assert_array_equal(buf.array[slot : slot + n], data[off : off + n])
        buf.array[:4096] = 9
        engine.run(fd, True, buf, slots[:1], offsets[:1], lengths[:1])
        assert os.pread(fd, 4096, 15 * 4096) == b"\x09" * 4096
        with pytest.raises(OSError, match=r"end of file|short read"):  # past the end
            engine.run(fd, False, buf, slots[:1], np.array([64 * 1024 - 100]), lengths[:1])
        closed = os.open(path, os.O_RDONLY)
        os.close(closed)
        with pytest.raises(OSError) as err:
            engine.run(closed, False, buf, slots[:1], offsets[:1], lengths[:1])
        assert err.value.errno == errno.EBADF
        engine.run(fd, False, buf, slots, offsets, lengths)  # still usable after errors
    finally:
        engine.close()
        os.close(fd)


def test_new_file_is_preallocated(tmp_path: Path) -> None:
    with BlockSCMStore(tmp_path, "t", RowLayout(100_000, 16), mode=OpenMode.CREATE) as store:
        st = store.path.stat()
        assert st.st_blocks * 512 >= st.st_size  # no holes: a full disk fails at create
