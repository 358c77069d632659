"""W1's variant B: what a user tries first for tables larger than memory. TorchRec's sharder and
FUSED kernel (one fbgemm TBE for all 26 tables) whose host weights and row-wise momentum are
shared memory mappings of files (``mmap(MAP_SHARED)`` handed to fbgemm as
``preallocated_host_buffers``), paged by the OS.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder

from apps.dlrm.workloads.w1 import STATE_WIDTH, Built, Workload, fused_params, fused_tbes, shard
from torchrec_mtrains.benchmark.measure import drop_file_cache

__all__ = ["B_MOMENTUM", "B_WEIGHTS", "build_mmap", "init_mmap_files", "verify_mapping"]


class _HashableBuffers(dict[str, torch.Tensor]):
    """fbgemm's ``preallocated_host_buffers`` as a fused parameter that survives TorchRec:
    TorchRec deep-copies fused parameters per table (``merge_fused_params``), which would copy
    the mapped files into anonymous memory, and groups tables by a hash of them. So copies are
    the object itself and the hash is its identity."""

    __hash__ = object.__hash__  # type: ignore[assignment]

    def __deepcopy__(self, memo: dict[int, Any]) -> _HashableBuffers:
        return self

    def __copy__(self) -> _HashableBuffers:
        return self


B_WEIGHTS = "weights.f32"


B_MOMENTUM = "momentum1.f32"


def init_mmap_files(wl: Workload, directory: Path) -> list[Path]:
    """Writes B's two files once, before any capped run: the weights of all tables back to back
    in table order (the layout of the single fused TBE), each table's rows as every variant
    initializes them (:meth:`Workload.table_init`), and the row-wise momentum as zeros. Every
    byte is written (a fault on a hole of a sparse file would read nothing from disk), then
    the files are evicted from the page cache."""
    directory.mkdir(parents=True, exist_ok=True)
    chunk = max(1, (64 << 20) // (wl.dim * 4))
    weights, momentum = directory / B_WEIGHTS, directory / B_MOMENTUM
    with open(weights, "wb") as f:
        for table, rows in enumerate(wl.sizes):
            init = wl.table_init(table, rows)
            for start in range(0, rows, chunk):
                block = torch.empty(min(chunk, rows - start), wl.dim)
                init.fill(block, start)
                f.write(block.numpy().tobytes())
    zeros = np.zeros(chunk * wl.dim, dtype=np.float32).tobytes()
    left = sum(wl.sizes) * STATE_WIDTH * 4
    with open(momentum, "wb") as f:
        while left:
            n = min(left, len(zeros))
            f.write(zeros[:n])
            left -= n
    drop_file_cache([weights, momentum])
    return [weights, momentum]


def _map_file(path: Path, nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """A float32 tensor over a shared, writable mapping of ``path`` (``nbytes`` long)."""
    if path.stat().st_size != nbytes:
        raise ValueError(f"{path}: {path.stat().st_size} bytes, expected {nbytes}")
    fd = os.open(path, os.O_RDWR)
    try:
        mapping = mmap.mmap(
            fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE
        )
    finally:
        os.close(fd)
    return mapping, torch.frombuffer(mapping, dtype=torch.float32)


@contextlib.contextmanager
def _skip_torchrec_init() -> Iterator[None]:
    """TorchRec initializes FUSED tables twice while sharding (the kernel's
    ``init_parameters`` and the sharded collection's ``reset_parameters``); on B's mappings
    each pass writes every row through the page cache of the capped process. B's files hold
    that initialization already, so both are skipped while B is built."""
    from torchrec.distributed.batched_embedding_kernel import BatchedFusedEmbeddingBag
    from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection

    saved = (
        BatchedFusedEmbeddingBag.init_parameters,
        ShardedEmbeddingBagCollection.reset_parameters,
    )
    BatchedFusedEmbeddingBag.init_parameters = lambda self: None
    ShardedEmbeddingBagCollection.reset_parameters = lambda self: None
    try:
        yield
    finally:
        (
            BatchedFusedEmbeddingBag.init_parameters,
            ShardedEmbeddingBagCollection.reset_parameters,
        ) = saved


def build_mmap(wl: Workload, directory: Path, advice: str) -> Built:
    """B: TorchRec's FUSED kernel (one fbgemm TBE for all 26 tables) whose host weights and
    row-wise momentum are shared mappings of the files :func:`init_mmap_files` wrote, handed
    to fbgemm's TBE constructor as ``preallocated_host_buffers``.

    TorchRec would initialize the weights again while sharding, writing all of them through
    the mapping inside the capped process (minutes of dirty-page write-back under the cap);
    the files already hold that initialization, so those passes are skipped here
    (:func:`_skip_torchrec_init`), and the TBE's table layout is checked against the files'."""
    rows = sum(wl.sizes)
    weights_path, momentum_path = directory / B_WEIGHTS, directory / B_MOMENTUM
    w_map, weights = _map_file(weights_path, rows * wl.dim * 4)
    m_map, momentum = _map_file(momentum_path, rows * STATE_WIDTH * 4)
    if advice == "random":
        for m in (w_map, m_map):
            m.madvise(mmap.MADV_RANDOM)
    params = fused_params()
    params["preallocated_host_buffers"] = _HashableBuffers(weights=weights, momentum1=momentum)
    sharder = EmbeddingBagCollectionSharder(fused_params=params)
    with _skip_torchrec_init():
        model, dense = shard(wl, wl.sizes, sharder, None)
    tbes = fused_tbes(model)
    if len(tbes) != 1:
        raise RuntimeError(f"expected one fused TBE for all tables, found {len(tbes)}")
    tbe = tbes[0]
    expected = [sum(wl.sizes[:t]) * wl.dim for t in range(len(wl.sizes))]
    if tbe.weights_offsets.tolist() != expected:
        raise RuntimeError("the fused TBE orders its tables unlike the files; cannot reuse them")
    on_mapping = (
        tbe.weights_host.data_ptr() == weights.data_ptr()
        and tbe.momentum1_host.data_ptr() == momentum.data_ptr()
    )
    return Built(
        model,
        dense,
        files=[weights_path, momentum_path],
        plan_text=(
            f"every table on TorchRec's FUSED kernel; weights and momentum mmap'd from "
            f"{weights_path.name} ({weights_path.stat().st_size / 2**30:.2f} GiB) and "
            f"{momentum_path.name} (madvise {advice})"
        ),
        info={"tbe_weights_are_the_mapping": on_mapping, "madvise": advice},
        mappings=[w_map, m_map],
    )


def verify_mapping(built: Built, wl: Workload, batch: Batch) -> dict[str, Any]:
    """Checks that B trained on the files: the TBE's tensors are the mappings, and rows the
    last batch updated read back from the weight file (``pread``, not the mapping) equal the
    kernel's values for them."""
    tbe = fused_tbes(built.model)[0]
    weights = tbe.split_embedding_weights()
    offsets = tbe.weights_offsets.tolist()
    kjt = batch.sparse_features
    checked, equal = 0, True
    fd = os.open(built.files[0], os.O_RDONLY)
    try:
        for t in (int(np.argmax(wl.sizes)), 0):
            ids = kjt[f"cat_{t}"].values()[:8].tolist()
            for row in ids:
                raw = os.pread(fd, wl.dim * 4, (offsets[t] + row * wl.dim) * 4)
                on_file = torch.frombuffer(bytearray(raw), dtype=torch.float32)
                equal &= bool(torch.equal(on_file, weights[t][row]))
                checked += 1
    finally:
        os.close(fd)
    return {
        "tbe_weights_are_the_mapping": built.info["tbe_weights_are_the_mapping"],
        "rows_checked_on_file": checked,
        "file_rows_equal_kernel_rows": equal,
    }
