"""Checkpoints of tiered tables that read rows where they lie: full ones streamed from the tiers,
incremental ones holding only the rows training changed.

TorchRec reads a table's state through tensors (``state_dict``, the fused optimizer's state), and
a tiered table's are views of its tier (see :class:`TierViews`). A flat tier's view is its rows
in id order, which ``torch.distributed.checkpoint`` (dcp) reads chunk by chunk. A log-structured
tier's rows lie in the order they were written: its view is a copy exported from the log, a
full extra pass over the table each time it is read. So this module saves such a table as it
lies: :func:`full_state_dict` replaces it by its live rows in the log's order, batch after batch
of consecutive segments (one sequential read of the log, one write), as ids and whole rows, and
a load appends them to the log in those batches. Take the state dict within
:func:`deferred_views`, so that nothing exports the copies meanwhile.

Incremental checkpoints (Check-N-Run, Eisenman et al., NSDI 2022): between two checkpoints
training touches a small share of a recommendation model's rows, and a tiered table knows which
(:meth:`TieredTableGroup.track_changes`). :func:`changed_state_dict` replaces every sharded
tensor backed by tiered rows, per local shard, by the global ids of its changed rows and their
values (weights or optimizer state), gathered only when dcp writes them, from the cache where
they are resident or from the tier in one batched read. Every other tensor (dense parameters,
TorchRec's own tables) is kept whole.

:func:`load_tier_checkpoint` loads either kind over the state the checkpoints before it left:
dcp's own entries as dcp does, then each rank the saved rows overlapping its own shards, by
global row and column, so a chain loads under any plan or world size. Rows bound for a
log-structured tier are written to it directly, whole rows at a time where the checkpoint holds
all of a row's columns; others go through the views.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex

from torchrec_mtrains._compat.torch_internals import Shard, ShardedTensor
from torchrec_mtrains.distributed.checkpoint_load import (
    apply_changed_rows,
    load_changed_state,
    load_tier_checkpoint,
)
from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.distributed.tier_io import HOST
from torchrec_mtrains.distributed.tier_state import (
    CHANGED_PREFIX,
    ROWS_PREFIX,
    TierRegion,
    clear_changes,
    deferred_views,
    entry_key,
    shard_where,
    tier_regions,
    tiered_shards,
    track_changes,
    walk_state,
)
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup

__all__ = [  # saving here; loading, keys and switches from their modules, one public place
    "CHANGED_PREFIX",
    "ROWS_PREFIX",
    "ChangedRowsSavePlanner",
    "ChangedState",
    "TierCheckpoint",
    "TierRowsSavePlanner",
    "apply_changed_rows",
    "changed_state_dict",
    "clear_changes",
    "deferred_views",
    "full_state_dict",
    "load_changed_state",
    "load_tier_checkpoint",
    "track_changes",
]


@dataclass(frozen=True)
class _ResidentRegion:
    """The memory of one tensor (weights or an optimizer state) of a resident table shard a
    tiered kernel computes, and which of its rows training changed."""

    tensor: torch.Tensor  # (rows, ...) in the fbgemm module
    start: int
    end: int
    row_bytes: int
    changed: torch.Tensor

    @classmethod
    def of(cls, tensor: torch.Tensor, changed: torch.Tensor) -> _ResidentRegion:
        start = tensor.data_ptr()
        row_bytes = tensor.stride(0) * tensor.element_size()
        return cls(tensor, start, start + tensor.shape[0] * row_bytes, row_bytes, changed)

    def holds(self, view: torch.Tensor) -> bool:
        return view.numel() > 0 and self.start <= view.data_ptr() < self.end

    def worth_it(self) -> bool:
        """Whether saving the changed rows (ids and values) beats saving the tensor whole."""
        rows = int(self.tensor.shape[0])
        return int(self.changed.sum()) * (self.row_bytes + 8) * 2 < rows * self.row_bytes


def _resident_regions(groups: Sequence[TieredTableGroup]) -> list[_ResidentRegion]:
    out = []
    for group in groups:
        for table in group.resident:
            if table.changed.numel() != table.rows or table.weights.device.type != "cpu":
                continue  # changes not tracked (or kept on a GPU: saved whole)
            for tensor in [table.weights, *table.states.values()]:
                out.append(_ResidentRegion.of(tensor, table.changed))
    return out


def _replace(
    state: Mapping[str, Any], replaced: Callable[[str, Any], bool], prefix: str = ""
) -> dict[str, Any]:
    """``state`` without the leaves ``replaced(path, value)`` takes over (paths as
    :func:`walk_state` names them)."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out[key] = _replace(value, replaced, path)
        elif not replaced(path, value):
            out[key] = value
    return out


