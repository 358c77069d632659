"""Loading checkpoints of tiered tables, full or incremental, under any plan or world size:
dcp's own entries as dcp does, then each rank the saved rows overlapping its own shards, by
global row and column. Rows bound for a log-structured tier are written to it directly, whole
rows at a time where the checkpoint holds all of a row's columns (a full load first clears the
log); others go through the views. (Saving: :mod:`torchrec_mtrains.distributed.incremental`.)"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from torchrec_mtrains._compat.torch_internals import Shard, ShardedTensor, flatten_state_dict
from torchrec_mtrains.distributed.tier_state import (
    CHANGED_PREFIX,
    ROWS_PREFIX,
    TierRegion,
    Where,
    deferred_views,
    parse_entry_key,
    region_of,
    shard_where,
    tier_regions,
    tiered_shards,
    walk_state,
)
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.tiers._linux import release_freed_memory

LOAD_BATCH_BYTES = 256 * 2**20
"""Saved rows read per dcp load while applying a checkpoint: bounds the memory it takes."""


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
    id_shift: int = 0  # added to the saved ids to give rows of this tensor (see _expand)


def load_tier_checkpoint(
    state: dict[str, Any],
    checkpoint: Path,
    groups: Sequence[TieredTableGroup] = (),
    incremental: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Loads one checkpoint into ``state`` (as built for saving: views of the model and
    optimizer, taken within :func:`deferred_views`): its dcp entries as dcp does, then its
    tiered rows wherever they overlap this rank's shards, each rank alone. Rows of a
    log-structured tier of ``groups`` are written to the tier directly (the groups' caches are
    emptied first); the others through the views. An ``incremental`` checkpoint holds only
    changed rows and needs the ones before it loaded first. ``process_group``: the ranks
    that load (dcp's collective load of its own entries), the default group when ``None``.

    Raises:
        ValueError: a full checkpoint lacking an entry of ``state`` (other than the tensors
            its saved rows stand for), or saved rows of a tensor ``state`` holds as a plain one.
    """
    with deferred_views(groups):
        for group in groups:
            group.purge()  # no cached row may outlive the rows written under it
    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    saved = _saved_rows(metadata)
    flat = flatten_state_dict(state)
    if not incremental:
        covered = {item.path.replace("/", ".") for items in saved.values() for item in items}
        covered |= {path.replace("/", ".") for path in _layout_paths(checkpoint, metadata)}
        missing = sorted(k for k in flat if k not in metadata and k not in covered)
        if missing:
            more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
            raise ValueError(f"{checkpoint}: holds no {', '.join(missing[:3])}{more}")
    regions = tier_regions(groups)
    if not incremental:
        # Every row of these is written next: their logs forget the old rows first, which
        # would otherwise stay pinned beside the new ones (a file twice the table) until a
        # flush, and be compacted away after it.
        for region in _wholly_loaded(flat, regions):
            region.shard.store.clear()
    for key, value in flat.items():  # dcp writes these into the views: copies must be current
        if key in metadata:
            for _, region in tiered_shards(value, regions) or []:
                if region.copy:
                    region.group.views.mark_written(region.index)
    dcp_load(
        state,
        checkpoint_id=checkpoint,
        planner=DefaultLoadPlanner(allow_partial_load=True),
        process_group=process_group,
    )
    for group in groups:  # stored before any saved row is written to the tier directly
        group.absorb_view_writes(loaded=True)
    _apply_saved(state, checkpoint, metadata, saved, regions)
    for group in groups:  # saved rows written through views of flat tiers
        group.absorb_view_writes(loaded=True)
    release_freed_memory()  # the batches' memory, kept by the C heap otherwise


