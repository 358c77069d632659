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

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed._shard.sharded_tensor.api import ShardedTensor
from torch.distributed._shard.sharded_tensor.shard import Shard
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.distributed.tier_io import HOST
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.tiers._linux import release_freed_memory

CHANGED_PREFIX = "changed_rows::"
"""Top-level keys of the entries holding changed rows: ``changed_rows::<path>::<where>::ids``
and ``...::values``, ``<path>`` the tensor's keys in the state dict joined by ``/`` and
``<where>`` the saved shard's ``row:rows:col:cols`` in the tensor's global coordinates."""

ROWS_PREFIX = "tier_rows::"
"""Top-level keys of a log-structured table streamed whole: ``tier_rows::<path>::<where>::<k>::ids``
and ``...::<k>::rows`` for batch ``k`` (whole rows: weights, then optimizer states), and
``tier_rows::<path>::<where>::layout``, which tensor each column range of a row belongs to.
``<path>`` is the table's weights in the state dict, ``<where>`` its shard's weights."""

LOAD_BATCH_BYTES = 256 * 2**20
"""Saved rows read per dcp load while applying a checkpoint: bounds the memory it takes."""

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
class _TierRegion:
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
        """The first row column a view of this region shows."""
        return (view.data_ptr() - self.start) % self.row_bytes // view.element_size()

    def first_row(self, view: torch.Tensor) -> int:
        return (view.data_ptr() - self.start) // self.row_bytes


def _regions(groups: Sequence[TieredTableGroup]) -> list[_TierRegion]:
    regions = []
    for group in groups:
        for index in range(len(group.shards)):
            rows = group.views.mapped_rows(index)
            start = rows.data_ptr()
            end = start + rows.numel() * rows.element_size()
            row_bytes = rows.stride(0) * rows.element_size()
            regions.append(
                _TierRegion(group, index, start, end, row_bytes, group.views.is_copy(index))
            )
    return regions


def _region_of(tensor: torch.Tensor, regions: Sequence[_TierRegion]) -> _TierRegion | None:
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    ptr = tensor.data_ptr()
    for region in regions:
        if region.start <= ptr < region.end:
            return region
    return None


def _tiered_shards(
    value: Any, regions: Sequence[_TierRegion]
) -> list[tuple[Shard, _TierRegion]] | None:
    """The local shards of a sharded tensor viewing tiered rows, with their regions; ``None``
    for any other value (kept whole)."""
    if not isinstance(value, ShardedTensor) or not value.local_shards():
        return None
    found = [(s, _region_of(s.tensor, regions)) for s in value.local_shards()]
    if any(region is None for _, region in found):
        return None
    return [(s, r) for s, r in found if r is not None]


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


def _where(shard: Shard) -> Where:
    """A shard's ``(row, rows, col, cols)`` in its tensor's global coordinates (``col`` 0 and
    ``cols`` 1 for a 1-D tensor, a row-wise optimizer state)."""
    offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
    if len(offsets) == 1:
        return int(offsets[0]), int(sizes[0]), 0, 1
    return int(offsets[0]), int(sizes[0]), int(offsets[1]), int(sizes[1])


def _key(prefix: str, path: str, where: Where, part: str) -> str:
    return f"{prefix}{path}::{':'.join(map(str, where))}::{part}"


def _parse_key(prefix: str, key: str) -> tuple[str, Where, str]:
    path, where, part = key[len(prefix) :].split("::", 2)
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


def _replace(
    state: Mapping[str, Any], replaced: Callable[[str, Any], bool], prefix: str = ""
) -> dict[str, Any]:
    """``state`` without the leaves ``replaced(path, value)`` takes over."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out[key] = _replace(value, replaced, path)
        elif not replaced(path, value):
            out[key] = value
    return out


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
    the row column its view starts at, its width and whether it is 1-D."""

    region: _TierRegion
    tensors: dict[str, tuple[int, int, bool, int]] = field(default_factory=dict)


