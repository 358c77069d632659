"""The io_uring engine: short transfers continued, errors naming the I/O (and, through a store,
the file), the fallback to AIO where the kernel refuses io_uring, its rings and registered
buffers under threads, depths and interruptions, and random reads and writes that AIO reads
and writes the same."""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import exact_rows, uring_refusal

from torchrec_mtrains.tiers import RowStoreError, _blockio, _uring
from torchrec_mtrains.tiers._blockio import AioEngine, AlignedBuffer, BlockIOError, UringEngine
from torchrec_mtrains.tiers.block_scm import BlockSCMStore
from torchrec_mtrains.tiers.options import BlockScmOptions, IOEngineKind
from torchrec_mtrains.types import RowLayout

needs_uring = pytest.mark.skipif(uring_refusal() is not None, reason=str(uring_refusal()))
KiB = 1024


def _file(path: Path, nbytes: int, seed: int = 0) -> np.ndarray:
    """Writes ``nbytes`` random bytes to ``path``; returns them."""
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    return data


def _open(path: Path, direct: bool) -> int:
    """``path`` opened read-write, with O_DIRECT when asked (skipping where unsupported)."""
    if not direct:
        return os.open(path, os.O_RDWR)
    try:
        return os.open(path, os.O_RDWR | _blockio._O_DIRECT)
    except OSError as e:
        pytest.skip(f"{path.parent} refuses O_DIRECT: {e}")


@pytest.fixture
def engine() -> Iterator[UringEngine]:
    if uring_refusal():
        pytest.skip(uring_refusal())
    made = UringEngine(8)
    yield made
    made.close()


