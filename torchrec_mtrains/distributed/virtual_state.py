"""State dicts of virtual tables in TorchRec's form: live rows only, with their ids.

For a virtual table ``t`` a module's state dict holds, as TorchRec's virtual-table kernels lay
it out (``embedding_kernel.create_virtual_sharded_tensors``):

* ``<prefix>.t.weight``: ``(N, dim)``, the live rows, each rank's sorted by id;
* ``<prefix>.t.weight_id``: ``(N, 1)`` int64, the id of each row;
* ``<prefix>.t.bucket``: ``(total_num_buckets, 1)`` int64, live ids per bucket (without
  ``total_num_buckets``, one bucket per shard);
* ``<prefix>.t.metadata``: ``(N, k)`` float64, for a table that evicts, what its rule keeps of
  each row (its use count, when it was last trained in seconds of the eviction clock, how many
  batches ago: see ``EvictionRule.columns``), so that a loaded table evicts as the saved one
  would have;

and the fused optimizer's state for ``t`` holds each state over the same rows, in the same order,
with ``t.weight_id`` beside it, so it loads alone. ``N`` changes as ids are made and evicted,
and the shards are stacked rank after rank: building one takes the live counts of every rank
(one small all-gather over the module's process group), so every rank must take it together,
as for any sharded state dict. The tensors are copies made at the call (rows are read from
the tiers after the caches are written back): to change a virtual table, load a state dict.

A load (``load_state_dict``) replaces the live ids of each shard by those of the incoming rows
that fall in its id range, whatever world size wrote them (so a load at another world size
re-buckets the rows); an id already live keeps its optimizer state, a new one starts at zero,
until the optimizer's state is loaded (in either order). ``torch.distributed.checkpoint``
loads into tensors of the sizes it saved:
:func:`~torchrec_mtrains.distributed.virtual_checkpoints.expand_for_load` sizes a state dict's
virtual entries from a checkpoint's metadata first. An incremental checkpoint (taken within
:func:`~torchrec_mtrains.distributed.virtual_checkpoints.saving_changes`) holds the rows that
changed, the ids evicted (``evicted_id``) and how the other rows aged (``since_parent``).
"""

from __future__ import annotations

import contextvars
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from torchrec_mtrains._compat.torch_internals import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
    init_from_local_shards,
    remote_device,
)
from torchrec_mtrains.cache.id_map import NO_ROW
from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.types import Tier

ID_KEY = "weight_id"
BUCKET_KEY = "bucket"
METADATA_KEY = "metadata"
EVICTED_KEY = "evicted_id"
"""An incremental checkpoint's ids evicted since the link before it and not live now."""
SINCE_KEY = "since_parent"
"""An incremental checkpoint's record per shard: its first id, its id count, its eviction
rounds and batches since the link before it, and its live rows (see :func:`since_parent`)."""
SINCE_COLUMNS = ("first_id", "ids", "eviction_rounds", "batches", "live_rows")


SAVING_CHANGES: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "saving_changes", default=False
)
"""Whether the state dicts taken now are an incremental checkpoint's: virtual tables then hold
their changed rows with :data:`EVICTED_KEY` and :data:`SINCE_KEY` beside them, on every rank
(set by :func:`~torchrec_mtrains.distributed.virtual_checkpoints.saving_changes`)."""


@dataclass
class LiveRows:
    """One shard's live rows, read from its tier: ids (in the table) ascending, then each
    part of the rows at the table's types."""

    ids: torch.Tensor
    weights: torch.Tensor
    states: list[torch.Tensor]
    # per row, what its table's eviction rule keeps of it (see EvictionRule.columns)
    metadata: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.float64))


READ_CHUNK_ROWS = 65536
"""Rows read from a tier at a time into a state dict's tensors: no second copy of them all."""

FILE_BACKED_BYTES = 16 << 20
"""From this size on, a state dict's rows of a virtual table whose store is not in host memory
are a mapped file (see :func:`live_row_buffer`), not anonymous memory."""

LIVE_ROWS_DIR = "live_rows"
"""Subdirectory of a store's directory holding the (unlinked) files of mapped live rows."""


def live_row_buffer(
    rows: int, width: int, dtype: torch.dtype, directory: os.PathLike[str] | str | None
) -> torch.Tensor:
    """An uninitialized ``[rows, width]`` tensor for a state dict's live rows: with a
    ``directory`` (the store's, for a table not held in host memory) and at least
    :data:`FILE_BACKED_BYTES`, a shared mapping of a file there whose name is removed at once.

    Why: a state dict holds every live row of a virtual table (as TorchRec's does), which for a
    table on SCM may not fit host memory. A file mapping's pages are the page cache's, written
    back and dropped under memory pressure as dcp streams them out; anonymous memory could only
    go to swap. The file lives as long as the tensor does, and no longer."""
    nbytes = rows * width * dtype.itemsize
    if directory is None or nbytes == 0 or nbytes < FILE_BACKED_BYTES:
        return torch.empty(rows, width, dtype=dtype)
    folder = os.path.join(directory, LIVE_ROWS_DIR)
    os.makedirs(folder, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix="rows.", dir=folder)
    try:
        # Reserved now, so a full disk is an error here, not a SIGBUS at a write through the map.
        try:
            os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            raise OSError(
                e.errno, f"{folder}: no room for {nbytes} bytes of a state dict's live rows"
            ) from e
        mapped = torch.from_file(path, shared=True, size=rows * width, dtype=dtype)
    finally:
        os.close(fd)
        os.unlink(path)
    return mapped.view(rows, width)