def full_state_dict(state: Mapping[str, Any], groups: Sequence[TieredTableGroup]) -> TierCheckpoint:
    """The dcp state dict of a full checkpoint: ``state`` (a nested state dict of model and
    optimizer) with every tensor viewing a log-structured tier of ``groups`` replaced by its
    table's live rows in the log's order (see the module docstring); everything else, flat
    tiers included, kept as it is. Save it with the returned planner."""
    regions = _regions(groups)
    tables: dict[int, _LogTable] = {}

    def replaced(path: str, value: Any) -> bool:
        found = _tiered_shards(value, regions)
        if found is None or not all(region.copy for _, region in found):
            return False
        shard, region = found[0]
        table = tables.setdefault(id(region), _LogTable(region))
        one_d = shard.tensor.dim() == 1
        width = 1 if one_d else int(shard.tensor.shape[1])
        global_col = 0 if one_d else int(shard.metadata.shard_offsets[1])
        table.tensors[path] = (region.column(shard.tensor), width, one_d, global_col)
        return True

    out = _replace(state, replaced)
    gathers: dict[str, Callable[[], torch.Tensor]] = {}
    rows = 0
    for table in tables.values():
        shard, store = table.region.shard, table.region.shard.store
        weights = min(table.tensors, key=lambda p: table.tensors[p][0])  # column 0 first
        where = (shard.row_offset, shard.local_rows, shard.col_offset, shard.cols)
        layout = [[path, *table.tensors[path]] for path in table.tensors]
        out[_key(ROWS_PREFIX, weights, where, "layout")] = json.dumps(layout)
        reads = _BatchReads()
        dtype = table.region.group.views.mapped_rows(table.region.index).dtype
        for k, batch in enumerate(store.scan_batches()):  # type: ignore[attr-defined]
            ids_key = _key(ROWS_PREFIX, weights, where, f"{k}::ids")
            rows_key = _key(ROWS_PREFIX, weights, where, f"{k}::rows")
            out[ids_key] = _stand_in((batch.rows,), torch.int64)
            out[rows_key] = _stand_in((batch.rows, store.layout.row_width), dtype)
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
    state: Mapping[str, Any], groups: Sequence[TieredTableGroup]
) -> TierCheckpoint:
    """The dcp state dict of an incremental checkpoint: ``state`` (a nested state dict of model
    and optimizer) with each sharded tensor whose shards view tiered rows of ``groups``, or the
    resident tables their kernels compute, replaced by the ids and values of its rows changed
    since the groups' last ``clear_changes()``. Save it with the returned planner. (Tables on
    TorchRec's own kernels are kept whole.)

    Raises:
        ValueError: naming a table whose changes are not tracked.
    """
    regions = _regions(groups)
    for region in regions:
        if region.group.changed_rows(region.index) is None:
            raise ValueError(
                f"table {region.shard.name!r}: its changed rows are not tracked; call "
                "track_changes() on its group before training, or save a full checkpoint"
            )
    found_chunks: list[tuple[int, int, str, Shard, _TierRegion]] = []
    gathers: dict[str, Callable[[], torch.Tensor]] = {}

    def replaced(path: str, value: Any) -> bool:
        found = _tiered_shards(value, regions)
        if found is None:
            return False
        for shard, region in found:
            found_chunks.append(
                (regions.index(region), region.first_row(shard.tensor), path, shard, region)
            )
        return True

    resident = _resident_regions(groups)
    resident_chunks: list[tuple[str, Shard, _ResidentRegion]] = []

    def replaced_resident(path: str, value: Any) -> bool:
        if not isinstance(value, ShardedTensor) or not value.local_shards():
            return False
        found = []
        for shard in value.local_shards():
            home = next((r for r in resident if r.holds(shard.tensor)), None)
            if home is None or not home.worth_it():
                return False
            found.append((path, shard, home))
        resident_chunks.extend(found)
        return True

    out = _replace(_replace(state, replaced), replaced_resident)
    for path, shard, home in resident_chunks:
        first = (shard.tensor.data_ptr() - home.start) // home.row_bytes
        size = int(shard.metadata.shard_sizes[0])
        local = torch.nonzero(home.changed[first : first + size]).flatten()
        if local.numel() == 0:
            continue
        where = _where(shard)
        out[_key(CHANGED_PREFIX, path, where, "ids")] = local + where[0]
        values = _key(CHANGED_PREFIX, path, where, "values")
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
        where = _where(shard)
        out[_key(CHANGED_PREFIX, path, where, "ids")] = local + where[0]
        values = _key(CHANGED_PREFIX, path, where, "values")
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


# ------------------------------------------------------------------------------ loading


