"""One table shard of a tiered kernel: its rows on their tier, its cache slots, and where it
lies in the table.

A module of its own, below the group (``tiered_tables``), the tier I/O worker (``tier_io``) and
the checkpoint views (``checkpoint_views``), which all take shards: none of them imports another
for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchrec_mtrains.cache.table_cache import TableCache
from torchrec_mtrains.distributed.virtual_rows import VirtualRows
from torchrec_mtrains.tiers.base import RowStore


@dataclass
class TieredTableShard:
    """One table shard of a tiered kernel.

    Attributes:
        name: the table's name in the model.
        store: the rows (weights + optimizer state) on their tier.
        cache: slot bookkeeping for the cached rows.
        weight_slots: the fused module's weights for this table, ``(cache_rows, cols)``.
        state_slots: the fused module's optimizer states for this table, each
            ``(cache_rows, width)``, in the order fbgemm lists them.
        state_shapes: each state's per-row shape as fbgemm exposes it (``()`` for row-wise).
        row_offset: first global row of this shard (non-zero for row-wise sharding).
        col_offset: first global column (non-zero for column-wise sharding).
        created: whether the store was created now (and so needs initial values).
        virtual: for a virtual table shard, its live ids' rows (made on first use, evicted
            by the table's policy).
    """

    name: str
    store: RowStore
    cache: TableCache
    weight_slots: torch.Tensor
    state_slots: list[torch.Tensor]
    state_keys: list[str]
    state_shapes: list[tuple[int, ...]]
    row_offset: int
    col_offset: int
    created: bool
    virtual: VirtualRows | None = None

    @property
    def local_rows(self) -> int:
        return self.store.layout.num_rows

    @property
    def cols(self) -> int:
        return self.store.layout.dim

    def stats(self) -> dict[str, float]:
        out = self.cache.stats.as_dict()
        out["cache_rows"] = float(self.cache.num_slots)
        out["pinned_rows"] = float(int(self.cache.pinned.sum()))
        out.update({f"tier_{k}": float(v) for k, v in self.store.stats.as_dict().items()})
        if self.virtual is not None:
            out.update(self.virtual.stats())
        return out
