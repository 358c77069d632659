"""The C allocator's settings for a training process: why a step's host tensors can be paged
in afresh every step, and the setting that stops it.

PyTorch takes each CPU tensor's memory from the C library's ``malloc``. glibc's ``malloc`` serves
a request of at least its *mmap threshold* (128 KiB at start, moving by itself up to 32 MiB)
with a mapping of its own, unmapped when freed, and gives free memory at the top of its heap
back to the kernel once it exceeds the *trim threshold*. Either way the next step's tensors are
new pages: a page fault and a page of zeros for each 4 KiB they touch. How much of a step that
hits depends on what the process allocated and freed before, and on the step's largest
tensors, which no threshold covers above 32 MiB. Measured on this project's benchmarks (2-core
VM, docs/benchmarks.md, "Host memory a step"):

* W3's hashed model (A', batch 4,096): 6.6 ms a step with ~2,000 faults in a fresh process,
  2.3 ms after an unrelated model had trained a few steps in it first, 2.0 ms with
  :func:`reuse_freed_memory`: one model, three speeds;
* W1 (batch 8,192, a pooled output of 54 MiB): A's training thread spent 13-18 ms of its ~60
  ms step in the kernel, ~2,500 faults a step; about 1 ms with it, and A ran ~28% faster, the
  tiered model ~20%. The process's peak rose by 6-13% (the heaps keep what they freed).

:func:`reuse_freed_memory` makes every block come from ``malloc``'s heaps (no mapping of its own,
whatever its size) and lets the heap's top keep up to ``trim_threshold`` free bytes, so a step's
tensors reuse the memory the step before freed. What it costs is memory kept mapped: up to
``trim_threshold`` free at the heap's top, and what the heaps' free lists hold between steps.
It is process-wide, so applications choose it, once their model is built (the DLRM app's
``run.malloc_trim_threshold``, the benchmarks' ``--malloc-trim-threshold``), never a module of
the library on its own.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

logger: logging.Logger = logging.getLogger(__name__)

DEFAULT_TRIM_THRESHOLD: int = 256 * 2**20
"""Free bytes the heap's top keeps: above a step's swing of host memory (W1's is ~110 MiB: its
pooled embeddings and their gradient), so the next step finds them mapped."""

MIN_TRIM_THRESHOLD: int = 2**20
MAX_TRIM_THRESHOLD: int = 2**31
"""The trim thresholds :func:`reuse_freed_memory` takes: ``[MIN, MAX)`` bytes (mallopt's is an
int; below 1 MiB the heap would give back most of a step's memory anyway)."""

# mallopt's parameter numbers (<malloc.h>).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


@dataclass(frozen=True)
class MallocSettings:
    """What :func:`reuse_freed_memory` set."""

    trim_threshold: int
    """Free bytes the heap's top keeps before giving memory back to the kernel."""


def reuse_freed_memory(trim_threshold: int = DEFAULT_TRIM_THRESHOLD) -> MallocSettings | None:
    """Sets glibc ``malloc`` so that freed memory is reused rather than handed back to the kernel
    and faulted in again (see the module docstring): ``mallopt(M_MMAP_MAX, 0)``, every block
    from the heaps, and ``mallopt(M_TRIM_THRESHOLD, trim_threshold)``, which also stops glibc
    moving its thresholds by itself. For the blocks allocated from then on: call it once the
    model is built (and restored), so that what building freed went back to the kernel as
    usual. Set from the process's start (``MALLOC_MMAP_MAX_=0``) the heaps also keep the
    holes a build's large transient blocks leave: W1's probe process peaked at 0.99 GiB of
    overhead against 0.49 GiB.

    Args:
        trim_threshold: free bytes the heap's top may keep (at least 1 MiB, below 2 GiB).

    Returns:
        What was set, or ``None`` where the C library is not glibc (nothing changed; logged).

    Raises:
        ValueError: for a threshold out of range, naming it.
    """
    check_trim_threshold(trim_threshold)
    libc = _glibc()
    if libc is None:
        logger.info("malloc settings left as they are: the C library is not glibc")
        return None
    for option, value, name in (
        (_M_MMAP_MAX, 0, "M_MMAP_MAX"),
        (_M_TRIM_THRESHOLD, trim_threshold, "M_TRIM_THRESHOLD"),
    ):
        if libc.mallopt(option, value) != 1:
            raise ValueError(f"glibc refused mallopt({name}, {value})")
    return MallocSettings(trim_threshold)


def check_trim_threshold(trim_threshold: int) -> None:
    """Refuses a trim threshold :func:`reuse_freed_memory` would not take (``ValueError``)."""
    if (
        isinstance(trim_threshold, bool)
        or not isinstance(trim_threshold, int)
        or not MIN_TRIM_THRESHOLD <= trim_threshold < MAX_TRIM_THRESHOLD
    ):
        raise ValueError(
            f"malloc trim threshold {trim_threshold!r}: give bytes in [1MiB, 2GiB) (free memory "
            "the heap keeps between steps)"
        )


def _glibc() -> ctypes.CDLL | None:
    """The process's C library, if it is glibc (the one whose ``mallopt`` this module speaks)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018  (only glibc has it)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return libc