@dataclass(frozen=True)
class _Saved:
    """Rows one checkpoint holds for one tensor: its path, the saved shard, and the dcp keys
    of the ids and the values (``column`` / ``width``: the values' columns within a saved
    whole row, for a log streamed whole; ``None``: the entry is the tensor's own values).
    ``layout_key``: a whole-rows entry not yet split into its tensors (see :func:`_expand`)."""

    path: str
    where: Where
    ids_key: str
    values_key: str
    column: int | None = None
    width: int = 0
    one_d: bool = False
    layout_key: str | None = None


def load_tier_checkpoint(
    state: dict[str, Any],
    checkpoint: Path,
    groups: Sequence[TieredTableGroup] = (),
    incremental: bool = False,
) -> None:
    """Loads one checkpoint into ``state`` (as built for saving: views of the model and
    optimizer, taken within :func:`deferred_views`): its dcp entries as dcp does, then its
    tiered rows wherever they overlap this rank's shards, each rank alone. Rows of a
    log-structured tier of ``groups`` are written to the tier directly (the groups' caches are
    emptied first); the others through the views. An ``incremental`` checkpoint holds only
    changed rows and needs the ones before it loaded first.

    Raises:
        ValueError: a full checkpoint lacking an entry of ``state`` (other than the tensors
            its saved rows stand for), or saved rows of a tensor ``state`` holds as a plain one.
    """
    with deferred_views(groups):
        for group in groups:
            group.purge()  # no cached row may outlive the rows written under it
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    saved = _saved_rows(metadata)
    flat, _ = flatten_state_dict(state)
    if not incremental:
        covered = {item.path.replace("/", ".") for items in saved.values() for item in items}
        covered |= {path.replace("/", ".") for path in _layout_paths(checkpoint, metadata)}
        missing = sorted(k for k in flat if k not in metadata and k not in covered)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ValueError(f"{checkpoint}: holds no {', '.join(missing[:3])}{more}")
    regions = _regions(groups)
    if not incremental:
        # Every row of these is written next: their logs forget the old rows first, which
        # would otherwise stay pinned beside the new ones (a file twice the table) until a
        # flush, and be compacted away after it.
        for region in _wholly_loaded(flat, regions):
            region.shard.store.clear()
    through_views: set[tuple[int, int]] = set()
    for key, value in flat.items():  # dcp writes these into the views: copies must be current
        if key in metadata:
            for _, region in _tiered_shards(value, regions) or []:
                if region.copy:
                    region.group.views.mark_written(region.index)
                    through_views.add((id(region.group), region.index))
    dcp_load(state, checkpoint_id=checkpoint, planner=DefaultLoadPlanner(allow_partial_load=True))
    for region in regions:  # stored before any saved row is written to the tier directly
        if (id(region.group), region.index) in through_views:
            region.group.views.persist_writes(region.index)
    _apply_saved(state, checkpoint, metadata, saved, regions)
    release_freed_memory()  # the batches' memory, kept by the C heap otherwise


def _wholly_loaded(flat: Mapping[str, Any], regions: Sequence[_TierRegion]) -> list[_TierRegion]:
    """The log-structured regions each of whose columns (weights, every optimizer state) a
    tensor of ``flat`` views: a full load writes every row of them."""
    covered: dict[int, np.ndarray[Any, Any]] = {}
    for value in flat.values():
        for shard, region in _tiered_shards(value, regions) or []:
            if not region.copy:
                continue
            width = region.shard.store.layout.row_width
            mask = covered.setdefault(id(region), np.zeros(width, dtype=bool))
            start = region.column(shard.tensor)
            mask[start : start + (shard.tensor.shape[1] if shard.tensor.dim() == 2 else 1)] = True
    return [r for r in regions if id(r) in covered and bool(covered[id(r)].all())]


def load_changed_state(
    state: dict[str, Any], checkpoint: Path, groups: Sequence[TieredTableGroup] = ()
) -> None:
    """Loads an incremental checkpoint into ``state`` (see :func:`load_tier_checkpoint`)."""
    load_tier_checkpoint(state, checkpoint, groups, incremental=True)


def apply_changed_rows(state: Mapping[str, Any], checkpoint: Path) -> None:
    """Writes the rows saved in ``checkpoint`` into the local shards of ``state``'s sharded
    tensors that they overlap, through their views (see :func:`load_tier_checkpoint`)."""
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    _apply_saved(state, checkpoint, metadata, _saved_rows(metadata), ())


