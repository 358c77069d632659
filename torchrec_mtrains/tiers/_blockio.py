"""Aligned buffers and the engines that issue many block I/Os at once for the block tier.

A batch of random rows becomes thousands of small independent reads; a device like NVMe only
reaches its rated IOPS with many of them in flight. Three engines keep ``depth`` I/Os in flight:

* :class:`UringEngine` -- io_uring (:mod:`torchrec_mtrains.tiers._uring`): the I/Os are written
  into the shared submission ring as arrays, one ``io_uring_enter`` submits the free slots' I/Os
  and waits for a batch of completions, and the pass buffers are registered with the kernel, so
  it pins their pages once instead of per I/O. The least CPU per I/O where the kernel offers it.
* :class:`AioEngine` -- Linux native AIO (``io_submit``/``io_getevents``) through raw syscalls:
  one Python thread drives the whole queue, so the cost per I/O is a syscall, not a thread
  hand-off. Truly asynchronous only with ``O_DIRECT``.
* :class:`ThreadEngine` -- a pool of ``depth`` threads each looping over a slice of the I/Os
  with ``os.preadv``/``os.pwritev`` (which release the GIL). Works on every file, buffered too,
  but on a two-core machine the GIL hand-offs cap it well below the device.

An engine's list of I/Os may span several files (an ``fd`` per I/O): a store's read is a
generator of passes (:data:`ReadSteps`), so a driver can issue the passes of several stores
together (:func:`~torchrec_mtrains.tiers.multi_read.read_rows_together`), or one store's alone
(:func:`drive_reads`).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.tiers import _linux, _uring
from torchrec_mtrains.tiers.options import AUTO_ENGINES, IOEngineKind

logger: logging.Logger = logging.getLogger(__name__)

I64Array = npt.NDArray[np.int64]
U8Array = npt.NDArray[np.uint8]

# struct iocb and struct io_event from linux/aio_abi.h (64-bit little-endian layout).
_IOCB = np.dtype(
    [
        ("data", "<u8"),
        ("key", "<u4"),
        ("rw_flags", "<u4"),
        ("opcode", "<u2"),
        ("reqprio", "<i2"),
        ("fildes", "<u4"),
        ("buf", "<u8"),
        ("nbytes", "<u8"),
        ("offset", "<i8"),
        ("reserved2", "<u8"),
        ("flags", "<u4"),
        ("resfd", "<u4"),
    ]
)
_EVENT = np.dtype([("data", "<u8"), ("obj", "<u8"), ("res", "<i8"), ("res2", "<i8")])
_IOCB_CMD_PREAD = 0
_IOCB_CMD_PWRITE = 1
assert _IOCB.itemsize == 64 and _EVENT.itemsize == 32


class AlignedBuffer:
    """Page-aligned memory from an anonymous mapping, as O_DIRECT requires of user buffers."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(nbytes, mmap.PAGESIZE)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self._map, dtype=np.uint8)
        self.view = memoryview(self._map)
        self.address: int = self.array.ctypes.data


IDLE_PASSES = 1  # buffers a store keeps idle between calls, in passes


