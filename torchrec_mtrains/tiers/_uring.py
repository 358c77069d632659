"""io_uring through its three system calls and the rings they map, for the block tier's engine.

glibc does not wrap ``io_uring_setup``/``io_uring_enter``/``io_uring_register``, so they are
issued by number (as :mod:`torchrec_mtrains.tiers._linux` issues the AIO calls), and the rings
are the kernel's shared memory, written and read by address. A list of I/Os is built as one
numpy array of entries, copied into the submission ring a run at a time, and its completions
are copied out the same way: Python runs once per system call, not once per I/O. (The
``liburing`` package on PyPI would make it one Python call per I/O, on ``bytearray`` buffers,
and asks for Linux 6.14.)

A :class:`Ring` belongs to one thread: set up ``SINGLE_ISSUER | DEFER_TASKRUN`` where the kernel
offers them, the kernel completes I/Os in that thread's own ``io_uring_enter``, in batches,
instead of in task work that interrupts it. It registers the buffers it is given
(``READ_FIXED``/``WRITE_FIXED``: their pages are pinned once, not per I/O) where the kernel lets
it, and falls back to plain reads and writes where it does not (e.g. a locked-memory limit).

Only x86_64 and aarch64 Linux are known here. Where completions may be posted by another CPU
(kernels without ``DEFER_TASKRUN``) the rings are read without memory barriers, which only
x86's ordering makes safe; :class:`Ring` refuses that case elsewhere.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import weakref
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.tiers import _linux

I64Array = npt.NDArray[np.int64]

# The io_uring calls came after the architectures' tables were unified: one number everywhere.
_NR_SETUP, _NR_ENTER, _NR_REGISTER = 425, 426, 427

# linux/io_uring.h
SETUP_R_DISABLED = 1 << 6
SETUP_SUBMIT_ALL = 1 << 7
SETUP_COOP_TASKRUN = 1 << 8
SETUP_SINGLE_ISSUER = 1 << 12
SETUP_DEFER_TASKRUN = 1 << 13
SETUP_NO_SQARRAY = 1 << 16
FEAT_SINGLE_MMAP = 1 << 0
FEAT_NODROP = 1 << 1
ENTER_GETEVENTS = 1 << 0
OP_READ_FIXED = 4
OP_WRITE_FIXED = 5
OP_READ = 22
OP_WRITE = 23
_REGISTER_PROBE = 8
_REGISTER_ENABLE_RINGS = 12
_REGISTER_BUFFERS2 = 15
_REGISTER_BUFFERS_UPDATE = 16
_RSRC_REGISTER_SPARSE = 1 << 0
_OP_SUPPORTED = 1 << 0
_OFF_SQ_RING = 0
_OFF_SQES = 0x10000000
MAX_ENTRIES = 32768  # the kernel's largest submission ring

# Setup flags tried in order, the first the kernel accepts is kept (each later entry is what an
# older kernel offers): SINGLE_ISSUER + DEFER_TASKRUN (6.1) batch completion work into the
# submitting thread's own io_uring_enter; NO_SQARRAY (6.6) drops an indirection; COOP_TASKRUN
# (5.19) at least stops completion work from interrupting the thread. SUBMIT_ALL keeps a batch
# going past an I/O that fails at submission (its error comes back as its completion).
SETUP_CHOICES: tuple[int, ...] = (
    SETUP_SINGLE_ISSUER | SETUP_DEFER_TASKRUN | SETUP_SUBMIT_ALL | SETUP_NO_SQARRAY,
    SETUP_SINGLE_ISSUER | SETUP_DEFER_TASKRUN | SETUP_SUBMIT_ALL,
    SETUP_COOP_TASKRUN | SETUP_SUBMIT_ALL,
    0,
)
SETUP_NAMES = {
    SETUP_SINGLE_ISSUER: "SINGLE_ISSUER",
    SETUP_DEFER_TASKRUN: "DEFER_TASKRUN",
    SETUP_NO_SQARRAY: "NO_SQARRAY",
    SETUP_COOP_TASKRUN: "COOP_TASKRUN",
    SETUP_SUBMIT_ALL: "SUBMIT_ALL",
    SETUP_R_DISABLED: "R_DISABLED",
}

_SQRING_OFFSETS = [
    ("head", "<u4"),
    ("tail", "<u4"),
    ("ring_mask", "<u4"),
    ("ring_entries", "<u4"),
    ("flags", "<u4"),
    ("dropped", "<u4"),
    ("array", "<u4"),
    ("resv1", "<u4"),
    ("user_addr", "<u8"),
]
_CQRING_OFFSETS = [
    ("head", "<u4"),
    ("tail", "<u4"),
    ("ring_mask", "<u4"),
    ("ring_entries", "<u4"),
    ("overflow", "<u4"),
    ("cqes", "<u4"),
    ("flags", "<u4"),
    ("resv1", "<u4"),
    ("user_addr", "<u8"),
]
_PARAMS = np.dtype(
    [
        ("sq_entries", "<u4"),
        ("cq_entries", "<u4"),
        ("flags", "<u4"),
        ("sq_thread_cpu", "<u4"),
        ("sq_thread_idle", "<u4"),
        ("features", "<u4"),
        ("wq_fd", "<u4"),
        ("resv", "<u4", (3,)),
        ("sq_off", _SQRING_OFFSETS),
        ("cq_off", _CQRING_OFFSETS),
    ]
)
SQE = np.dtype(
    [
        ("opcode", "u1"),
        ("flags", "u1"),
        ("ioprio", "<u2"),
        ("fd", "<i4"),
        ("off", "<u8"),
        ("addr", "<u8"),
        ("len", "<u4"),
        ("rw_flags", "<u4"),
        ("user_data", "<u8"),
        ("buf_index", "<u2"),
        ("personality", "<u2"),
        ("splice_fd_in", "<i4"),
        ("addr3", "<u8"),
        ("pad2", "<u8"),
    ]
)
CQE = np.dtype([("user_data", "<u8"), ("res", "<i4"), ("flags", "<u4")])
_RSRC_REGISTER = np.dtype(
    [("nr", "<u4"), ("flags", "<u4"), ("resv2", "<u8"), ("data", "<u8"), ("tags", "<u8")]
)
_RSRC_UPDATE2 = np.dtype(
    [
        ("offset", "<u4"),
        ("resv", "<u4"),
        ("data", "<u8"),
        ("tags", "<u8"),
        ("nr", "<u4"),
        ("resv2", "<u4"),
    ]
)
_IOVEC = np.dtype([("base", "<u8"), ("len", "<u8")])
assert _PARAMS.itemsize == 120 and SQE.itemsize == 64 and CQE.itemsize == 16  # as _drive copies
assert _RSRC_REGISTER.itemsize == 32 and _RSRC_UPDATE2.itemsize == 32
_U32 = 0xFFFFFFFF

BUFFER_SLOTS = 4
"""Buffers a ring keeps registered: a store holds at most two pass buffers at once, a tier
worker's stores share them; a fifth replaces the least recently used."""

