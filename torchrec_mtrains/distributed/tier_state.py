"""What saving and loading tiered tables' checkpoints share: the entry keys of saved rows
(``changed_rows::`` and ``tier_rows::``), the regions of memory a tiered shard's view occupies (so
a state dict's tensors can be told apart as tiered rows), and the switches on the views and the
tracking of changed rows."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from torchrec_mtrains._compat.torch_internals import Shard, ShardedTensor
from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup

CHANGED_PREFIX = "changed_rows::"
"""Top-level keys of the entries holding changed rows: ``changed_rows::<path>::<where>::ids``
and ``...::values``, ``<path>`` the tensor's keys in the state dict joined by ``/`` and
``<where>`` the saved shard's ``row:rows:col:cols`` in the tensor's global coordinates."""

ROWS_PREFIX = "tier_rows::"
"""Top-level keys of a log-structured table streamed whole: ``tier_rows::<path>::<where>::<k>::ids``
and ``...::<k>::rows`` for batch ``k`` (whole rows: weights, then optimizer states), and
``tier_rows::<path>::<where>::layout``, which tensor each column range of a row belongs to.
``<path>`` is the table's weights in the state dict, ``<where>`` its shard's weights."""

Where = tuple[int, int, int, int]  # a saved shard's row, rows, col, cols (global)


@contextlib.contextmanager
def deferred_views(groups: Sequence[TieredTableGroup]) -> Iterator[None]:
    """Within the block, reading the state dict (which flushes the caches) exports no copy of
    a log-structured table: for :func:`full_state_dict` / :func:`changed_state_dict`, which
    read such tables from their tiers, and :func:`load_tier_checkpoint`, which writes them."""
    with contextlib.ExitStack() as stack:
        for group in groups:
            stack.enter_context(group.views.deferred())
        yield


def track_changes(groups: Sequence[TieredTableGroup]) -> None:
    """Starts recording changed rows in every group (one byte per row)."""
    for group in groups:
        group.track_changes()


def clear_changes(groups: Sequence[TieredTableGroup]) -> None:
    """Marks every row of every group unchanged (after a checkpoint, or a load)."""
    for group in groups:
        group.clear_changes()


# --------------------------------------------------------------- which tensors are tiered


@dataclass(frozen=True)
class TierRegion:
    """The memory of one tiered shard's view (weights + optimizer state, row after row), and
    whether that view is a copy of a log-structured tier."""

    group: TieredTableGroup
    index: int
    start: int  # address of row 0
    end: int
    row_bytes: int
    copy: bool

    @property
    def shard(self) -> TieredTableShard:
        return self.group.shards[self.index]

    def column(self, view: torch.Tensor) -> int:
        """The first row value (``0 .. row_width``: weights, then optimizer state) a view of
        this region shows."""
        offset = (view.data_ptr() - self.start) % self.row_bytes
        return self.shard.store.layout.column_at(offset)

    def first_row(self, view: torch.Tensor) -> int:
        return (view.data_ptr() - self.start) // self.row_bytes


def tier_regions(groups: Sequence[TieredTableGroup]) -> list[TierRegion]:
    regions = []
    for group in groups:
        for index in range(len(group.shards)):
            rows = group.views.tier_rows(index)
            start = rows.ctypes.data
            regions.append(
                TierRegion(
                    group,
                    index,
                    start,
                    start + rows.nbytes,
                    rows.strides[0],
                    group.views.is_copy(index),
                )
            )
    return regions


def region_of(tensor: torch.Tensor, regions: Sequence[TierRegion]) -> TierRegion | None:
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    ptr = tensor.data_ptr()
    for region in regions:
        if region.start <= ptr < region.end:
            return region
    return None


def tiered_shards(
    value: Any, regions: Sequence[TierRegion]
) -> list[tuple[Shard, TierRegion]] | None:
    """The local shards of a sharded tensor viewing tiered rows, with their regions; ``None``
    for any other value (kept whole)."""
    if not isinstance(value, ShardedTensor) or not value.local_shards():
        return None
    found = [(s, region_of(s.tensor, regions)) for s in value.local_shards()]
    if any(region is None for _, region in found):
        return None
    return [(s, r) for s, r in found if r is not None]


def shard_where(shard: Shard) -> Where:
    """A shard's ``(row, rows, col, cols)`` in its tensor's global coordinates (``col`` 0 and
    ``cols`` 1 for a 1-D tensor, a row-wise optimizer state)."""
    offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
    if len(offsets) == 1:
        return int(offsets[0]), int(sizes[0]), 0, 1
    return int(offsets[0]), int(sizes[0]), int(offsets[1]), int(sizes[1])


def entry_key(prefix: str, path: str, where: Where, part: str) -> str:
    return f"{prefix}{path}::{':'.join(map(str, where))}::{part}"


def parse_entry_key(prefix: str, key: str) -> tuple[str, Where, str]:
    path, where, part = key[len(prefix) :].split("::", 2)
    row, rows, col, cols = (int(x) for x in where.split(":"))
    return path, (row, rows, col, cols), part


def walk_state(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every leaf of a nested state dict, paths joined by ``/``."""
    for key, value in state.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from walk_state(value, path)
        else:
            yield path, value