def _i64(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


# ----------------------------------------------------------------------- short transfers


class _Kernel:
    """Stands between the engine and its ring: lets the test shorten or fail the I/Os the
    kernel is asked for, as a device or file system may."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[np.ndarray] = []  # the lengths asked for, per transfer
        self.shorten: list[dict[int, int]] = []  # per transfer: I/O -> bytes the kernel moves
        self.fail: dict[int, int] = {}  # first transfer: I/O -> -errno it returns
        real = _uring.Ring.transfer

        def transfer(ring: Any, *args: Any) -> int:
            fds, write, address, slot, bo, fo, ln, depth, results = args
            cut = self.shorten[len(self.calls)] if len(self.calls) < len(self.shorten) else {}
            self.calls.append(ln)
            ln = ln.copy()
            for i, keep in cut.items():
                ln[i] = keep  # the kernel really moves only these bytes
            calls = int(real(ring, fds, write, address, slot, bo, fo, ln, depth, results))
            if len(self.calls) == 1:
                for i, err in self.fail.items():
                    results[i] = -err
            return calls

        monkeypatch.setattr(_uring.Ring, "transfer", transfer)


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
@pytest.mark.parametrize("write", [False, True], ids=["read", "write"])
def test_a_short_transfer_is_continued_where_it_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: UringEngine, direct: bool, write: bool
) -> None:
    path = tmp_path / "f"
    data = _file(path, 64 * 4 * KiB)
    fd = _open(path, direct)
    unit = 4 * KiB if direct else 1  # O_DIRECT continues from an aligned point
    kernel = _Kernel(monkeypatch)
    # First transfer: I/Os 0 and 2 stop early; the continuation of I/O 2 stops early again.
    kernel.shorten = [{0: 1 * unit, 2: 2 * unit}, {1: 3 * unit}]
    buf = AlignedBuffer(16 * 4 * KiB)
    offsets = _i64([9, 0, 20, 40]) * 4 * KiB
    lengths = _i64([4, 2, 8, 1]) * 4 * KiB
    slots = _i64([0, 4, 6, 14]) * 4 * KiB
    fresh = np.random.default_rng(1).integers(0, 256, buf.nbytes, dtype=np.uint8)
    buf.array[:] = fresh
    try:
        calls = engine.run(fd, write, buf, slots, offsets, lengths)
        assert calls >= 3 and len(kernel.calls) == 3
        assert kernel.calls[1].tolist() == [4 * 4 * KiB - unit, 8 * 4 * KiB - 2 * unit]
        assert kernel.calls[2].tolist() == [8 * 4 * KiB - 2 * unit - 3 * unit]
        on_file = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        for slot, off, n in zip(slots, offsets, lengths):
            expected = fresh[slot : slot + n] if write else data[off : off + n]
            got = on_file[off : off + n] if write else buf.array[slot : slot + n]
            np.testing.assert_array_equal(got, expected)
    finally:
        os.close(fd)


def test_a_read_past_the_end_names_the_io_and_its_offset(
    tmp_path: Path, engine: UringEngine
) -> None:
    path = tmp_path / "f"
    data = _file(path, 16 * 4 * KiB - 100)  # ends mid-block
    fd = _open(path, direct=False)
    buf = AlignedBuffer(4 * 4 * KiB)
    try:
        offsets = _i64([0, 4, 15, 2]) * 4 * KiB  # the third reads 4 KiB - 100 bytes, then EOF
        lengths = np.full(4, 4 * KiB, dtype=np.int64)
        slots = _i64([0, 1, 2, 3]) * 4 * KiB
        with pytest.raises(BlockIOError) as err:
            engine.run(fd, False, buf, slots, offsets, lengths)
        assert err.value.index == 2 and err.value.errno == errno.EIO
        assert str(err.value.strerror) == f"short read at offset {data.size}: 0 of 100 bytes"
        np.testing.assert_array_equal(buf.array[4 * KiB : 8 * KiB], data[16 * KiB : 20 * KiB])
        engine.run(fd, False, buf, slots[:2], offsets[:2], lengths[:2])  # usable after it
    finally:
        os.close(fd)


def test_an_io_error_names_the_io_and_through_a_store_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if uring_refusal():
        pytest.skip(uring_refusal())
    layout = RowLayout(2000, 16)
    rows = exact_rows(np.random.default_rng(3), 2000, 16, "fp32")
    options = BlockScmOptions(engine=IOEngineKind.URING, block_size=512)
    with BlockSCMStore(tmp_path, "t", layout, options=options) as store:
        store.write_range(0, rows)
        kernel = _Kernel(monkeypatch)
        kernel.fail = {1: errno.EIO}
        with pytest.raises(RowStoreError) as err:
            store.read_rows([5, 700, 1400])
        message = str(err.value)
        assert str(store.path) in message and "reading blocks failed: read at offset" in message
        assert message.endswith(os.strerror(errno.EIO))
        cause = err.value.__cause__
        assert isinstance(cause, BlockIOError) and cause.index == 1
        np.testing.assert_array_equal(store.read_rows([5, 700, 1400]), rows[[5, 700, 1400]])


def test_a_bad_descriptor_fails_its_io_alone(tmp_path: Path, engine: UringEngine) -> None:
    path = tmp_path / "f"
    data = _file(path, 8 * 4 * KiB)
    fd = _open(path, direct=False)
    closed = os.open(path, os.O_RDONLY)
    os.close(closed)
    buf = AlignedBuffer(3 * 4 * KiB)
    try:
        slots, offsets = _i64([0, 1, 2]) * 4 * KiB, _i64([1, 2, 3]) * 4 * KiB
        lengths = np.full(3, 4 * KiB, dtype=np.int64)
        with pytest.raises(BlockIOError) as err:
            engine.run(_i64([fd, closed, fd]), False, buf, slots, offsets, lengths)
        assert err.value.errno == errno.EBADF and err.value.index == 1
        np.testing.assert_array_equal(buf.array[8 * KiB : 12 * KiB], data[12 * KiB : 16 * KiB])
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- fallback


def test_a_refused_io_uring_falls_back_to_aio_with_one_log_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refused(entries: int) -> Any:  # as a seccomp filter or io_uring_disabled answers
        raise OSError(errno.EPERM, "io_uring_setup: Operation not permitted")

    monkeypatch.setattr(_uring, "Ring", refused)
    monkeypatch.setattr(_blockio, "_warned", set())
    caplog.set_level(logging.WARNING)
    rows = np.arange(64, dtype=np.float32).reshape(16, 4)
    for table in ("a", "b"):
        with BlockSCMStore(tmp_path, table, RowLayout(16, 4)) as store:
            if not store.direct:
                pytest.skip(f"{tmp_path} does not support O_DIRECT")
            assert store.engine == "aio"
            store.write_range(0, rows)
            np.testing.assert_array_equal(store.read_rows([15, 0]), rows[[15, 0]])
    assert [r.getMessage() for r in caplog.records] == [
        "io_uring unavailable ([Errno 1] io_uring_setup: Operation not permitted); block I/O "
        "uses native AIO"
    ]
    with pytest.raises(
        RowStoreError, match=r"t\.block_scm\.rows: setting up the uring I/O engine failed"
    ):
        BlockSCMStore(
            tmp_path, "t", RowLayout(4, 4), options=BlockScmOptions(engine=IOEngineKind.URING)
        )


@needs_uring
def test_setup_falls_back_to_the_flags_the_kernel_knows() -> None:
    unknown = 1 << 30  # no such setup flag: EINVAL, as an older kernel answers newer flags
    ring = _uring.Ring(8, choices=(unknown, _uring.SETUP_COOP_TASKRUN, 0))
    try:
        assert ring.info.flags in (_uring.SETUP_COOP_TASKRUN, 0)
    finally:
        ring.close()
    with pytest.raises(OSError) as err:
        _uring.Ring(8, choices=(unknown,))
    assert err.value.errno == errno.EINVAL


# ------------------------------------------------------------------ depths, rings, buffers


@needs_uring
@pytest.mark.parametrize("depth", [1, 3, 64, 5000, 40000])
def test_any_depth_moves_every_io(tmp_path: Path, depth: int) -> None:
    """Lists longer than the ring wrap it many times; a depth past the kernel's largest ring
    keeps a full ring in flight."""
    path = tmp_path / "f"
    n_blocks = 2048
    data = _file(path, n_blocks * 512, seed=depth)
    fd = _open(path, direct=False)
    engine = UringEngine(depth)
    n = max(3 * min(depth, _uring.MAX_ENTRIES), 50)
    rng = np.random.default_rng(depth)
    offsets = rng.integers(0, n_blocks, n) * 512
    slots, lengths = np.arange(n, dtype=np.int64) * 512, np.full(n, 512, dtype=np.int64)
    buf = AlignedBuffer(n * 512)
    try:
        calls = engine.run(fd, False, buf, slots, offsets, lengths)
        got = buf.array[: n * 512].reshape(n, 512)
        np.testing.assert_array_equal(got, data.reshape(n_blocks, 512)[offsets // 512])
        assert calls >= n // min(depth, _uring.MAX_ENTRIES)
        ring = engine._ring()
        assert ring.info.sq_entries >= min(depth, _uring.MAX_ENTRIES)
    finally:
        engine.close()
        os.close(fd)


@needs_uring
def test_threads_get_rings_of_their_own(tmp_path: Path) -> None:
    path = tmp_path / "f"
    data = _file(path, 256 * 4 * KiB)
    fd = _open(path, direct=False)
    engine = UringEngine(4)
    errors: list[BaseException] = []
    rings: set[int] = set()

    slots, lengths = np.arange(32, dtype=np.int64) * 4 * KiB, np.full(32, 4 * KiB, np.int64)

    def reader(seed: int) -> None:
        rng = np.random.default_rng(seed)
        buf = AlignedBuffer(32 * 4 * KiB)
        try:
            for _ in range(20):
                offsets = rng.integers(0, 256, 32) * 4 * KiB
                engine.run(fd, False, buf, slots, offsets, lengths)
                got = buf.array.reshape(32, 4 * KiB)
                np.testing.assert_array_equal(got, data.reshape(256, 4 * KiB)[offsets // 4096])
            rings.add(id(engine._ring()))
        except BaseException as e:
            errors.append(e)

    try:
        threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert len(rings) == 3
        reader(9)  # this thread's ring replaces those of the threads that finished
        assert not errors and len(engine._rings) == 1
    finally:
        engine.close()
        os.close(fd)


@needs_uring
def test_buffers_are_registered_replaced_and_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "f"
    data = _file(path, 64 * 4 * KiB)
    fd = _open(path, direct=False)
    engine = UringEngine(4)
    slots = np.arange(4, dtype=np.int64) * 4 * KiB
    lengths = np.full(4, 4 * KiB, dtype=np.int64)

    def read(buf: AlignedBuffer, first: int) -> None:
        offsets = (first + np.arange(4, dtype=np.int64)) * 4 * KiB
        engine.run(fd, False, buf, slots, offsets, lengths)
        np.testing.assert_array_equal(
            buf.array[: 16 * KiB], data[offsets[0] : offsets[0] + 16 * KiB]
        )

    try:
        buffers = [AlignedBuffer(4 * 4 * KiB) for _ in range(_uring.BUFFER_SLOTS + 2)]
        for round_ in range(3):
            for i in range(len(buffers)):
                read(buffers[i], (round_ + i) % 60)
        ring = engine._ring()
        assert ring.fixed_buffers
        registered = {ref() for ref in ring._buffers if ref is not None}
        assert registered == set(buffers[-_uring.BUFFER_SLOTS :])  # the most recent ones
        del buffers[-1], registered
        gc.collect()
        read(buffers[-1], 7)  # registered: the call only lets go of the dropped buffer's pages
        assert sum(ref is not None for ref in ring._buffers) == _uring.BUFFER_SLOTS - 1
        assert all(ref is None or ref() is not None for ref in ring._buffers)

        real = _uring.Ring._update_buffer

        def over_the_limit(ring: Any, slot: int, address: int, nbytes: int) -> None:
            if nbytes:  # pinning more pages than RLIMIT_MEMLOCK allows; letting go works
                raise OSError(errno.ENOMEM, "io_uring_register(BUFFERS_UPDATE): out of memory")
            real(ring, slot, address, nbytes)

        monkeypatch.setattr(_uring.Ring, "_update_buffer", over_the_limit)
        monkeypatch.setattr(_blockio, "_warned", set())
        caplog.set_level(logging.WARNING)
        for first in (3, 11):  # unregistered buffers: plain reads, one warning
            read(AlignedBuffer(4 * 4 * KiB), first)
        assert not ring.fixed_buffers and ring._buffers == [None] * _uring.BUFFER_SLOTS
        assert len([r for r in caplog.records if "does not register" in r.getMessage()]) == 1
    finally:
        engine.close()
        os.close(fd)


@needs_uring
def test_an_interrupted_call_waits_for_its_ios_and_leaves_the_ring_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    data = _file(path, 256 * 4 * KiB)
    fd = _open(path, direct=True)  # I/Os still in flight when the interruption comes
    engine = UringEngine(16)
    buf = AlignedBuffer(64 * 4 * KiB)
    offsets = np.arange(64, dtype=np.int64)[::-1] * 4 * KiB
    slots = np.arange(64, dtype=np.int64) * 4 * KiB
    lengths = np.full(64, 4 * KiB, dtype=np.int64)
    real = _uring._call()
    enters = 0

    def interrupted(nr: int, *args: int) -> int:
        nonlocal enters
        done = int(real(nr, *args))
        if nr == _uring._NR_ENTER:
            enters += 1
            if enters == 2:  # a signal's KeyboardInterrupt, raised as the call returns
                raise KeyboardInterrupt
        return done

    try:
        engine.run(fd, False, buf, slots[:4], offsets[:4], lengths[:4])  # the ring is made
        ring = engine._ring()
        monkeypatch.setattr(_uring, "_call", lambda: interrupted)
        with pytest.raises(KeyboardInterrupt):
            engine.run(fd, False, buf, slots, offsets, lengths)
        # Idle: nothing left to submit, every I/O the kernel took has completed and been seen.
        assert enters >= 2
        assert ring._sq_head.value == ring._sq_tail.value
        assert ring._cq_head.value == ring._cq_tail.value == ring._sq_head.value
        monkeypatch.undo()
        engine.run(fd, False, buf, slots, offsets, lengths)
        assert engine._ring() is ring
        np.testing.assert_array_equal(buf.array.reshape(64, -1), data.reshape(256, -1)[63::-1])
    finally:
        engine.close()
        os.close(fd)


# ------------------------------------------------------- differential: io_uring against AIO


@needs_uring
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**32 - 1), direct=st.booleans())
def test_random_reads_and_writes_match_aio(
    tmp_path_factory: pytest.TempPathFactory, seed: int, direct: bool
) -> None:
    """Random lists of reads and writes across two files (merged runs, any depth, shuffled
    buffer slots), through io_uring on one copy of the files and AIO on another: the same
    bytes read and the same files left."""
    rng = np.random.default_rng(seed)
    root = tmp_path_factory.mktemp("differential")
    block = int(rng.choice([512, 4096]))
    n_blocks = 96
    depth = int(rng.integers(1, 40))
    copies: dict[str, list[int]] = {}
    for name in ("uring", "aio"):
        fds = []
        for f in range(2):
            path = root / f"{name}{f}"
            _file(path, n_blocks * block, seed=seed + f)
            fds.append(_open(path, direct))
        copies[name] = fds
    engines = {"uring": UringEngine(depth), "aio": AioEngine(depth)}
    buffers = {name: AlignedBuffer(n_blocks * 4 * block) for name in engines}
    try:
        for _ in range(6):
            write = bool(rng.integers(0, 2))
            n = int(rng.integers(1, n_blocks // 4 + 1))
            # Runs of 1-4 blocks; a write's runs never overlap one another within a file.
            starts = rng.choice(n_blocks // 4, size=n, replace=False) * 4
            runs = rng.integers(1, 5, n)
            which = rng.integers(0, 2, n)
            slots = rng.permutation(n) * 4 * block
            payload = rng.integers(0, 256, n * 4 * block, dtype=np.uint8)
            for name, engine in engines.items():
                buf = buffers[name]
                buf.array[: payload.size] = payload
                fds = np.asarray(copies[name], dtype=np.int64)[which]
                engine.run(fds, write, buf, slots, starts * block, runs * block)
            if not write:
                for slot, length in zip(slots, runs * block):
                    np.testing.assert_array_equal(
                        buffers["uring"].array[slot : slot + length],
                        buffers["aio"].array[slot : slot + length],
                    )
        for f in range(2):
            assert (root / f"uring{f}").read_bytes() == (root / f"aio{f}").read_bytes()
    finally:
        for engine in engines.values():
            engine.close()
        for fds in copies.values():
            for fd in fds:
                os.close(fd)


@needs_uring
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stores_on_io_uring_and_aio_read_and_write_the_same_rows(tmp_path: Path, seed: int) -> None:
    """The same random row writes and reads on a block store over each engine: rows
    straddling blocks, passes split by a small pass budget."""
    rng = np.random.default_rng(seed)
    layout = RowLayout(3000, 7)
    stores = []
    for kind in (IOEngineKind.URING, IOEngineKind.AIO):
        depth = int(rng.integers(1, 20))
        options = BlockScmOptions(
            engine=kind, block_size=512, queue_depth=depth, max_pass_bytes=8 * 512
        )
        (tmp_path / kind.value).mkdir()
        stores.append(BlockSCMStore(tmp_path / kind.value, "t", layout, options=options))
    try:
        assert [s.engine for s in stores] == ["uring", "aio"]
        for _ in range(8):
            ids = rng.choice(3000, size=int(rng.integers(1, 400)), replace=False)
            rows = exact_rows(rng, ids.size, 7, "fp32")
            for store in stores:
                store.write_rows(ids, rows)
            probe = rng.integers(0, 3000, int(rng.integers(1, 500)))
            np.testing.assert_array_equal(stores[0].read_rows(probe), stores[1].read_rows(probe))
    finally:
        for store in stores:
            store.close()
