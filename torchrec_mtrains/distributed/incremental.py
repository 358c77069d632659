"""Incremental checkpoints: after a full one, write only the tiered rows training changed.

Check-N-Run (Eisenman et al., NSDI 2022) observed that between two checkpoints of a
recommendation model training touches a small share of its embedding rows, and cut checkpoint
size by writing only those. A tiered table knows which rows changed: every row a training batch
makes resident is marked (see :meth:`TieredTableGroup.track_changes`).

:func:`changed_state_dict` turns a model's (or optimizer's) state dict into one for
``torch.distributed.checkpoint`` in which every sharded tensor backed by tiered rows is replaced,
per local shard, by two entries: the global row ids that changed and their values (weights or
optimizer state), gathered only when dcp writes them. Every other tensor (dense parameters,
TorchRec's own tables) is kept whole. Changed rows are scattered over a table (ids are hashed),
so row ids and values, not row ranges, keep such a checkpoint proportional to what changed.

:func:`apply_changed_rows` loads such a checkpoint over the state the checkpoints before it
left: each rank reads the entries overlapping its own shards, by global row and column, so a
chain of checkpoints loads under any plan or world size, as dcp's own resharding does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from torchrec_mtrains.distributed.tier_io import HOST
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup, TieredTableShard

CHANGED_PREFIX = "changed_rows::"
"""Top-level keys of the entries holding changed rows: ``changed_rows::<path>::<where>::ids``
and ``...::values``, ``<path>`` the tensor's keys in the state dict joined by ``/`` and
``<where>`` the saved shard's ``row:rows:col:cols`` in the tensor's global coordinates."""

LOAD_BATCH_BYTES = 256 * 2**20
"""Changed rows read per dcp load while applying a checkpoint: bounds the memory it takes."""


@dataclass(frozen=True)
class _TierRegion:
    """The memory of one tiered shard's rows (weights + optimizer state, row after row) and
    which of its rows changed."""

    shard: TieredTableShard
    start: int  # address of row 0
    end: int
    row_bytes: int
    changed: torch.Tensor  # bool per local row


def _regions(groups: Sequence[TieredTableGroup]) -> list[_TierRegion]:
    regions = []
    for group in groups:
        for index, shard in enumerate(group.shards):
            changed = group.changed_rows(index)
            if changed is None:
                raise ValueError(
                    f"table {shard.name!r}: its changed rows are not tracked; call "
                    "track_changes() on its group before training, or save a full checkpoint"
                )
            rows = group.views.mapped_rows(index)
            start = rows.data_ptr()
            end = start + rows.numel() * rows.element_size()
            row_bytes = rows.stride(0) * rows.element_size()
            regions.append(_TierRegion(shard, start, end, row_bytes, changed))
    return regions


def _region_of(tensor: torch.Tensor, regions: Sequence[_TierRegion]) -> _TierRegion | None:
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    ptr = tensor.data_ptr()
    for region in regions:
        if region.start <= ptr < region.end:
            return region
    return None


def _where(shard: Shard) -> tuple[int, int, int, int]:
    """A shard's ``(row, rows, col, cols)`` in its tensor's global coordinates (``col`` 0 and
    ``cols`` 1 for a 1-D tensor, a row-wise optimizer state)."""
    offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
    if len(offsets) == 1:
        return int(offsets[0]), int(sizes[0]), 0, 1
    return int(offsets[0]), int(sizes[0]), int(offsets[1]), int(sizes[1])


def _key(path: str, where: tuple[int, int, int, int], part: str) -> str:
    return f"{CHANGED_PREFIX}{path}::{':'.join(map(str, where))}::{part}"


def _parse_key(key: str) -> tuple[str, tuple[int, int, int, int], str]:
    path, where, part = key[len(CHANGED_PREFIX) :].rsplit("::", 2)
    row, rows, col, cols = (int(x) for x in where.split(":"))
    return path, (row, rows, col, cols), part


def _walk(state: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, value)`` of every leaf of a nested state dict, paths joined by ``/``."""
    for key, value in state.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            yield from _walk(value, path)
        else:
            yield path, value