MAX_BUFFER_BYTES = 1 << 30  # the kernel's limit on one registered buffer

REAP_DIVISOR = 4
"""Each ``io_uring_enter`` waits for ``depth // REAP_DIVISOR`` completions."""


@cache
def _call() -> Any:
    return _linux._syscall()


def _errno_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


@dataclass(frozen=True)
class RingInfo:
    """What the kernel granted a ring: its sizes, setup flags and features."""

    sq_entries: int
    cq_entries: int
    flags: int
    features: int

    def describe(self) -> str:
        names = [name for bit, name in SETUP_NAMES.items() if self.flags & bit]
        return f"{self.sq_entries} entries, flags {'|'.join(names) or 'none'}"


class Ring:
    """One io_uring instance: its rings mapped into this process, used by one thread at a time
    (by exactly one thread, the one that calls :meth:`claim`, when set up ``SINGLE_ISSUER``).

    Raises ``OSError`` from the constructor when the kernel refuses io_uring (an old kernel,
    ``kernel.io_uring_disabled``, a seccomp filter) or lacks an operation the engine needs.
    """

    def __init__(self, entries: int, choices: tuple[int, ...] = SETUP_CHOICES) -> None:
        entries = max(1, min(int(entries), MAX_ENTRIES))
        params = np.zeros(1, dtype=_PARAMS)
        fd = -1
        refused: OSError | None = None
        for flags in choices:
            if flags & SETUP_SINGLE_ISSUER:
                flags |= SETUP_R_DISABLED  # bound to the thread that claims it, not this one
            params[...] = 0
            params["flags"] = flags
            fd = _call()(_NR_SETUP, entries, params.ctypes.data, 0, 0, 0, 0)
            if fd >= 0:
                break
            refused = _errno_error("io_uring_setup")
            if refused.errno != errno.EINVAL:  # EINVAL: flags this kernel does not know
                raise refused
        if fd < 0:
            assert refused is not None
            raise refused
        self.fd: int = fd
        self.pid = os.getpid()  # a forked child must not submit to its parent's ring
        self._maps: list[mmap.mmap] = []
        try:
            self._map_rings(params[0])
            self._check_ops()
        except BaseException:
            self.close()
            raise
        self.claimed = not (self.info.flags & SETUP_SINGLE_ISSUER)
        self._buffers: list[weakref.ref[Any] | None] = [None] * BUFFER_SLOTS
        self._buffer_use = [0] * BUFFER_SLOTS
        self._uses = 0
        self.fixed_buffers: bool | None = None  # None: not tried yet
        self.buffer_refusal: OSError | None = None

    # ------------------------------------------------------------------------------ set-up

    def _map_rings(self, p: Any) -> None:
        features = int(p["features"])
        if not features & FEAT_SINGLE_MMAP or not features & FEAT_NODROP:
            raise OSError(errno.ENOSYS, "io_uring: kernel too old (needs 5.5's ring features)")
        sq, cq = p["sq_off"], p["cq_off"]
        sq_entries, cq_entries = int(p["sq_entries"]), int(p["cq_entries"])
        flags = int(p["flags"]) & ~SETUP_R_DISABLED
        self.info = RingInfo(sq_entries, cq_entries, flags, features)
        if platform.machine() != "x86_64" and not flags & SETUP_DEFER_TASKRUN:
            raise OSError(
                errno.ENOSYS,
                f"io_uring without DEFER_TASKRUN needs memory barriers not issued on "
                f"{platform.machine()}",
            )
        size = max(int(sq["array"]) + sq_entries * 4, int(cq["cqes"]) + cq_entries * CQE.itemsize)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        populate = getattr(mmap, "MAP_POPULATE", 0)
        rings = mmap.mmap(self.fd, size, mmap.MAP_SHARED | populate, prot, offset=_OFF_SQ_RING)
        self._maps.append(rings)
        sqes = mmap.mmap(
            self.fd, sq_entries * SQE.itemsize, mmap.MAP_SHARED | populate, prot, offset=_OFF_SQES
        )
        self._maps.append(sqes)
        words = np.frombuffer(rings, dtype=np.uint32)
        if not flags & SETUP_NO_SQARRAY:  # the identity: slot i of the ring is SQE i
            start = int(sq["array"]) // 4
            words[start : start + sq_entries] = np.arange(sq_entries, dtype=np.uint32)
        # Plain addresses, not buffer views, so that close() can unmap: every use of them is
        # guarded by the ring being open (fd >= 0).
        base = words.ctypes.data
        sqes_base = np.frombuffer(sqes, dtype=np.uint8).ctypes.data
        del words

        def word(offset: int) -> ctypes.c_uint32:
            return ctypes.c_uint32.from_address(base + offset)

        self._sq_head, self._sq_tail = word(int(sq["head"])), word(int(sq["tail"]))
        self._cq_head, self._cq_tail = word(int(cq["head"])), word(int(cq["tail"]))
        self._sq_mask = word(int(sq["ring_mask"])).value
        self._cq_mask = word(int(cq["ring_mask"])).value
        self._sqes_at = sqes_base
        self._cqes_at = base + int(cq["cqes"])

    def _check_ops(self) -> None:
        # struct io_uring_probe: 16 bytes, then 8 per operation (op, resv, flags, resv2).
        probe = np.zeros(16 + 256 * 8, dtype=np.uint8)
        if _call()(_NR_REGISTER, self.fd, _REGISTER_PROBE, probe.ctypes.data, 256, 0, 0) < 0:
            raise _errno_error("io_uring_register(PROBE)")  # before 5.6: no READ/WRITE
        ops = probe[16:].reshape(256, 8)
        for op in (OP_READ, OP_WRITE, OP_READ_FIXED, OP_WRITE_FIXED):
            if not ops[op, 2] & _OP_SUPPORTED:
                raise OSError(errno.ENOSYS, f"io_uring: operation {op} not supported")

    def claim(self) -> None:
        """Binds a ``SINGLE_ISSUER`` ring to the calling thread (its only submitter)."""
        if not self.claimed:
            self._register(_REGISTER_ENABLE_RINGS, 0, 0, "ENABLE_RINGS")
            self.claimed = True

    def _register(self, opcode: int, arg: int, nr: int, what: str) -> int:
        while True:
            done = int(_call()(_NR_REGISTER, self.fd, opcode, arg, nr, 0, 0))
            if done >= 0:
                return done
            err = _errno_error(f"io_uring_register({what})")
            if err.errno != errno.EINTR:
                raise err

    # ------------------------------------------------------------------------------ buffers

    def buffer_slot(self, owner: object, address: int, nbytes: int) -> int:
        """The registered-buffer slot of ``owner``'s memory ``[address, address + nbytes)``,
        registering it (in place of a dead or the least recently used one) if needed; ``-1``
        where the kernel refuses registered buffers (the I/O then goes unregistered)."""
        if self.fixed_buffers is None:
            self.fixed_buffers = self._try_sparse_buffers()
        if not self.fixed_buffers or nbytes > MAX_BUFFER_BYTES:
            return -1
        self._uses += 1
        slots = self._buffers
        for i, ref in enumerate(slots):
            if ref is not None and ref() is owner:
                self._buffer_use[i] = self._uses
                return i
        free = [i for i, ref in enumerate(slots) if ref is None or ref() is None]
        i = free[0] if free else min(range(BUFFER_SLOTS), key=self._buffer_use.__getitem__)
        try:
            self._update_buffer(i, address, nbytes)
        except OSError as e:  # ENOMEM: over RLIMIT_MEMLOCK; stop trying on this ring
            self.buffer_refusal = e
            self.fixed_buffers = False
            for j, ref in enumerate(slots):
                if ref is not None:
                    self._update_buffer(j, 0, 0)
                    slots[j] = None
            return -1
        slots[i] = weakref.ref(owner)
        self._buffer_use[i] = self._uses
        return i

    def release_dead_buffers(self) -> None:
        """Unregisters buffers whose owner is gone: the kernel keeps their pages pinned
        until then."""
        for i, ref in enumerate(self._buffers):
            if ref is not None and ref() is None:
                self._update_buffer(i, 0, 0)
                self._buffers[i] = None

    def _try_sparse_buffers(self) -> bool:
        table = np.zeros(1, dtype=_RSRC_REGISTER)
        table["nr"], table["flags"] = BUFFER_SLOTS, _RSRC_REGISTER_SPARSE
        try:
            self._register(_REGISTER_BUFFERS2, table.ctypes.data, table.itemsize, "BUFFERS2")
        except OSError as e:  # before 5.19: no sparse tables
            self.buffer_refusal = e
            return False
        return True

    def _update_buffer(self, slot: int, address: int, nbytes: int) -> None:
        iov = np.zeros(1, dtype=_IOVEC)
        iov["base"], iov["len"] = address, nbytes
        up = np.zeros(1, dtype=_RSRC_UPDATE2)
        up["offset"], up["data"], up["nr"] = slot, iov.ctypes.data, 1
        self._register(_REGISTER_BUFFERS_UPDATE, up.ctypes.data, up.itemsize, "BUFFERS_UPDATE")

    # ----------------------------------------------------------------------------- transfer

    def transfer(
        self,
        fds: int | I64Array,
        write: bool,
        address: int,
        buf_slot: int,
        buf_offsets: I64Array,
        file_offsets: I64Array,
        lengths: I64Array,
        depth: int,
        results: npt.NDArray[np.int32],
    ) -> int:
        """Runs the I/Os ``i``: ``lengths[i]`` bytes between ``fds`` (or ``fds[i]``) at
        ``file_offsets[i]`` and ``address + buf_offsets[i]`` (within registered buffer
        ``buf_slot``, or unregistered for ``-1``), at most ``depth`` in flight; stores each
        I/O's result (bytes moved or ``-errno``) in ``results[i]``. Returns the system calls
        made. Every I/O has completed when it returns or raises."""
        n = int(lengths.size)
        sqes = np.zeros(n, dtype=SQE)
        if buf_slot >= 0:
            sqes["opcode"] = OP_WRITE_FIXED if write else OP_READ_FIXED
            sqes["buf_index"] = buf_slot
        else:
            sqes["opcode"] = OP_WRITE if write else OP_READ
        sqes["fd"] = fds
        sqes["off"] = file_offsets
        sqes["addr"] = address + buf_offsets
        sqes["len"] = lengths
        sqes["user_data"] = np.arange(n, dtype=np.uint64)
        try:
            return self._drive(sqes, min(depth, self.info.sq_entries), results)
        except BaseException:
            self.drain()
            raise

    def _drive(self, sqes: npt.NDArray[Any], depth: int, results: npt.NDArray[np.int32]) -> int:
        call, ring_fd, move = _call(), self.fd, ctypes.memmove
        sq_mask, sq_at, sqes_at = self._sq_mask, self._sqes_at, sqes.ctypes.data
        cq_mask, cq_at = self._cq_mask, self._cqes_at
        sq_tail, cq_head, cq_tail = self._sq_tail, self._cq_head, self._cq_tail
        n = sqes.size
        events = np.empty(n, dtype=CQE)
        events_at = events.ctypes.data
        # Refill the queue in batches and wait for a quarter of it per system call (as the AIO
        # engine does): each io_uring_enter both submits the free slots' I/Os and reaps. Runs of
        # entries are copied in and out whole; the results are scattered once at the end.
        reap = max(1, depth // REAP_DIVISOR)
        tail, head = sq_tail.value, cq_head.value
        queued = completed = pending = calls = 0
        while completed < n:
            room = min(depth - (queued - completed), n - queued)
            if room > 0:
                start = tail & sq_mask
                first = min(room, sq_mask + 1 - start)  # up to the ring's end, then from 0
                move(sq_at + start * 64, sqes_at + queued * 64, first * 64)
                if first < room:
                    move(sq_at, sqes_at + (queued + first) * 64, (room - first) * 64)
                tail = (tail + room) & _U32
                sq_tail.value = tail
                queued += room
                pending += room
            calls += 1
            want = min(reap, queued - completed)
            got = call(_NR_ENTER, ring_fd, pending, want, ENTER_GETEVENTS, 0, 0)
            if got >= 0:
                pending -= got
            else:
                err = ctypes.get_errno()
                if err not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                    raise OSError(err, f"io_uring_enter: {os.strerror(err)}")
            ready = (cq_tail.value - head) & _U32
            if ready:
                start = head & cq_mask
                first = min(ready, cq_mask + 1 - start)
                move(events_at + completed * 16, cq_at + start * 16, first * 16)
                if first < ready:
                    move(events_at + (completed + first) * 16, cq_at, (ready - first) * 16)
                head = (head + ready) & _U32
                cq_head.value = head
                completed += ready
        results[events["user_data"].astype(np.int64)] = events["res"]
        return calls

    def drain(self) -> None:
        """Takes back the I/Os not yet submitted and waits for the others to complete (after
        an error or an interruption), discarding their completions: the ring is idle after."""
        self._sq_tail.value = self._sq_head.value
        call = _call()
        while True:
            self._cq_head.value = self._cq_tail.value
            outstanding = (self._sq_head.value - self._cq_tail.value) & _U32
            if not outstanding:
                return
            if call(_NR_ENTER, self.fd, 0, outstanding, ENTER_GETEVENTS, 0, 0) < 0:
                err = ctypes.get_errno()
                if err not in (errno.EINTR, errno.EAGAIN, errno.EBUSY):
                    raise OSError(err, f"io_uring_enter: {os.strerror(err)}")

    def close(self) -> None:
        """Unmaps the rings and closes the ring (its registered buffers and files with it)."""
        for name in ("_sq_head", "_sq_tail", "_cq_head", "_cq_tail"):
            self.__dict__.pop(name, None)  # they point into the maps
        for m in self._maps:
            m.close()
        self._maps.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
