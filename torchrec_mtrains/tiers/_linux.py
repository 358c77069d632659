"""Thin ctypes access to the Linux calls the tiers need and the C library does not wrap.

glibc exports ``syscall(2)`` but neither ``mbind``/``get_mempolicy`` (those live in libnuma) nor
the native AIO calls (libaio), so both are issued as raw system calls by number. Only 64-bit
little-endian Linux is supported (x86_64, aarch64); elsewhere :func:`syscall_number` returns
``None`` and callers fall back or raise a clear error.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
from collections.abc import Callable
from functools import cache
from pathlib import Path

logger: logging.Logger = logging.getLogger(__name__)

# Syscall numbers are per architecture; aarch64 uses the generic table.
_SYSCALLS: dict[str, dict[str, int]] = {
    "x86_64": {
        "io_setup": 206,
        "io_destroy": 207,
        "io_getevents": 208,
        "io_submit": 209,
        "mbind": 237,
        "get_mempolicy": 239,
    },
    "aarch64": {
        "io_setup": 0,
        "io_destroy": 1,
        "io_submit": 2,
        "io_getevents": 4,
        "mbind": 235,
        "get_mempolicy": 236,
    },
}

MPOL_BIND = 2
MPOL_MF_MOVE = 1 << 1
MPOL_F_NODE = 1 << 0
MPOL_F_ADDR = 1 << 1

# Not exported by Python's mmap module before 3.13; the values are the same on all Linux ABIs.
MAP_SHARED_VALIDATE = 0x03
MAP_SYNC = 0x80000

NODE_DIR = Path("/sys/devices/system/node")

_SyscallFn = Callable[..., int]


def syscall_number(name: str) -> int | None:
    """The number of system call ``name`` on this machine, or ``None`` if unknown here."""
    if os.uname().sysname != "Linux":
        return None
    return _SYSCALLS.get(platform.machine(), {}).get(name)


@cache
def _syscall() -> _SyscallFn:
    # A fixed six-long prototype: passing Python ints through it is cheaper than building
    # ctypes objects per call, which matters for the per-I/O submit path. ctypes releases the
    # GIL for the duration of the call, so blocking calls do not stall other threads.
    proto = ctypes.CFUNCTYPE(
        ctypes.c_long, *([ctypes.c_long] * 7), use_errno=True
    )  # nr + up to six arguments
    return proto(("syscall", ctypes.CDLL(None, use_errno=True)))


def raw_syscall(name: str, *args: int) -> int:
    """Issues system call ``name``; returns its result or raises ``OSError`` with its errno."""
    nr = syscall_number(name)
    if nr is None:
        raise OSError(errno.ENOSYS, f"{name} is not available on {platform.machine()}")
    padded = list(args) + [0] * (6 - len(args))
    while True:
        result = int(_syscall()(nr, *padded))
        if result >= 0:
            return result
        err = ctypes.get_errno()
        if err != errno.EINTR:
            raise OSError(err, f"{name}: {os.strerror(err)}")


def syscall_fn() -> tuple[_SyscallFn, int, int, int, int]:
    """The raw syscall function and the AIO call numbers, for hot loops that check errno
    themselves. Raises ``OSError(ENOSYS)`` where native AIO is not known to this module."""
    numbers = [syscall_number(n) for n in ("io_setup", "io_destroy", "io_submit", "io_getevents")]
    if any(n is None for n in numbers):
        raise OSError(errno.ENOSYS, f"native AIO is not supported on {platform.machine()}")
    setup, destroy, submit, getevents = (int(n) for n in numbers if n is not None)
    return _syscall(), setup, destroy, submit, getevents


# ----------------------------------------------------------------------------------- NUMA


def numa_nodes() -> list[int]:
    """Ids of the NUMA nodes the kernel exposes (CXL memory appears as a CPU-less node)."""
    if not NODE_DIR.is_dir():
        return []
    return sorted(int(p.name[4:]) for p in NODE_DIR.glob("node[0-9]*") if p.name[4:].isdigit())


def _nodemask(node: int) -> tuple[ctypes.Array[ctypes.c_ulong], int]:
    bits = ctypes.sizeof(ctypes.c_ulong) * 8
    words = node // bits + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // bits] = 1 << (node % bits)
    return mask, words * bits


def mbind_to_node(address: int, length: int, node: int) -> None:
    """Binds the pages of ``[address, address+length)`` to NUMA ``node`` (MPOL_BIND), moving
    pages already resident elsewhere. ``address`` must be page-aligned."""
    mask, maxnode = _nodemask(node)
    # The kernel reads one bit fewer than maxnode says (libnuma passes maxnode + 1 too).
    raw_syscall(
        "mbind", address, length, MPOL_BIND, ctypes.addressof(mask), maxnode + 1, MPOL_MF_MOVE
    )


def node_of_address(address: int) -> int:
    """The NUMA node holding the (resident) page at ``address``; touch the page first."""
    node = ctypes.c_int(-1)
    raw_syscall("get_mempolicy", ctypes.addressof(node), 0, 0, address, MPOL_F_NODE | MPOL_F_ADDR)
    return node.value


# ----------------------------------------------------------------------------------- mounts


def _unescape_mount_field(field: str) -> str:
    # /proc/mounts escapes space, tab, newline and backslash as octal (\040 ...).
    out, i = [], 0
    while i < len(field):
        code = field[i + 1 : i + 4]
        if field[i] == "\\" and len(code) == 3 and all(c in "01234567" for c in code):
            out.append(chr(int(code, 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_of(path: Path, mounts_file: Path = Path("/proc/mounts")) -> tuple[str, str, set[str]]:
    """``(mount point, fs type, options)`` of the mount holding ``path`` (longest prefix)."""
    target = os.path.realpath(path)
    best: tuple[str, str, set[str]] = ("/", "", set())
    best_len = -1
    try:
        lines = mounts_file.read_text().splitlines()
    except OSError as e:
        logger.debug("cannot read %s: %s", mounts_file, e)
        return best
    for line in lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        point = _unescape_mount_field(parts[1])
        prefix = point.rstrip("/") + "/"
        if (target == point or target.startswith(prefix)) and len(point) >= best_len:
            best, best_len = (point, parts[2], set(parts[3].split(","))), len(point)
    return best


def is_dax_mount(path: Path, mounts_file: Path = Path("/proc/mounts")) -> bool:
    """Whether ``path`` lies on a file system mounted with DAX (``dax``, ``dax=always`` or
    ``dax=inode``; ``dax=never`` does not count)."""
    _, _, options = mount_of(path, mounts_file)
    return any(o == "dax" or (o.startswith("dax=") and o != "dax=never") for o in options)


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(None)
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> None:
    """Returns the C heap's freed memory to the system (glibc's ``malloc_trim``).

    Bulk work (a table's initialization, a checkpoint load) allocates and frees many arrays of
    tens of MiB; once glibc has raised its mmap threshold past them they come from the heap,
    which keeps them after they are freed: on W1 at a 5% budget, 113 MiB stayed resident after
    the tables were initialized, memory the plan does not count. A no-op where the C library
    has no ``malloc_trim``."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