def _saved_rows(metadata: Mapping[str, Any]) -> dict[tuple[int, int, str], list[_Saved]]:
    """The checkpoint's tiered rows, grouped by the rows of the saved shard and batch: the
    entries of one group share their ids (a row's weights and its optimizer states)."""
    out: dict[tuple[int, int, str], list[_Saved]] = {}
    for key in sorted(metadata):
        if key.startswith(CHANGED_PREFIX) and key.endswith("::ids"):
            path, where, _ = _parse_key(CHANGED_PREFIX, key)
            values = key[: -len("ids")] + "values"
            group = out.setdefault((where[0], where[1], "changed"), [])
            group.append(_Saved(path, where, key, values))
        elif key.startswith(ROWS_PREFIX) and key.endswith("::rows"):
            path, where, part = _parse_key(ROWS_PREFIX, key)
            base = key[: -len(f"{part}")]
            batch = part.split("::")[0]
            ids = f"{base}{batch}::ids"
            item = _Saved(path, where, ids, key, layout_key=f"{base}layout")
            out[(where[0], where[1], key)] = [item]
    return out


def _layout_paths(checkpoint: Path, metadata: Mapping[str, Any]) -> list[str]:
    """Every tensor path the whole-table entries of ``checkpoint`` stand for."""
    return [path for layout in _layouts(checkpoint, metadata).values() for path, *_ in layout]


def _layouts(checkpoint: Path, metadata: Mapping[str, Any]) -> dict[str, list[list[Any]]]:
    keys = [k for k in metadata if k.startswith(ROWS_PREFIX) and k.endswith("::layout")]
    if not keys:
        return {}
    loaded: dict[str, Any] = dict.fromkeys(keys, "")
    dcp_load(loaded, checkpoint_id=checkpoint, no_dist=True)
    return {key: json.loads(value) for key, value in loaded.items()}


def _apply_saved(
    state: Mapping[str, Any],
    checkpoint: Path,
    metadata: Mapping[str, Any],
    saved: dict[tuple[int, int, str], list[_Saved]],
    regions: Sequence[_TierRegion],
) -> None:
    tensors = dict(_walk(state))
    layouts = _layouts(checkpoint, metadata)
    batch: dict[str, torch.Tensor] = {}
    pending: list[list[_Saved]] = []
    size = 0
    for _, items in sorted(saved.items(), key=lambda kv: kv[0]):
        expanded = [part for item in items for part in _expand(item, layouts)]
        wanted = [item for item in expanded if _targets(tensors, item, checkpoint)]
        if not wanted:
            continue
        for item in wanted:
            for key in (item.ids_key, item.values_key):
                if key not in batch:
                    md = metadata[key]
                    assert isinstance(md, TensorStorageMetadata)
                    batch[key] = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                    size += batch[key].numel() * batch[key].element_size()
        pending.append(wanted)
        if size >= LOAD_BATCH_BYTES:
            _apply(batch, pending, checkpoint, tensors, regions)
            batch, pending, size = {}, [], 0
    if pending:
        _apply(batch, pending, checkpoint, tensors, regions)


def _expand(item: _Saved, layouts: Mapping[str, list[list[Any]]]) -> list[_Saved]:
    """A whole-rows entry as one item per tensor of its table's layout; others as they are."""
    if item.layout_key is None:
        return [item]
    row, rows, _, _ = item.where
    out = []
    for path, column, width, one_d, global_col in layouts[item.layout_key]:
        where = (row, rows, 0, 1) if one_d else (row, rows, global_col, width)
        out.append(_Saved(path, where, item.ids_key, item.values_key, column, width, bool(one_d)))
    return out


def _targets(tensors: Mapping[str, Any], item: _Saved, checkpoint: Path) -> bool:
    target = tensors.get(item.path)
    if target is None:
        return False  # no shard of it on this rank (an optimizer lists only its own tables)
    if not isinstance(target, ShardedTensor):
        raise ValueError(
            f"{checkpoint}: it holds rows of {item.path.replace('/', '.')}, which this "
            "model's state does not have as a sharded tensor"
        )
    return any(_overlap(_where(shard), item.where) for shard in target.local_shards())


def _overlap(a: Where, b: Where) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