class ChangedRowsSavePlanner(DefaultSavePlanner):
    """dcp's default save planner, which gathers the values of changed rows (a copy of each
    local shard's changed rows) only as it writes them, so a save holds a few shards' worth of
    rows in memory, not every changed row at once."""

    def __init__(self, gathers: Mapping[str, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self._gathers = dict(gathers)

    def lookup_object(self, index: MetadataIndex) -> Any:
        gather = self._gathers.get(index.fqn)
        return gather() if gather is not None else super().lookup_object(index)


@dataclass(frozen=True)
class ChangedState:
    """What :func:`changed_state_dict` returns: the state dict to save and its planner."""

    state: dict[str, Any]
    planner: ChangedRowsSavePlanner
    rows: int  # rows of this rank's tiered shards that changed


def changed_state_dict(
    state: Mapping[str, Any], groups: Sequence[TieredTableGroup]
) -> ChangedState:
    """The dcp state dict of an incremental checkpoint: ``state`` (a nested state dict of
    model and optimizer) with each sharded tensor whose shards view tiered rows of ``groups``
    replaced by the ids and values of its rows changed since the groups' last
    ``clear_changes()``. Save it with the returned planner.

    Raises:
        ValueError: naming a table whose changes are not tracked.
    """
    regions = _regions(groups)
    found_chunks: list[tuple[int, int, str, Shard, _TierRegion]] = []

    def narrow(value: Any, path: str) -> Any:
        if isinstance(value, Mapping):
            return {k: narrow(v, f"{path}/{k}" if path else str(k)) for k, v in value.items()}
        if not isinstance(value, ShardedTensor) or not value.local_shards():
            return value
        found = [(s, _region_of(s.tensor, regions)) for s in value.local_shards()]
        if any(region is None for _, region in found):
            return value  # not tiered: kept whole
        for shard, region in found:
            assert region is not None
            first = (shard.tensor.data_ptr() - region.start) // region.row_bytes
            found_chunks.append((regions.index(region), first, path, shard, region))
        return None

    pruned = _prune(narrow(state, ""))
    # Chunk by chunk (a chunk's weights, then its optimizer states): dcp writes entries in
    # this order, so the rows a chunk reads from its tier serve all of its tensors.
    found_chunks.sort(key=lambda chunk: chunk[:2])
    reads = _ChunkReads()
    gathers: dict[str, Callable[[], torch.Tensor]] = {}
    for _, first, path, shard, region in found_chunks:
        size = int(shard.metadata.shard_sizes[0])
        local = torch.nonzero(region.changed[first : first + size]).flatten()
        if local.numel() == 0:
            continue
        where = _where(shard)
        pruned[_key(path, where, "ids")] = local + where[0]
        values = _key(path, where, "values")
        shape = (int(local.numel()), *shard.tensor.shape[1:])
        # A stand-in of the right shape and type for planning; the planner gathers.
        pruned[values] = torch.zeros((), dtype=shard.tensor.dtype).expand(shape)
        gathers[values] = _RowGather(region, shard.tensor, first, local, reads)
    rows = sum(int(region.changed.sum()) for region in regions)
    return ChangedState(pruned, ChangedRowsSavePlanner(gathers), rows)


class _ChunkReads:
    """The rows one chunk last read from its tier, for the chunk's other tensors: a row holds
    the weights and every optimizer state, and a tier reads it whole."""

    def __init__(self) -> None:
        self._store: object | None = None
        self._ids = torch.empty(0, dtype=torch.int64)
        self._rows: np.ndarray[Any, Any] | None = None

    def read(self, shard: TieredTableShard, ids: torch.Tensor) -> np.ndarray[Any, Any]:
        """The tier rows of the shard's local ``ids``, read once for consecutive callers."""
        if self._rows is None or self._store is not shard.store or not torch.equal(self._ids, ids):
            self._store, self._ids = shard.store, ids
            self._rows = shard.store.read_rows(ids.numpy())
        return self._rows


class _RowGather:
    """The current values of some rows of one tiered tensor (a shard's weights, or one of its
    optimizer states), read when dcp writes them: from the cache where the row is resident
    (most changed rows are: training just used them), else from the tier in one batched read.
    Reading them through the tier's mapping instead would fault them in one page at a time."""

    def __init__(
        self,
        region: _TierRegion,
        view: torch.Tensor,
        first: int,
        local: torch.Tensor,
        reads: _ChunkReads,
    ) -> None:
        self.shard = region.shard
        self.rows = local + first  # the shard's local rows
        self.reads = reads
        self.one_d = view.dim() == 1
        column = (view.data_ptr() - region.start) % region.row_bytes // view.element_size()
        self.columns = slice(column, column + (1 if self.one_d else int(view.shape[1])))
        self.dtype = view.dtype
        self.cached = self._cache_tensor(column)

    def _cache_tensor(self, column: int) -> torch.Tensor:
        """The cache tensor holding this view's columns: the weights, or one state."""
        if column == 0:
            return self.shard.weight_slots
        start = self.shard.cols
        for state in self.shard.state_slots:
            if column == start:
                return state
            start += int(state.shape[1])
        raise ValueError(f"table {self.shard.name!r}: no cached tensor at row column {column}")

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        out = torch.empty(len(self.rows), self.columns.stop - self.columns.start, dtype=self.dtype)
        slots = self.shard.cache.lookup(self.rows).to(HOST)
        hit = slots >= 0
        if bool(hit.any()):
            picked = self.cached.index_select(0, slots[hit].to(self.cached.device))
            out[hit] = picked.to(HOST, self.dtype)
        miss = ~hit
        if bool(miss.any()):
            rows = self.reads.read(self.shard, self.rows[miss])
            out[miss] = torch.from_numpy(rows[:, self.columns]).to(self.dtype)
        return out[:, 0] if self.one_d else out


def _prune(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without the ``None`` leaves that stand for replaced tiered tensors."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = _prune(value)
        elif value is not None:
            out[key] = value
    return out


def load_changed_state(state: dict[str, Any], checkpoint: Path) -> None:
    """Loads an incremental checkpoint into ``state`` (as built for saving: views of the model
    and optimizer), which the checkpoints before it must have filled: its whole tensors as dcp
    does, then its changed rows wherever they overlap this rank's shards (each rank alone)."""
    dcp_load(state, checkpoint_id=checkpoint, planner=DefaultLoadPlanner(allow_partial_load=True))
    apply_changed_rows(state, checkpoint)


def apply_changed_rows(state: Mapping[str, Any], checkpoint: Path) -> None:
    """Writes the changed rows saved in ``checkpoint`` into the local shards of ``state``'s
    sharded tensors that they overlap, reading at most :data:`LOAD_BATCH_BYTES` at a time.

    Raises:
        ValueError: a saved tensor of ``checkpoint`` that ``state`` holds as a plain tensor.
    """
    tensors = dict(_walk(state))
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    wanted: list[tuple[str, str, Shard, tuple[int, int, int, int]]] = []
    for key in sorted(metadata):
        if not key.startswith(CHANGED_PREFIX) or not key.endswith("::ids"):
            continue
        path, where, _ = _parse_key(key)
        target = tensors.get(path)
        if target is None:
            continue  # no shard of it on this rank (an optimizer lists only its own tables)
        if not isinstance(target, ShardedTensor):
            raise ValueError(
                f"{checkpoint}: it holds changed rows of {path.replace('/', '.')}, which this "
                "model's state does not have as a sharded tensor"
            )
        for shard in target.local_shards():
            if _overlap(_where(shard), where):
                wanted.append((key, key[: -len("ids")] + "values", shard, where))
    batch: dict[str, torch.Tensor] = {}
    pending: list[tuple[str, str, Shard, tuple[int, int, int, int]]] = []
    size = 0
    for item in wanted:
        ids_key, values_key, _, _ = item
        for key in (ids_key, values_key):
            if key not in batch:
                md = metadata[key]
                assert isinstance(md, TensorStorageMetadata)
                batch[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                size += batch[key].numel() * batch[key].element_size()
        pending.append(item)
        if size >= LOAD_BATCH_BYTES:
            _apply(batch, pending, checkpoint)
            batch, pending, size = {}, [], 0
    if pending:
        _apply(batch, pending, checkpoint)


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


@torch.no_grad()
def _apply(
    batch: dict[str, torch.Tensor],
    items: list[tuple[str, str, Shard, tuple[int, int, int, int]]],
    checkpoint: Path,
) -> None:
    dcp_load(batch, checkpoint_id=checkpoint, no_dist=True)
    for ids_key, values_key, shard, saved in items:
        row, rows, col, cols = _where(shard)
        ids, values = batch[ids_key], batch[values_key]
        mine = (ids >= row) & (ids < row + rows)
        local = ids[mine] - row
        picked = values[mine]
        if shard.tensor.dim() == 1:
            shard.tensor.index_copy_(0, local, picked.to(shard.tensor.dtype))
            continue
        first, last = max(col, saved[2]), min(col + cols, saved[2] + saved[3])
        part = picked[:, first - saved[2] : last - saved[2]]
        shard.tensor[:, first - col : last - col].index_copy_(0, local, part.to(shard.tensor.dtype))


def track_changes(groups: Sequence[TieredTableGroup]) -> None:
    """Starts recording changed rows in every group (one byte per row)."""
    for group in groups:
        group.track_changes()


def clear_changes(groups: Sequence[TieredTableGroup]) -> None:
    """Marks every row of every group unchanged (after a checkpoint, or a load)."""
    for group in groups:
        group.clear_changes()
