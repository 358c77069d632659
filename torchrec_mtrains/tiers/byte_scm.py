"""The byte-addressable SCM tier: rows in a memory-mapped file, read and written by loads and
stores.

One backend covers the three byte-addressable media:

* persistent memory on a DAX file system: the mapping reaches the media directly; on a DAX
  mount the file is mapped ``MAP_SHARED_VALIDATE | MAP_SYNC`` so that after ``msync`` nothing
  (data or file metadata) is left in a volatile cache of the file system;
* CXL-attached memory, which Linux shows as a CPU-less NUMA node: ``numa_node`` binds the
  mapping's pages to that node with ``mbind(2)``. The kernel honours the policy for shared
  mappings of tmpfs/shmem files (put the directory on a tmpfs); for page-cache files of disk file
  systems it ignores it;
* any ordinary file system, where it is a page-cache-backed mapping.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt

from torchrec_mtrains.tiers import _linux
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
from torchrec_mtrains.tiers.options import ByteScmOptions, TierOptions
from torchrec_mtrains.tiers.registry import register_tier
from torchrec_mtrains.types import RowLayout

logger: logging.Logger = logging.getLogger(__name__)


@register_tier
class ByteSCMStore(RowStore):
    """Rows in a shared memory mapping of the tier's file; :meth:`flush` is ``msync``.

    Args:
        directory: existing, writable directory for the file (a DAX mount for PMem, a tmpfs
            for CXL memory bound with ``numa_node``, or any file system).
        table: table (or shard) name.
        layout: shape of the rows.
        mode: what to do with an existing file (see :class:`OpenMode`).
        options: NUMA binding and ``MAP_SYNC`` (:class:`ByteScmOptions`; defaults if ``None``).

    Example::

        store = ByteSCMStore("/mnt/pmem0/run1", "t_user", RowLayout(10_000_000, 64, 1))
        rows = store.read_rows(np.array([5, 9]))
        store.flush()  # msync: written rows are durable
    """

    name: ClassVar[str] = "byte_scm"
    options_type: ClassVar[type[TierOptions]] = ByteScmOptions
    options: ByteScmOptions

    def __init__(
        self,
        directory: str | os.PathLike[str],
        table: str,
        layout: RowLayout,
        *,
        mode: OpenMode | str = OpenMode.OPEN_OR_CREATE,
        options: ByteScmOptions | None = None,
    ) -> None:
        super().__init__(directory, table, layout, mode=mode, options=options)
        numa_node, map_sync = self.options.numa_node, self.options.map_sync
        if numa_node is not None:
            _check_node(numa_node)
        self._sparse_create = not self.options.preallocate
        self._prepare_file(DATA_OFFSET)
        self.numa_node = numa_node
        size = self.data_offset + layout.total_bytes
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise self._os_error(e, "opening") from e
        try:
            self._mmap, self.map_sync = self._map(fd, size, map_sync)
        finally:
            os.close(fd)  # the mapping keeps its own reference to the file
        self._rows: npt.NDArray[Any] = np.frombuffer(
            self._mmap,
            dtype=layout.word_dtype,
            count=layout.num_rows * layout.row_words,
            offset=self.data_offset,
        ).reshape(layout.num_rows, layout.row_words)
        if numa_node is not None:
            self._bind(numa_node, size)

    def allocate(self) -> None:
        """Allocates every block of the file (a no-op for blocks that are): before filling a
        file made with ``preallocate=False``, so a full device fails here, naming the file.

        Raises:
            RowStoreError: the device has no room (or another error allocating)."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as e:
            raise self._os_error(e, "opening") from e
        try:
            os.posix_fallocate(fd, 0, self.data_offset + self.layout.total_bytes)
        except OSError as e:
            raise self._os_error(e, "allocating its blocks") from e
        finally:
            os.close(fd)

    def _map(self, fd: int, size: int, map_sync: bool | None) -> tuple[mmap.mmap, bool]:
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        want_sync = map_sync if map_sync is not None else _linux.is_dax_mount(self.directory)
        if want_sync:
            try:
                flags = _linux.MAP_SHARED_VALIDATE | _linux.MAP_SYNC
                return mmap.mmap(fd, size, flags=flags, prot=prot), True
            except OSError as e:
                if map_sync:
                    raise RowStoreError(
                        f"{self.path}: MAP_SYNC mapping refused ({e.strerror}); the file must be "
                        "on a DAX file system over persistent memory"
                    ) from e
                # dax=inode mounts map only flagged files with DAX; others refuse MAP_SYNC.
                logger.info("%s: MAP_SYNC refused (%s), using MAP_SHARED", self.path, e.strerror)
        try:
            return mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot), False
        except OSError as e:
            raise self._os_error(e, "memory-mapping") from e

    def _bind(self, node: int, size: int) -> None:
        address = self._rows.ctypes.data - self.data_offset  # the mapping's (page-aligned) start
        try:
            _linux.mbind_to_node(address, size, node)
        except OSError as e:
            self._release()
            raise RowStoreError(
                f"{self.path}: cannot bind the mapping to NUMA node {node}: {e.strerror}"
            ) from e
        logger.debug("%s: mapping bound to NUMA node %d", self.path, node)

    def mapped_rows(self) -> npt.NDArray[Any]:
        """The ``(num_rows, row_words)`` view of the mapping (stored words); stores through it
        reach the file (durable after :meth:`flush`)."""
        return self._rows

    def _read_rows(self, ids: IdArray, out: RowArray) -> tuple[int, int]:
        gather_rows(self._rows, ids, out, self.layout)
        return ids.size * self.layout.row_bytes, 0

    def _write_rows(self, ids: IdArray, rows: RowArray) -> tuple[int, int]:
        scatter_rows(self._rows, ids, rows, self.layout)
        return ids.size * self.layout.row_bytes, 0

    def _flush(self) -> int:
        try:
            self._mmap.flush()
        except OSError as e:
            raise self._os_error(e, "msync") from e
        return 1

    def _close(self) -> None:
        self._release()

    def _release(self) -> None:
        del self._rows
        try:
            self._mmap.close()
        except BufferError:
            # Views from mapped_rows() are still alive; the mapping goes when the last one does,
            # which is safer than unmapping memory someone may still read.
            logger.debug("%s: mapping still referenced, left to the garbage collector", self.path)


def _check_node(node: int) -> None:
    nodes = _linux.numa_nodes()
    if node not in nodes:
        raise RowStoreError(
            f"NUMA node {node} does not exist (nodes under {_linux.NODE_DIR}: "
            f"{', '.join(map(str, nodes)) or 'none'})"
        )
    if _linux.syscall_number("mbind") is None:
        raise RowStoreError(
            f"binding to a NUMA node needs mbind(2), unsupported on this platform "
            f"({os.uname().machine})"
        )