def read_live_rows(shard: TieredTableShard, weights: bool = True, states: bool = True) -> LiveRows:
    """The live rows of a virtual table shard whose cache has been written back (while an
    incremental checkpoint is taken, those that changed since the last): their ``weights``
    and optimizer ``states`` where asked for (else empty), read chunk by chunk into tensors
    that, for a store not in host memory, map files (:func:`live_row_buffer`); the ids and
    eviction metadata (8 bytes a row each, as the id map) are in memory."""
    virtual = shard.virtual
    assert virtual is not None
    if virtual.saving is None:
        local_ids, rows = virtual.live()
    else:  # an incremental checkpoint: the rows that changed (see virtual_checkpoints)
        rows = virtual.saving
        local_ids = virtual.id_map.row_ids[rows]
    order = np.argsort(local_ids, kind="stable")
    local_ids, rows = local_ids[order], rows[order]
    store = shard.store
    layout = store.layout
    dim, count = layout.dim, len(rows)
    spill = None if store.serves_tier == Tier.DRAM.value else store.directory
    out_weights = live_row_buffer(count if weights else 0, dim, layout.dtype.torch_dtype, spill)
    out_states = [
        live_row_buffer(count if states else 0, int(view.shape[1]), view.dtype, spill)
        for view in shard.state_slots
    ]
    if weights or states:
        for first in range(0, count, READ_CHUNK_ROWS):
            part = slice(first, first + READ_CHUNK_ROWS)
            data = torch.from_numpy(shard.store.read_rows(rows[part]))
            if weights:
                out_weights[part].copy_(data[:, :dim])
            start = dim
            for out in out_states:
                width = int(out.shape[1])
                if states:
                    out[part].copy_(data[:, start : start + width])
                start += width
    shaped = [
        out.reshape(int(out.shape[0]), *shape) for out, shape in zip(out_states, shard.state_shapes)
    ]
    ids = torch.from_numpy(local_ids + virtual.space.id_offset)
    return LiveRows(ids, out_weights, shaped, torch.from_numpy(virtual.eviction.export(rows)))


def gather_sizes(sizes: list[list[int]], pg: dist.ProcessGroup | None) -> list[list[list[int]]]:
    """Every rank's ``sizes`` (per virtual table, its row counts), by rank."""
    if not dist.is_initialized() or dist.get_world_size(pg) == 1:
        return [sizes]
    out: list[Any] = [None] * dist.get_world_size(pg)
    dist.all_gather_object(out, sizes, group=pg)
    return [list(c) for c in out]


def stacked(
    local: torch.Tensor,
    counts: Sequence[int],
    rank: int,
    pg: dist.ProcessGroup | None,
) -> ShardedTensor:
    """A ShardedTensor of the ranks' row blocks stacked in rank order (``counts`` rows each,
    possibly none); this rank's block is ``local``."""
    return row_blocks([(count, r) for r, count in enumerate(counts)], local, rank, pg)


def row_blocks(
    blocks: Sequence[tuple[int, int]],
    local: torch.Tensor,
    rank: int,
    pg: dist.ProcessGroup | None,
) -> ShardedTensor:
    """A ShardedTensor of consecutive row blocks, ``(rows, owner rank)`` each, in row order,
    built on this rank alone: this rank's block (at most one) is ``local``, whose trailing
    shape and type the others share."""
    tail = list(local.shape[1:])
    shards_md = []
    offset = 0
    mine: list[Shard] = []
    for count, owner in blocks:
        md = ShardMetadata(
            shard_offsets=[offset] + [0] * len(tail),
            shard_sizes=[count, *tail],
            placement=remote_device(f"rank:{owner}/cpu"),
        )
        shards_md.append(md)
        if owner == rank:
            mine.append(Shard(local, md))
        offset += count
    global_md = ShardedTensorMetadata(
        shards_metadata=shards_md,
        size=torch.Size([offset, *tail]),
        tensor_properties=TensorProperties(dtype=local.dtype),
    )
    return init_from_local_shards(mine, global_md, pg)


