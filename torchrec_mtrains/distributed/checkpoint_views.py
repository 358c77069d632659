"""Tensors that view a tiered kernel's rows where they live, for checkpoints and optimizers.

TorchRec reads and writes a table's state through tensors (``state_dict``, the fused
optimizer's state, dcp): for a tiered table these view the tier's rows in place (its memory, or
a mapping of its file), never a copy, so a checkpoint streams a table larger than memory chunk
by chunk. The views show the tier, not the cache: flush the group before reading them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from torchrec_mtrains.distributed.tiered_tables import TieredTableShard


class TierViews:
    """Views of the rows of ``shards`` (one kernel's), and writing back what was written
    through them.

    Args:
        shards: the kernel's table shards, in its table order.
        chunk_rows: rows per call when the rows written through a view are stored again.
    """

    def __init__(self, shards: Sequence[TieredTableShard], chunk_rows: int) -> None:
        self._shards = shards
        self._chunk_rows = chunk_rows
        self._mapped: dict[int, np.ndarray[Any, Any]] = {}

    def mapped_rows(self, index: int) -> torch.Tensor:
        """Shard ``index``'s rows on its tier as a ``(rows, row_width)`` tensor viewing the file
        (or the tier's memory), without copying."""
        if index not in self._mapped:
            store = self._shards[index].store
            # Block tiers have no byte-addressable copy (mapped_rows() is None): map the file.
            array = store.mapped_rows()
            if array is None:
                store.flush()
                layout = store.layout
                array = np.memmap(
                    store.path,
                    dtype=layout.dtype.numpy_dtype,
                    mode="r+",
                    offset=store.data_offset,
                    shape=(layout.num_rows, layout.row_width),
                )
            self._mapped[index] = array
        return torch.from_numpy(self._mapped[index])

    def weight_view(self, index: int) -> torch.Tensor:
        """Shard ``index``'s weights on its tier, ``(rows, cols)``."""
        return self.mapped_rows(index)[:, : self._shards[index].cols]

    def state_views(self, index: int) -> dict[str, torch.Tensor]:
        """Optimizer states on the tier, shaped as fbgemm's ``get_optimizer_state()`` would."""
        shard = self._shards[index]
        rows = self.mapped_rows(index)
        out: dict[str, torch.Tensor] = {}
        start = shard.cols
        for key, view, shape in zip(shard.state_keys, shard.state_slots, shard.state_shapes):
            width = view.shape[1]
            part = rows[:, start : start + width]
            out[key] = part.reshape(shard.local_rows, *shape) if shape else part[:, 0]
            start += width
        return out

    def persist_writes(self, index: int | None = None) -> None:
        """Stores the rows of shard ``index`` (all shards when ``None``) again through the store
        API, chunk by chunk, after a checkpoint load wrote them through the views.

        Writes through a tier's ``mapped_rows()`` bypass its bookkeeping; the dram tier, whose
        view is its in-memory copy, would never write them to its file. (A block tier's view
        maps the file itself, so it needs nothing.)"""
        for shard in self._shards if index is None else [self._shards[index]]:
            store = shard.store
            mapped = store.mapped_rows()
            if mapped is None:
                continue
            for start in range(0, store.layout.num_rows, self._chunk_rows):
                store.write_range(start, mapped[start : start + self._chunk_rows])

    def close(self) -> None:
        """Drops the file mappings (before the stores close)."""
        self._mapped.clear()