def _wholly_loaded(flat: Mapping[str, Any], regions: Sequence[TierRegion]) -> list[TierRegion]:
    """The log-structured regions each of whose columns (weights, every optimizer state) a
    tensor of ``flat`` views: a full load writes every row of them."""
    covered: dict[int, np.ndarray[Any, Any]] = {}
    for value in flat.values():
        for shard, region in tiered_shards(value, regions) or []:
            if not region.copy:
                continue
            width = region.shard.store.layout.row_width
            mask = covered.setdefault(id(region), np.zeros(width, dtype=bool))
            start = region.column(shard.tensor)
            mask[start : start + (shard.tensor.shape[1] if shard.tensor.dim() == 2 else 1)] = True
    return [r for r in regions if id(r) in covered and bool(covered[id(r)].all())]


def load_changed_state(
    state: dict[str, Any],
    checkpoint: Path,
    groups: Sequence[TieredTableGroup] = (),
    process_group: dist.ProcessGroup | None = None,
) -> None:
    """Loads an incremental checkpoint into ``state`` (see :func:`load_tier_checkpoint`)."""
    load_tier_checkpoint(state, checkpoint, groups, incremental=True, process_group=process_group)


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
            path, where, _ = parse_entry_key(CHANGED_PREFIX, key)
            values = key[: -len("ids")] + "values"
            group = out.setdefault((where[0], where[1], "changed"), [])
            group.append(_Saved(path, where, key, values))
        elif key.startswith(ROWS_PREFIX) and key.endswith("::rows"):
            path, where, part = parse_entry_key(ROWS_PREFIX, key)
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
    regions: Sequence[TierRegion],
) -> None:
    tensors = dict(walk_state(state))
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
    for path, column, width, one_d, global_col, *rest in layouts[item.layout_key]:
        # The saved ids are the shard's global rows; a row-wise state of a column-wise table
        # holds the shard's rows from another row (``base``: layouts saved before it was
        # recorded have none, and held the shard's row offset).
        base = int(rest[0]) if rest else row
        where = (base, rows, 0, 1) if one_d else (base, rows, global_col, width)
        out.append(
            _Saved(
                path,
                where,
                item.ids_key,
                item.values_key,
                column,
                width,
                bool(one_d),
                id_shift=base - row,
            )
        )
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
    return any(_overlap(shard_where(shard), item.where) for shard in target.local_shards())


def _overlap(a: Where, b: Where) -> bool:
    return a[0] < b[0] + b[1] and b[0] < a[0] + a[1] and a[2] < b[2] + b[3] and b[2] < a[2] + a[3]


@torch.no_grad()
def _apply(
    batch: dict[str, torch.Tensor],
    groups_of_items: list[list[_Saved]],
    checkpoint: Path,
    tensors: Mapping[str, Any],
    regions: Sequence[TierRegion],
) -> None:
    dcp_load(batch, checkpoint_id=checkpoint, no_dist=True)
    for items in groups_of_items:
        direct = _DirectRows()
        for item in items:
            ids, values = batch[item.ids_key] + item.id_shift, batch[item.values_key]
            if item.column is not None:  # a tensor's columns of whole rows
                values = values[:, item.column : item.column + item.width]
                values = values[:, 0] if item.one_d else values
            target = tensors[item.path]
            added: set[int] = set()
            for shard in target.local_shards():
                mine = shard_where(shard)
                if not _overlap(mine, item.where):
                    continue
                region = region_of(shard.tensor, regions)
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
            int, tuple[TierRegion, list[tuple[torch.Tensor, slice, torch.Tensor]]]
        ] = {}

    def add(
        self, region: TierRegion, chunk: Shard, item: _Saved, ids: torch.Tensor, values: Any
    ) -> None:
        tiered = region.shard
        # The tensor's row holding the shard's first row: its row offset, except for a row-wise
        # optimizer state of a column-wise table, which lists the rows once per column shard.
        base = int(chunk.metadata.shard_offsets[0]) - region.first_row(chunk.tensor)
        keep = (ids >= base) & (ids < base + tiered.local_rows)
        local = ids[keep] - base
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
