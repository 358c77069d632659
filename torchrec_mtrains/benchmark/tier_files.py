"""Tier files compared by content: a digest of every row (id and bytes) of a file, whatever
order its store keeps the rows in, so a file rebuilt from a checkpoint can be checked against
the one it replaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from torchrec_mtrains.tiers import FileHeader, open_store
from torchrec_mtrains.tiers.base import FILE_SUFFIX, HEADER_BYTES
from torchrec_mtrains.tiers.log_block_scm import LogBlockSCMStore
from torchrec_mtrains.types import RowLayout

__all__ = ["row_digest", "row_digests"]


def row_digest(path: Path) -> str:
    """A digest of the rows of one tier file (id and bytes of every row), whatever order its
    store keeps them in: read in the store's sequential order, each row's words mixed with its
    id, summed modulo 2**64."""
    with path.open("rb") as f:
        header = FileHeader.unpack(f.read(HEADER_BYTES), path)
    layout = RowLayout(header.num_rows, header.dim, header.state_width, header.dtype)
    table = path.name[: -len(f".{header.tier}{FILE_SUFFIX}")]
    total = np.uint64(0)
    with open_store(header.tier, path.parent, table, layout, mode="open") as store:
        if isinstance(store, LogBlockSCMStore):
            batches: Any = (store.read_scan_batch(b) for b in store.scan_batches())
        else:
            step = max(1, (64 << 20) // layout.row_bytes)
            batches = (
                (
                    np.arange(a, min(a + step, layout.num_rows)),
                    store.read_range(a, min(step, layout.num_rows - a)),
                )
                for a in range(0, layout.num_rows, step)
            )
        weights = None
        for ids, rows in batches:
            words = np.ascontiguousarray(rows).view(np.uint32).astype(np.uint64)
            if weights is None:
                rng = np.random.default_rng(0)
                weights = rng.integers(1, 2**63, size=words.shape[1], dtype=np.uint64) | 1
            with np.errstate(over="ignore"):  # sums modulo 2**64 on purpose
                mixed = (words * weights).sum(axis=1) ^ (ids.astype(np.uint64) * _ID_MIX)
                total += mixed.sum()
    return f"{int(total):016x}"


_ID_MIX = np.uint64(0x9E3779B97F4A7C15)


def row_digests(root: Path) -> dict[str, str]:
    """:func:`row_digest` of every tier file under ``root``, by path relative to it."""
    return {str(p.relative_to(root)): row_digest(p) for p in sorted(root.rglob("*.rows"))}