@torch.no_grad()
def _apply(
    batch: dict[str, torch.Tensor],
    groups_of_items: list[list[_Saved]],
    checkpoint: Path,
    tensors: Mapping[str, Any],
    regions: Sequence[_TierRegion],
) -> None:
    dcp_load(batch, checkpoint_id=checkpoint, no_dist=True)
    for items in groups_of_items:
        direct = _DirectRows()
        for item in items:
            ids, values = batch[item.ids_key], batch[item.values_key]
            if item.column is not None:  # a tensor's columns of whole rows
                values = values[:, item.column : item.column + item.width]
                values = values[:, 0] if item.one_d else values
            target = tensors[item.path]
            added: set[int] = set()
            for shard in target.local_shards():
                mine = _where(shard)
                if not _overlap(mine, item.where):
                    continue
                region = _region_of(shard.tensor, regions)
                if region is None or not region.copy:
                    _write_view(shard, mine, item.where, ids, values)
                elif id(region) not in added:
                    # Once per tiered shard, not per chunk of its tensor: the rows go to the
                    # tier whole (a table's hundreds of chunks each re-selected every saved row).
                    added.add(id(region))
                    direct.add(region, shard, item, ids, values)
        direct.write()


def _write_view(shard: Shard, mine: Where, saved: Where, ids: torch.Tensor, values: Any) -> None:
    """Writes saved rows into a local shard's view where they overlap it."""
    row, rows, col, cols = mine
    keep = (ids >= row) & (ids < row + rows)
    local = ids[keep] - row
    picked = values[keep]
    if shard.tensor.dim() == 1:
        shard.tensor.index_copy_(0, local, picked.to(shard.tensor.dtype))
        return
    first, last = max(col, saved[2]), min(col + cols, saved[2] + saved[3])
    part = picked[:, first - saved[2] : last - saved[2]]
    shard.tensor[:, first - col : last - col].index_copy_(0, local, part.to(shard.tensor.dtype))


class _DirectRows:
    """Saved rows bound for log-structured tiers, gathered across a row's tensors (weights and
    optimizer states) and written whole: a row whose every column the checkpoint holds needs
    no read (a restore appends the log in batches); others are read, patched and written."""

    def __init__(self) -> None:
        # per region: local ids -> list of (row columns, values)
        self._parts: dict[
            int, tuple[_TierRegion, list[tuple[torch.Tensor, slice, torch.Tensor]]]
        ] = {}

    def add(
        self, region: _TierRegion, chunk: Shard, item: _Saved, ids: torch.Tensor, values: Any
    ) -> None:
        tiered = region.shard
        keep = (ids >= tiered.row_offset) & (ids < tiered.row_offset + tiered.local_rows)
        local = ids[keep] - tiered.row_offset
        picked = values[keep]
        start = region.column(chunk.tensor)
        if chunk.tensor.dim() == 1:
            columns, part = slice(start, start + 1), picked.reshape(-1, 1)
        else:
            saved_col, saved_cols = item.where[2], item.where[3]
            first = max(tiered.col_offset, saved_col)
            last = min(tiered.col_offset + tiered.cols, saved_col + saved_cols)
            if first >= last:
                return
            part = picked[:, first - saved_col : last - saved_col]
            columns = slice(start + first - tiered.col_offset, start + last - tiered.col_offset)
        entry = self._parts.setdefault(id(region), (region, []))
        if any(c == columns and torch.equal(i, local) for i, c, _ in entry[1]):
            return  # the same columns again (a tensor's several chunks)
        entry[1].append((local, columns, part))

    def write(self) -> None:
        for region, parts in self._parts.values():
            store = region.shard.store
            width = store.layout.row_width
            by_ids: dict[int, list[tuple[torch.Tensor, slice, torch.Tensor]]] = {}
            for local, columns, part in parts:
                key = next((k for k, v in by_ids.items() if torch.equal(v[0][0], local)), None)
                by_ids.setdefault(len(by_ids) if key is None else key, []).append(
                    (local, columns, part)
                )
            for same in by_ids.values():
                local = same[0][0]
                if not local.numel():
                    continue
                covered = np.zeros(width, dtype=bool)
                rows = np.zeros((local.numel(), width), dtype=np.float32)
                for _, columns, part in same:
                    rows[:, columns] = part.to(torch.float32).numpy()
                    covered[columns] = True
                if not covered.all():  # only some columns saved: keep the others
                    old = store.read_rows(local.numpy())
                    old[:, covered] = rows[:, covered]
                    rows = old
                order = np.argsort(local.numpy(), kind="stable")
                store.write_rows(local.numpy()[order], rows[order])
