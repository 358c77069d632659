"""The disk's random 4 KiB read rate under a directory: what bounds a block tier's misses.

fio measures it where it is installed (:func:`~torchrec_mtrains.benchmark.fio.run_fio`). Where
it is not (a GPU host without network, say), the same job runs through the block tier's own
I/O engine (the one its stores open with: io_uring where the kernel offers it, else native AIO):
O_DIRECT reads of random aligned blocks of a scratch file written first
(a sparse file would read as zeros without touching the device), ``queue_depth`` in flight.
Either way the figure is the device's, not a store's: no index, cache or row copy runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from torchrec_mtrains.benchmark.fio import run_fio
from torchrec_mtrains.tiers._blockio import AlignedBuffer, make_engine, open_block_file
from torchrec_mtrains.tiers.options import IOEngineKind

__all__ = ["random_read_iops"]

BLOCK = 4096
_CALL_READS = 4096  # reads handed to the engine per call: its queue stays full between calls


def random_read_iops(
    directory: Path, size_bytes: int, seconds: float, queue_depth: int = 32
) -> dict[str, float | str]:
    """Random 4 KiB reads a second over a ``size_bytes`` file in ``directory``:
    ``{"iops", "source"}`` (``fio``, or the tier's engine that ran it: ``uring``, ``aio`` or
    ``threads``), plus ``lat_us`` from fio. The scratch file is removed afterwards."""
    directory.mkdir(parents=True, exist_ok=True)
    fio = run_fio(directory, max(1, round(seconds)), str(size_bytes))
    if fio is not None:
        return {"iops": fio["iops"], "lat_us": fio["lat_us"], "source": "fio"}
    iops, engine = _engine_iops(directory, size_bytes, seconds, queue_depth)
    return {"iops": iops, "source": engine}


def _engine_iops(
    directory: Path, size_bytes: int, seconds: float, queue_depth: int
) -> tuple[float, str]:
    blocks = max(1, size_bytes // BLOCK)
    path = directory / "random_read_probe.bin"
    rng = np.random.default_rng(0)
    try:
        with open(path, "wb") as f:
            chunk = rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
            for _ in range(-(-blocks * BLOCK // len(chunk))):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        fd, direct = open_block_file(path, BLOCK, 0, True, "probe")
        engine = make_engine(IOEngineKind.AUTO, queue_depth, direct)
        buf = AlignedBuffer(_CALL_READS * BLOCK)
        buf_offsets = np.arange(_CALL_READS, dtype=np.int64) * BLOCK
        lengths = np.full(_CALL_READS, BLOCK, dtype=np.int64)
        try:
            if not direct:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            done, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                offsets = rng.integers(0, blocks, _CALL_READS, dtype=np.int64) * BLOCK
                engine.run(fd, False, buf, buf_offsets, offsets, lengths)
                done += _CALL_READS
            return done / (time.perf_counter() - t0), engine.kind.value
        finally:
            engine.close()
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