class BufferPool:
    """Reuses aligned buffers across calls: faulting in fresh pages for every batch would cost
    about as much as the gather itself. Keeps at most ``keep_bytes`` of idle buffers."""

    def __init__(self, keep_bytes: int = 256 << 20) -> None:
        self._idle: list[AlignedBuffer] = []
        self._lock = threading.Lock()
        self._keep_bytes = keep_bytes

    def take(self, nbytes: int) -> AlignedBuffer:
        with self._lock:
            fits = [b for b in self._idle if b.nbytes >= nbytes]
            if fits:
                best = min(fits, key=lambda b: b.nbytes)
                self._idle.remove(best)
                return best
        # Round up (by at most 1/8) so slightly different batch sizes reuse the same buffer.
        step = max(mmap.PAGESIZE, 1 << max(nbytes.bit_length() - 4, 0))
        return AlignedBuffer(-(-max(nbytes, 1) // step) * step)

    def clear(self) -> None:
        """Drops every idle buffer (after bulk work whose large buffers steady use does not
        need: they would stay resident, the pages they touched included)."""
        with self._lock:
            self._idle.clear()

    def give(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self._idle.append(buf)
            self._idle.sort(key=lambda b: b.nbytes)
            while sum(b.nbytes for b in self._idle) > self._keep_bytes and self._idle:
                self._idle.pop()  # drop the largest


class BlockIOError(OSError):
    """One I/O of a list failed; :attr:`index` is its position in the list (which says which
    file, for a list spanning several)."""

    def __init__(self, err: int, message: str, index: int) -> None:
        super().__init__(err, message)
        self.index = index


class IOEngine(ABC):
    """Issues a list of independent I/Os between files and one buffer.

    Each I/O ``i`` moves ``lengths[i]`` bytes between the file ``fd`` (or ``fd[i]``, one
    descriptor per I/O) at ``file_offsets[i]`` and the buffer at ``buf_offsets[i]``. Returns the
    number of system calls issued; raises :class:`BlockIOError` naming the failed I/O (after
    every I/O has finished, so the buffer is free again).
    """

    kind: ClassVar[IOEngineKind]
    depth: int

    @abstractmethod
    def run(
        self,
        fd: int | I64Array,
        write: bool,
        buf: AlignedBuffer,
        buf_offsets: I64Array,
        file_offsets: I64Array,
        lengths: I64Array,
    ) -> int: ...

    @abstractmethod
    def close(self) -> None: ...


def _pio(
    fds: list[int],
    write: bool,
    view: memoryview,
    buf_offsets: list[int],
    file_offsets: list[int],
    lengths: list[int],
    indexes: range,
) -> int:
    """Synchronous I/O of a slice of the list (``indexes``: the slice's positions in it);
    completes short transfers."""
    calls = 0
    call = os.pwritev if write else os.preadv
    for fd, b, o, n, i in zip(fds, buf_offsets, file_offsets, lengths, indexes):
        try:
            done = call(fd, [view[b : b + n]], o)
            calls += 1
            while done < n:  # short transfer: only at end of file or on signals
                moved = call(fd, [view[b + done : b + n]], o + done)
                calls += 1
                if moved == 0:
                    raise OSError(errno.EIO, f"unexpected end of file at offset {o + done}")
                done += moved
        except OSError as e:
            raise BlockIOError(e.errno or errno.EIO, e.strerror or str(e), i) from e
    return calls


class ThreadEngine(IOEngine):
    """``depth`` worker threads, each issuing a slice of the I/Os with positional syscalls."""

    kind = IOEngineKind.THREADS

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.depth, thread_name_prefix="block_scm-io")
            return self._pool

    def run(
        self,
        fd: int | I64Array,
        write: bool,
        buf: AlignedBuffer,
        buf_offsets: I64Array,
        file_offsets: I64Array,
        lengths: I64Array,
    ) -> int:
        n = len(lengths)
        fds = [fd] * n if isinstance(fd, int) else fd.tolist()
        bo, fo, ln = buf_offsets.tolist(), file_offsets.tolist(), lengths.tolist()
        if n <= 2 or self.depth == 1:
            return _pio(fds, write, buf.view, bo, fo, ln, range(n))
        k = min(self.depth, n)
        pool = self._executor()
        futures: list[Future[int]] = [
            pool.submit(
                _pio, fds[i::k], write, buf.view, bo[i::k], fo[i::k], ln[i::k], range(i, n, k)
            )
            for i in range(k)
        ]
        wait(futures)  # all of them, before raising: the buffer is in use until then
        return sum(f.result() for f in futures)

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


class AioEngine(IOEngine):
    """Linux native AIO with up to ``depth`` I/Os in flight per call.

    Each concurrent caller takes its own AIO context from a small pool, so several threads can
    read at once (the syscalls release the GIL). Raises ``OSError`` from the constructor when
    the kernel or platform does not offer AIO, so the caller can fall back to threads.
    """

    kind = IOEngineKind.AIO

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._call, self._nr_setup, self._nr_destroy, self._nr_submit, self._nr_getevents = (
            _linux.syscall_fn()
        )
        self._idle: list[int] = []
        self._lock = threading.Lock()
        self._idle.append(self._setup())  # fail now, not at the first read

    def _setup(self) -> int:
        ctx = ctypes.c_ulong(0)
        if self._call(self._nr_setup, self.depth, ctypes.addressof(ctx), 0, 0, 0, 0) < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"io_setup: {os.strerror(err)}")
        return ctx.value

    def _destroy(self, ctx: int) -> None:
        # Waits for the context's outstanding I/Os before returning.
        if self._call(self._nr_destroy, ctx, 0, 0, 0, 0, 0) < 0:
            logger.warning("io_destroy failed: %s", os.strerror(ctypes.get_errno()))

    def run(
        self,
        fd: int | I64Array,
        write: bool,
        buf: AlignedBuffer,
        buf_offsets: I64Array,
        file_offsets: I64Array,
        lengths: I64Array,
    ) -> int:
        n = len(lengths)
        if n == 0:
            return 0
        iocbs = np.zeros(n, dtype=_IOCB)
        iocbs["data"] = np.arange(n)
        iocbs["opcode"] = _IOCB_CMD_PWRITE if write else _IOCB_CMD_PREAD
        iocbs["fildes"] = fd
        iocbs["buf"] = buf.address + buf_offsets
        iocbs["nbytes"] = lengths
        iocbs["offset"] = file_offsets
        pointers = iocbs.ctypes.data + np.arange(n, dtype=np.uint64) * _IOCB.itemsize
        events = np.zeros(n, dtype=_EVENT)
        with self._lock:
            ctx = self._idle.pop() if self._idle else None
        if ctx is None:
            ctx = self._setup()
        try:
            calls = self._drive(ctx, n, pointers.ctypes.data, events.ctypes.data)
        except BaseException:
            self._destroy(ctx)  # blocks until the kernel is done with the buffer
            raise
        with self._lock:
            self._idle.append(ctx)
        res = events["res"]
        expected = lengths[events["data"].astype(np.int64)]
        bad = np.flatnonzero(res != expected)
        if bad.size:
            i = int(bad[0])
            index = int(events["data"][i])
            raise _failure(write, index, int(file_offsets[index]), int(res[i]), int(expected[i]))
        return calls

    def _drive(self, ctx: int, n: int, pointers: int, events: int) -> int:
        call, submit, getevents, depth = self._call, self._nr_submit, self._nr_getevents, self.depth
        # Refill the queue in batches: each io_submit hands the kernel every free queue slot,
        # and each io_getevents waits for a quarter of the queue. Python then runs once per
        # ~depth/4 I/Os instead of twice per I/O, which matters more than the last few percent
        # of device IOPS: this loop shares the GIL (and, on small hosts, the cores) with
        # training, and a syscall per I/O cost the training thread tens of ms per step.
        reap = max(1, depth // 4)
        submitted = completed = calls = 0
        while completed < n:
            room = min(depth - (submitted - completed), n - submitted)
            if room > 0:
                calls += 1
                done = call(submit, ctx, room, pointers + submitted * 8, 0, 0, 0)
                if done > 0:
                    submitted += done
                else:
                    err = ctypes.get_errno()
                    if err == errno.EINTR:
                        continue
                    if not (err == errno.EAGAIN and submitted > completed):
                        raise OSError(err, f"io_submit: {os.strerror(err)}")
                    # kernel queue full: reap first
            in_flight = submitted - completed
            calls += 1
            got = call(
                getevents,
                ctx,
                min(reap, in_flight),
                in_flight,
                events + completed * _EVENT.itemsize,
                0,
                0,
            )
            if got < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, f"io_getevents: {os.strerror(err)}")
            completed += got
        return calls

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for ctx in idle:
            self._destroy(ctx)


def _failure(write: bool, index: int, offset: int, res: int, expected: int) -> BlockIOError:
    """The error of I/O ``index`` at ``offset`` that returned ``res`` (``-errno``, or fewer
    bytes than the ``expected``)."""
    doing = "write" if write else "read"
    if res < 0:
        return BlockIOError(-res, f"{doing} at offset {offset}: {os.strerror(-res)}", index)
    return BlockIOError(
        errno.EIO, f"short {doing} at offset {offset}: {res} of {expected} bytes", index
    )


class UringEngine(IOEngine):
    """io_uring with up to ``depth`` I/Os in flight per call.

    Each thread that calls :meth:`run` gets a ring of its own (the kernel binds a
    ``SINGLE_ISSUER`` ring to one thread), so several threads can read at once, as with AIO.
    The ring registers the buffers it is given (a few, the least recently used replaced);
    a buffer that is dropped stays pinned by the kernel until that thread's next call or
    :meth:`close`. A short transfer (which O_DIRECT only makes at the end of a file) is
    continued from where it stopped; one that moves nothing is an error.

    Raises ``OSError`` from the constructor when the kernel refuses io_uring (too old,
    ``kernel.io_uring_disabled``, a seccomp filter), so the caller can fall back to AIO.
    """

    kind = IOEngineKind.URING

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._lock = threading.Lock()
        self._local = threading.local()
        self._rings: list[tuple[threading.Thread, _uring.Ring]] = []
        # Made here, so that a refusal shows at open, and handed to the first thread that runs.
        self._spare: _uring.Ring | None = _uring.Ring(depth)
        self.setup = self._spare.info.describe()

    def _ring(self) -> _uring.Ring:
        ring: _uring.Ring | None = getattr(self._local, "ring", None)
        if ring is not None and ring.fd >= 0 and ring.pid == os.getpid():
            return ring
        with self._lock:
            ring, self._spare = self._spare, None
            if ring is not None and ring.pid != os.getpid():
                ring = None  # made before a fork: the parent's
            finished = [r for owner, r in self._rings if not owner.is_alive()]
            self._rings = [(owner, r) for owner, r in self._rings if owner.is_alive()]
        for r in finished:  # idle: every call waits for its I/Os
            r.close()
        if ring is None:
            ring = _uring.Ring(self.depth)
        try:
            ring.claim()
        except BaseException:
            ring.close()
            raise
        with self._lock:
            self._rings.append((threading.current_thread(), ring))
        self._local.ring = ring
        return ring

    def run(
        self,
        fd: int | I64Array,
        write: bool,
        buf: AlignedBuffer,
        buf_offsets: I64Array,
        file_offsets: I64Array,
        lengths: I64Array,
    ) -> int:
        todo = np.flatnonzero(lengths > 0)
        if not todo.size:
            return 0
        ring = self._ring()
        ring.release_dead_buffers()
        slot = ring.buffer_slot(buf, buf.address, buf.nbytes)
        if slot < 0 and ring.buffer_refusal is not None:
            warn_once(
                "uring-buffers",
                "io_uring does not register the I/O buffers (%s, e.g. RLIMIT_MEMLOCK too low); "
                "the kernel pins their pages one I/O at a time instead",
                ring.buffer_refusal,
            )
        fds = fd if isinstance(fd, int) else np.asarray(fd, dtype=np.int64)
        done = np.zeros(len(lengths), dtype=np.int64)
        calls = 0
        while True:
            results = np.empty(todo.size, dtype=np.int32)
            calls += ring.transfer(
                fds if isinstance(fds, int) else fds[todo],
                write,
                buf.address,
                slot,
                buf_offsets[todo] + done[todo],
                file_offsets[todo] + done[todo],
                lengths[todo] - done[todo],
                self.depth,
                results,
            )
            moved = results > 0
            done[todo[moved]] += results[moved]
            bad = np.flatnonzero(results <= 0)
            if bad.size:
                i = int(todo[bad[0]])
                offset = int(file_offsets[i] + done[i])
                raise _failure(write, i, offset, int(results[bad[0]]), int(lengths[i] - done[i]))
            todo = todo[done[todo] < lengths[todo]]
            if not todo.size:
                return calls

    def close(self) -> None:
        with self._lock:
            rings = [r for _, r in self._rings]
            if self._spare is not None:
                rings.append(self._spare)
            self._rings, self._spare = [], None
        for ring in rings:
            ring.close()


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(key: str, message: str, *args: object) -> None:
    """Logs ``message`` as a warning the first time ``key`` is seen in this process, later at
    debug level: a fallback hit by every table would otherwise flood the log."""
    with _warned_lock:
        first = key not in _warned
        _warned.add(key)
    logger.log(logging.WARNING if first else logging.DEBUG, message, *args)


@dataclass(frozen=True)
class ReadPass:
    """One pass of a store's reads: ``lengths[i]`` bytes at ``file_offsets[i]`` of ``fd`` into
    a buffer of ``nbytes`` (whole blocks) at ``buf_offsets[i]``."""

    fd: int
    nbytes: int
    buf_offsets: I64Array
    file_offsets: I64Array
    lengths: I64Array


ReadSteps = Generator[ReadPass, tuple[U8Array, int], tuple[int, int]]
"""A store's read of some rows as passes of block I/O: it yields each pass, is sent the pass's
bytes (valid until it yields again) and the system calls they took, and returns the bytes and
the calls it moved in all."""


class PassReader(ABC):
    """A store whose reads are passes of block I/O (:meth:`read_passes`) on its own engine and
    buffer pool, so that a driver may issue them together with other such stores' passes."""

    _engine: IOEngine
    _buffers: BufferPool
    _fd: int
    direct: bool
    engine: str  # "uring", "aio" or "threads": the engine in use, after any fallback

    @abstractmethod
    def _os_error(self, err: OSError, doing: str) -> Exception:
        """``err`` as an error naming the store's file (the store's own)."""

    def _start_io(self, kind: IOEngineKind, depth: int, max_pass_bytes: int) -> None:
        """Sets up the engine for the open file (closing it when that fails) and the pool that
        keeps a pass's buffer idle between calls."""
        try:
            self._engine = make_engine(kind, depth, self.direct)
        except OSError as e:
            os.close(self._fd)
            raise self._os_error(e, f"setting up the {kind.value} I/O engine") from e
        self.engine = self._engine.kind.value
        self._buffers = BufferPool(keep_bytes=IDLE_PASSES * max_pass_bytes)

    def _drive(self, steps: ReadSteps) -> tuple[int, int]:
        """Runs this store's read ``steps`` alone (:func:`drive_reads`)."""
        return drive_reads(
            steps, self._engine, self._buffers, lambda e: self._os_error(e, "reading blocks")
        )

    @abstractmethod
    def read_passes(self, ids: I64Array, out: npt.NDArray[np.float32]) -> ReadSteps:
        """The read of rows ``ids`` (checked, in range) into ``out``, as passes of I/O."""


def drive_reads(
    steps: ReadSteps,
    engine: IOEngine,
    pool: BufferPool,
    name_error: Callable[[OSError], Exception],
) -> tuple[int, int]:
    """Runs one store's read passes one after another on ``engine``, each in a buffer from
    ``pool``; an I/O error is raised as ``name_error`` makes it (naming the store's file)."""
    try:
        reads = next(steps)
        while True:
            buf = pool.take(reads.nbytes)
            try:
                try:
                    calls = engine.run(
                        reads.fd,
                        False,
                        buf,
                        reads.buf_offsets,
                        reads.file_offsets,
                        reads.lengths,
                    )
                except OSError as e:
                    raise name_error(e) from e
                reads = steps.send((buf.array[: reads.nbytes], calls))
            finally:
                pool.give(buf)
    except StopIteration as done:
        moved_calls: tuple[int, int] = done.value
        return moved_calls
    finally:
        steps.close()


_ENGINES: dict[IOEngineKind, Callable[[int], IOEngine]] = {
    IOEngineKind.URING: UringEngine,
    IOEngineKind.AIO: AioEngine,
    IOEngineKind.THREADS: ThreadEngine,
}
_NAMES = {IOEngineKind.URING: "io_uring", IOEngineKind.AIO: "native AIO"}


def make_engine(kind: IOEngineKind, depth: int, direct: bool) -> IOEngine:
    """Builds the engine ``kind`` asks for. ``AUTO`` takes, for an O_DIRECT file, the first
    of :data:`~torchrec_mtrains.tiers.options.AUTO_ENGINES` the kernel sets up, logging once
    per process why it passed over another, and threads for a buffered file or where the
    kernel refuses them all. Raises ``OSError`` where the kernel refuses the engine named."""
    if kind is not IOEngineKind.AUTO:
        return _ENGINES[kind](depth)
    if direct:
        for i, candidate in enumerate(AUTO_ENGINES):
            try:
                return _ENGINES[candidate](depth)
            except OSError as e:
                rest = AUTO_ENGINES[i + 1 :]
                instead = _NAMES[rest[0]] if rest else "a thread pool"
                warn_once(
                    candidate.value,
                    "%s unavailable (%s); block I/O uses %s",
                    _NAMES[candidate],
                    e,
                    instead,
                )
    return ThreadEngine(depth)


def merge_runs(blocks: I64Array, max_len: int) -> tuple[I64Array, I64Array]:
    """Splits sorted unique block numbers into runs of consecutive blocks of at most
    ``max_len``, so adjacent blocks move in one I/O; returns each run's first index into
    ``blocks`` and its length."""
    n = blocks.size
    breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], breaks)).astype(np.int64)
    ends = np.concatenate((breaks, [n])).astype(np.int64)
    lengths = ends - starts
    if lengths.size and int(lengths.max()) > max_len:
        pieces = -(-lengths // max_len)
        within = np.arange(int(pieces.sum())) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        starts = np.repeat(starts, pieces) + within * max_len
        lengths = np.minimum(starts + max_len, np.repeat(ends, pieces)) - starts
    return starts, lengths


_O_DIRECT: int = getattr(os, "O_DIRECT", 0)


def open_block_file(
    path: str | os.PathLike[str], block_size: int, probe_offset: int, direct: bool, tier: str
) -> tuple[int, bool]:
    """Opens ``path`` read-write for block I/O: with ``O_DIRECT`` when asked for and the file
    system honours it for ``block_size``-byte I/O (probed by one aligned read at
    ``probe_offset``), else buffered, warning once per process. Returns ``(fd, direct)``;
    raises ``OSError`` when the file cannot be opened at all."""
    flags = os.O_RDWR | os.O_CLOEXEC
    if direct and _O_DIRECT:
        try:
            fd = os.open(path, flags | _O_DIRECT)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            warn_once(
                f"odirect-{tier}",
                "%s: the file system refuses O_DIRECT; %s uses buffered I/O (the page cache "
                "now sits in front of the device)",
                os.path.dirname(path),
                tier,
            )
        else:
            try:
                works = _direct_read_works(fd, block_size, probe_offset)
            except BaseException:
                os.close(fd)
                raise
            if works:
                return fd, True
            os.close(fd)
            warn_once(
                f"odirect-align-{tier}",
                "%s: O_DIRECT I/O of %d-byte blocks fails (the device needs larger alignment); "
                "%s uses buffered I/O",
                os.path.dirname(path),
                block_size,
                tier,
            )
    return os.open(path, flags), False


def _direct_read_works(fd: int, block_size: int, offset: int) -> bool:
    """Probes one block-sized, block-aligned read: some file systems accept O_DIRECT at open
    and only refuse misaligned I/O later (e.g. 512-byte blocks on a 4Kn device)."""
    buf = AlignedBuffer(2 * max(block_size, 4096))
    pos = block_size if block_size < 4096 else 0  # aligned to the block, not to a page
    try:
        os.preadv(fd, [buf.view[pos : pos + block_size]], offset)
    except OSError as e:
        if e.errno == errno.EINVAL:
            return False
        raise
    return True