def bucket_counts(
    ids: torch.Tensor, num_embeddings: int, buckets: int | None
) -> tuple[torch.Tensor, int]:
    """Live ids per bucket of the table (``buckets`` of ``num_embeddings // buckets`` ids; one
    bucket without ``total_num_buckets``), as ``(buckets, 1)`` int64, and the bucket count."""
    total = buckets or 1
    size = num_embeddings // total
    counts = torch.bincount(ids // size, minlength=total)[:total]
    return counts.reshape(total, 1).to(torch.int64), total


def gather_incoming(value: Any) -> torch.Tensor:
    """The rows of ``value`` (a ShardedTensor's local shards stacked, or a tensor) this rank
    holds, in order."""
    if isinstance(value, ShardedTensor):
        shards = sorted(value.local_shards(), key=lambda s: tuple(s.metadata.shard_offsets))
        if not shards:
            return torch.empty(0, *value.size()[1:], dtype=value.dtype)
        return torch.cat([s.tensor for s in shards])
    if isinstance(value, torch.Tensor):
        return value
    raise TypeError(f"expected a tensor or ShardedTensor, got {type(value).__name__}")


def select_range(
    ids: torch.Tensor, first: int, count: int, *parts: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``ids`` in ``[first, first + count)`` (made local) and the matching rows of ``parts``."""
    ids = ids.reshape(-1).to(torch.int64)
    keep = (ids >= first) & (ids < first + count)
    return (ids[keep] - first, *(p[keep] for p in parts))


def evicted_since(shard: TieredTableShard) -> torch.Tensor:
    """``(M, 1)`` int64: the table's ids this shard evicted since its changes were cleared
    (or a load dropped) that are not live now, ascending."""
    virtual = shard.virtual
    assert virtual is not None and virtual.changes is not None
    gone = virtual.changes.evicted_ids()
    gone = gone[virtual.live_rows_of(gone) == NO_ROW]
    return torch.from_numpy(gone + virtual.space.id_offset).reshape(-1, 1)


def since_parent(shard: TieredTableShard) -> torch.Tensor:
    """``(1, 5)`` int64, :data:`SINCE_COLUMNS` of a shard whose changes are tracked: the ids
    it holds, the eviction rounds (each decays every live count) and batches (each ages every
    row) since its changes were cleared, and its live rows: so a row the checkpoint does not
    hold can be aged as the shard aged it, and the result checked."""
    virtual = shard.virtual
    assert virtual is not None and virtual.changes is not None
    eviction, changes = virtual.eviction, virtual.changes
    values = [
        virtual.space.id_offset,
        virtual.space.ids,
        eviction.rounds - changes.rounds_before,
        eviction.batches - changes.batches_before,
        virtual.live_count(),
    ]
    return torch.tensor([values], dtype=torch.int64)


def load_rows(
    shard: TieredTableShard,
    ids: torch.Tensor,
    weights: torch.Tensor | None,
    states: Sequence[torch.Tensor] | None,
    metadata: torch.Tensor | None = None,
) -> None:
    """Writes loaded rows of shard-local ``ids`` straight to a virtual shard's tier (its cache
    must be empty: the caller purged it).

    With ``weights`` (a module's state dict) the shard's live ids become ``ids``: the others
    go, each of ``ids`` gets ``weights``, and keeps its optimizer state if it was live, else
    zero. With only ``states`` (an optimizer's) ``ids`` get those states, and ids not live yet
    get rows with their initial weights."""
    virtual = shard.virtual
    assert virtual is not None
    store, layout = shard.store, shard.store.layout
    ids_np = ids.reshape(-1).to(torch.int64).numpy()
    count = len(ids_np)
    if len(np.unique(ids_np)) != count:
        raise ValueError(f"virtual table {shard.name!r}: the state to load repeats an id")
    kept_state: np.ndarray[Any, Any] | None = None
    if weights is not None:
        before = virtual.id_map.lookup(ids_np)
        kept = before != -1
        kept_state = np.zeros((count, layout.row_width - layout.dim), dtype=np.float32)
        if kept.any():
            kept_state[kept] = store.read_rows(before[kept])[:, layout.dim :]
        live_ids, _ = virtual.id_map.live()
        virtual.id_map.remove(live_ids)
    else:
        live_ids = np.empty(0, dtype=np.int64)
    rows, made = virtual.id_map.assign(ids_np)
    virtual.loaded(rows, live_ids)
    data = np.zeros((count, layout.row_width), dtype=np.float32)
    existing = np.ones(count, dtype=bool)
    existing[made] = False
    if weights is None and existing.any():
        data[existing] = store.read_rows(rows[existing])
    if made.size and weights is None:
        made_t = torch.from_numpy(made)
        data[made] = virtual.initial_rows(
            ids[made_t], layout.row_width, layout.dim, shard.col_offset, layout.dtype.torch_dtype
        ).numpy()
    if weights is not None:
        data[:, : layout.dim] = weights.reshape(count, layout.dim).to(torch.float32).numpy()
        assert kept_state is not None
        data[:, layout.dim :] = kept_state
    if states is not None:
        start = layout.dim
        for view, state in zip(shard.state_slots, states):
            width = int(view.shape[1])
            data[:, start : start + width] = state.reshape(count, width).to(torch.float32).numpy()
            start += width
    virtual.eviction.made(rows[made])
    if metadata is not None:
        columns = len(virtual.eviction.rule.columns)
        virtual.eviction.restore(rows, metadata.reshape(count, columns).to(torch.float64).numpy())
    if count:
        order = np.argsort(rows)
        store.write_rows(rows[order], data[order])
    store.flush()