def _union_over_ranks(paths: set[str], process_group: dist.ProcessGroup | None) -> set[str]:
    """``paths`` of every rank of ``process_group`` (this rank's alone without a group)."""
    if not dist.is_initialized() or dist.get_world_size(process_group) == 1:
        return paths
    everyone: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(everyone, sorted(paths), group=process_group)
    return {path for theirs in everyone for path in theirs}


# ------------------------------------------------------------------------------- saving


class TierRowsSavePlanner(DefaultSavePlanner):
    """dcp's default save planner, which gathers the tiered rows it writes (changed rows, or a
    log's batches) only as it writes them, so a save holds a batch's worth of rows in memory,
    not every row at once."""

    def __init__(self, gathers: Mapping[str, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self._gathers = dict(gathers)

    def lookup_object(self, index: MetadataIndex) -> Any:
        gather = self._gathers.get(index.fqn)
        return gather() if gather is not None else super().lookup_object(index)


ChangedRowsSavePlanner = TierRowsSavePlanner  # the name incremental checkpoints knew it by


@dataclass(frozen=True)
class TierCheckpoint:
    """A state dict to save with dcp, with the planner that gathers its tiered rows.

    Save it with a writer that puts each tensor in a file of its own
    (``FileSystemWriter(path, single_file_per_rank=False)``): dcp's file writer keeps a
    reference to every tensor of a file until the file is closed, so with one file per rank the
    rows gathered batch by batch would all stay in memory.

    Attributes:
        state: the state dict for ``dcp.save``.
        planner: pass it to ``dcp.save``.
        rows: this rank's tiered rows it holds (changed rows, or a log's live rows).
    """

    state: dict[str, Any]
    planner: TierRowsSavePlanner
    rows: int


ChangedState = TierCheckpoint  # the name incremental checkpoints knew it by


def _stand_in(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of the right shape and type for dcp's planning, taking no memory."""
    return torch.zeros((), dtype=dtype).expand(shape)


@dataclass
class _LogTable:
    """A log-structured tiered shard found in a state dict, and its tensors there: per path,
    the row column its view starts at, its width, whether it is 1-D, its first global column,
    and the row of the tensor that holds the shard's first row (the shard's row offset, except
    for a row-wise optimizer state of a column-wise table, which lists the rows once per
    column shard)."""

    region: TierRegion
    tensors: dict[str, tuple[int, int, bool, int, int]] = field(default_factory=dict)


def full_state_dict(state: Mapping[str, Any], groups: Sequence[TieredTableGroup]) -> TierCheckpoint:
    """The dcp state dict of a full checkpoint: ``state`` (a nested state dict of model and
    optimizer) with every tensor viewing a log-structured tier of ``groups`` replaced by its
    table's live rows in the log's order (see the module docstring); everything else, flat
    tiers included, kept as it is. Save it with the returned planner."""
    regions = tier_regions(groups)
    tables: dict[int, _LogTable] = {}

    def replaced(path: str, value: Any) -> bool:
        found = tiered_shards(value, regions)
        if found is None or not all(region.copy for _, region in found):
            return False
        # Every tiered shard the tensor's local shards view (a table's column shards on one
        # rank each have their own), described by its first chunk.
        for shard, region in found:
            table = tables.setdefault(id(region), _LogTable(region))
            if path in table.tensors:
                continue
            one_d = shard.tensor.dim() == 1
            width = 1 if one_d else int(shard.tensor.shape[1])
            global_col = 0 if one_d else int(shard.metadata.shard_offsets[1])
            base = int(shard.metadata.shard_offsets[0]) - region.first_row(shard.tensor)
            table.tensors[path] = (region.column(shard.tensor), width, one_d, global_col, base)
        return True

    out = _replace(state, replaced)
    gathers: dict[str, Callable[[], torch.Tensor]] = {}
    rows = 0
    for table in tables.values():
        shard, store = table.region.shard, table.region.shard.store
        weights = min(table.tensors, key=lambda p: table.tensors[p][0])  # column 0 first
        where = (shard.row_offset, shard.local_rows, shard.col_offset, shard.cols)
        layout = [[path, *table.tensors[path]] for path in table.tensors]
        out[entry_key(ROWS_PREFIX, weights, where, "layout")] = json.dumps(layout)
        reads = _BatchReads()
        for k, batch in enumerate(store.scan_batches()):  # type: ignore[attr-defined]  # a copy region: a log store
            ids_key = entry_key(ROWS_PREFIX, weights, where, f"{k}::ids")
            rows_key = entry_key(ROWS_PREFIX, weights, where, f"{k}::rows")
            out[ids_key] = _stand_in((batch.rows,), torch.int64)
            out[rows_key] = _stand_in((batch.rows, store.layout.row_width), torch.float32)
            gathers[ids_key] = _ScanIds(store, batch, shard.row_offset)
            gathers[rows_key] = _ScanRows(store, batch, reads)
            rows += batch.rows
    return TierCheckpoint(out, TierRowsSavePlanner(gathers), rows)


class _BatchReads:
    """The last batch read from a log, so its ids and rows come from one read."""

    def __init__(self) -> None:
        self._batch: object | None = None
        self._read: tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]] | None = None

    def read(self, store: Any, batch: Any) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        if self._batch is not batch or self._read is None:
            self._batch, self._read = batch, store.read_scan_batch(batch)
        return self._read


@dataclass(frozen=True)
class _ScanIds:
    """The global ids of one log batch, from the store's index alone (no data read)."""

    store: Any
    batch: Any
    row_offset: int

    def __call__(self) -> torch.Tensor:
        return torch.from_numpy(self.store.scan_batch_ids(self.batch)) + self.row_offset


@dataclass(frozen=True)
class _ScanRows:
    """The whole rows of one log batch, read in one sequential pass."""

    store: Any
    batch: Any
    reads: _BatchReads

    def __call__(self) -> torch.Tensor:
        return torch.from_numpy(self.reads.read(self.store, self.batch)[1])


def changed_state_dict(
    state: Mapping[str, Any],
    groups: Sequence[TieredTableGroup],
    process_group: dist.ProcessGroup | None = None,
) -> TierCheckpoint:
    """The dcp state dict of an incremental checkpoint: ``state`` (a nested state dict of model
    and optimizer) with each sharded tensor whose shards view tiered rows of ``groups``, or the
    resident tables their kernels compute, replaced by the ids and values of its rows changed
    since the groups' last ``clear_changes()``. Save it with the returned planner. (Tables on
    TorchRec's own kernels are kept whole.) ``process_group``: the ranks that save (default:
    all); they agree on which resident tables are saved whole (a collective), since dcp needs
    every shard of a tensor it writes.

    Raises:
        ValueError: naming a table whose changes are not tracked.
    """
    regions = tier_regions(groups)
    for region in regions:
        if region.group.changed_rows(region.index) is None:
            raise ValueError(
                f"table {region.shard.name!r}: its changed rows are not tracked; call "
                "track_changes() on its group before training, or save a full checkpoint"
            )
    found_chunks: list[tuple[int, int, str, Shard, TierRegion]] = []
    gathers: dict[str, Callable[[], torch.Tensor]] = {}

    def replaced(path: str, value: Any) -> bool:
        found = tiered_shards(value, regions)
        if found is None:
            return False
        for shard, region in found:
            found_chunks.append(
                (regions.index(region), region.first_row(shard.tensor), path, shard, region)
            )
        return True

    resident = _resident_regions(groups)
    resident_chunks: list[tuple[str, Shard, _ResidentRegion]] = []

    def homes(value: Any) -> list[tuple[Shard, _ResidentRegion]] | None:
        """The resident regions of a tensor's local shards, when each has one worth saving by
        its changed rows; None otherwise."""
        if not isinstance(value, ShardedTensor) or not value.local_shards():
            return None
        found = []
        for shard in value.local_shards():
            home = next((r for r in resident if r.holds(shard.tensor)), None)
            if home is None or not home.worth_it():
                return None
            found.append((shard, home))
        return found

    kept = _replace(state, replaced)
    # A rank may save a table whole (its shard changed a lot, or TorchRec's kernel computes it
    # there) where another saves its changed rows: then the table is saved whole everywhere.
    whole = {
        path
        for path, value in walk_state(kept)
        if isinstance(value, ShardedTensor) and value.local_shards() and homes(value) is None
    }
    whole = _union_over_ranks(whole, process_group)

    def replaced_resident(path: str, value: Any) -> bool:
        found = None if path in whole else homes(value)
        if found is None:
            return False
        resident_chunks.extend((path, shard, home) for shard, home in found)
        return True

    out = _replace(kept, replaced_resident)
    for path, shard, home in resident_chunks:
        first = (shard.tensor.data_ptr() - home.start) // home.row_bytes
        size = int(shard.metadata.shard_sizes[0])
        local = torch.nonzero(home.changed[first : first + size]).flatten()
        if local.numel() == 0:
            continue
        where = shard_where(shard)
        out[entry_key(CHANGED_PREFIX, path, where, "ids")] = local + where[0]
        values = entry_key(CHANGED_PREFIX, path, where, "values")
        out[values] = _stand_in((int(local.numel()), *shard.tensor.shape[1:]), shard.tensor.dtype)
        gathers[values] = _ViewGather(shard.tensor, local)
    # Chunk by chunk (a chunk's weights, then its optimizer states): the rows a chunk reads
    # from its tier serve all of its tensors when dcp writes them in this order.
    found_chunks.sort(key=lambda chunk: chunk[:2])
    reads = _ChunkReads()
    for _, first, path, shard, region in found_chunks:
        changed = region.group.changed_rows(region.index)
        assert changed is not None
        size = int(shard.metadata.shard_sizes[0])
        local = torch.nonzero(changed[first : first + size]).flatten()
        if local.numel() == 0:
            continue
        where = shard_where(shard)
        out[entry_key(CHANGED_PREFIX, path, where, "ids")] = local + where[0]
        values = entry_key(CHANGED_PREFIX, path, where, "values")
        out[values] = _stand_in((int(local.numel()), *shard.tensor.shape[1:]), shard.tensor.dtype)
        gathers[values] = _RowGather(region, shard.tensor, first, local, reads)
    rows = 0
    for region in regions:
        changed = region.group.changed_rows(region.index)
        rows += int(changed.sum()) if changed is not None else 0
    return TierCheckpoint(out, TierRowsSavePlanner(gathers), rows)


@dataclass(frozen=True)
class _ViewGather:
    """Some rows of a tensor in memory (a resident table's), copied when dcp writes them."""

    view: torch.Tensor
    rows: torch.Tensor

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        return self.view.index_select(0, self.rows)


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
    Reading them through the tier's view instead would fault them in one page at a time (or
    read a stale copy, for a log-structured tier)."""

    def __init__(
        self,
        region: TierRegion,
        view: torch.Tensor,
        first: int,
        local: torch.Tensor,
        reads: _ChunkReads,
    ) -> None:
        self.shard = region.shard
        self.rows = local + first  # the shard's local rows
        self.reads = reads
        self.one_d = view.dim() == 1
        column = region.column(view)
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
