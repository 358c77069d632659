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
loads into tensors of the sizes it saved: :func:`expand_for_load` sizes a state dict's virtual
entries from a checkpoint's metadata first. (The app's incremental checkpoint chains do not hold
virtual tables yet.)
"""

from __future__ import annotations

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
from torchrec_mtrains.distributed.table_shard import TieredTableShard

ID_KEY = "weight_id"
BUCKET_KEY = "bucket"
METADATA_KEY = "metadata"


@dataclass
class LiveRows:
    """One shard's live rows, read from its tier: ids (in the table) ascending, then each
    part of the rows at the table's types."""

    ids: torch.Tensor
    weights: torch.Tensor
    states: list[torch.Tensor]
    # per row, what its table's eviction rule keeps of it (see EvictionRule.columns)
    metadata: torch.Tensor = field(default_factory=lambda: torch.empty(0, 0, dtype=torch.float64))


def read_live_rows(shard: TieredTableShard) -> LiveRows:
    """The live rows of a virtual table shard whose cache has been written back."""
    virtual = shard.virtual
    assert virtual is not None
    local_ids, rows = virtual.id_map.live()
    order = np.argsort(local_ids, kind="stable")
    local_ids, rows = local_ids[order], rows[order]
    data = torch.from_numpy(shard.store.read_rows(rows)) if rows.size else None
    layout = shard.store.layout
    dim = layout.dim
    weights = torch.empty(len(rows), dim, dtype=layout.dtype.torch_dtype)
    states: list[torch.Tensor] = []
    start = dim
    for view, shape in zip(shard.state_slots, shard.state_shapes):
        width = int(view.shape[1])
        part = torch.empty(len(rows), width, dtype=view.dtype)
        if data is not None:
            part.copy_(data[:, start : start + width])
        states.append(part.reshape(len(rows), *shape))
        start += width
    if data is not None:
        weights.copy_(data[:, :dim])
    ids = torch.from_numpy(local_ids + virtual.space.id_offset)
    return LiveRows(ids, weights, states, torch.from_numpy(virtual.eviction.export(rows)))


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
    tail = list(local.shape[1:])
    shards_md = []
    offset = 0
    mine: list[Shard] = []
    for r, count in enumerate(counts):
        md = ShardMetadata(
            shard_offsets=[offset] + [0] * len(tail),
            shard_sizes=[count, *tail],
            placement=remote_device(f"rank:{r}/cpu"),
        )
        shards_md.append(md)
        if r == rank:
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


def expand_for_load(state: dict[str, Any], metadata: Any) -> int:
    """Readies ``state`` (a state dict about to be loaded by ``torch.distributed.checkpoint``,
    nested as it was saved) for a checkpoint whose ``metadata`` (``Metadata``, from
    ``FileSystemReader(path).read_metadata()``) holds virtual tables: every ShardedTensor
    entry whose saved size differs from its own (a virtual table's live rows, which change
    between a save and a load) becomes a whole tensor of the saved size, so each rank reads
    every saved row and ``load_state_dict`` keeps those of its shards (whatever world size
    saved them). Returns how many entries it replaced.

    Example::

        state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
        expand_for_load(state, FileSystemReader(path).read_metadata())
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        model.fused_optimizer.load_state_dict(state["optim"])
    """
    saved = metadata.state_dict_metadata
    replaced = 0

    def walk(node: dict[str, Any], path: str) -> None:
        nonlocal replaced
        for key, value in list(node.items()):
            name = f"{path}.{key}" if path else str(key)
            if isinstance(value, dict):
                walk(value, name)
            elif isinstance(value, ShardedTensor):
                entry = saved.get(name)
                size = getattr(entry, "size", None)
                if size is not None and tuple(size) != tuple(value.size()):
                    node[key] = torch.empty(tuple(size), dtype=entry.properties.dtype)
                    replaced += 1

    walk(state, "")
    return replaced


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
    rows, made = virtual.id_map.assign(ids_np)
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
