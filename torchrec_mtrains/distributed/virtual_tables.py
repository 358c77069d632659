"""TorchRec's virtual tables (``use_virtual_table=True``) on the tiers.

A virtual table takes any id in ``[0, num_embeddings)``, ``num_embeddings`` up to 2**50, and
has a row only for the ids trained so far. TorchRec 1.8 carries the API (the config flag,
``total_num_buckets`` and its bucketized row-wise input distribution, the eviction policy
objects) but its own kernels for it are CUDA-only and absent from the public fbgemm wheels.

Here a virtual table is a tiered table with two extents:

* the **id space** TorchRec routes: table-wise, the whole ``[0, num_embeddings)`` on one rank;
  row-wise, each rank's block of buckets, whose ids the input distribution hands over with the
  block's first id subtracted (as for any row-wise table);
* the **store**: ``capacity`` rows per shard, from the plan's ``max_live_rows`` (the bound on
  live rows, spread over the row-wise shards by their share of the id space).

The kernel is built on the store's extent (a *physical* table: the fused module, the cache,
the tier file and the optimizer state all see ``capacity`` dense rows), and a
:class:`~torchrec_mtrains.cache.id_map.VirtualRowMap` per shard gives each id a row when it is
first trained, filled by an :class:`~torchrec_mtrains.initializers.IdAddressedInit` of the
global id, its optimizer state zeroed. So a virtual table whose ids stay below ``N`` trains
exactly as a FUSED table of ``N`` rows filled by the same initializer.

Eviction follows the table's ``virtual_table_eviction_policy`` (see
:mod:`~torchrec_mtrains.distributed.virtual_eviction`). Built: table-wise and row-wise
sharding, every tier and layout, EBC and EC. Not yet: checkpoints of virtual tables (``state_dict()`` refuses them, naming the table, rather than
leave them out), planning them with the tiered planner.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torchrec.distributed.embedding_types import GroupedEmbeddingConfig, ShardedEmbeddingTable
from torchrec.distributed.types import ParameterSharding, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_mtrains._compat.torch_internals import ShardedTensorMetadata, ShardMetadata
from torchrec_mtrains.distributed.grouping import is_tiered
from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    TieredParameterSharding,
    TieredTableOptions,
)
from torchrec_mtrains.distributed.virtual_eviction import EvictionRule
from torchrec_mtrains.initializers import IdAddressedInit, IdSeededUniform

MAX_VIRTUAL_ROWS = 2**50
"""The largest ``num_embeddings`` of a virtual table (ids are int64; TorchRec's bound)."""

VIRTUAL_SHARDING_TYPES = (ShardingType.TABLE_WISE.value, ShardingType.ROW_WISE.value)
OPTION = "TieredTableOptions.max_live_rows"


class VirtualTableError(ValueError):
    """A virtual table is configured or planned in a way the tiers cannot run."""


def is_virtual(config: BaseEmbeddingConfig) -> bool:
    return bool(getattr(config, "use_virtual_table", False))


def row_init(config: BaseEmbeddingConfig) -> IdAddressedInit:
    """How a virtual table's rows are made: its ``init_fn`` when that fills rows by id,
    otherwise :class:`IdSeededUniform` over TorchRec's range for the table, seeded by its
    name (the values TorchRec's default draws from, as a function of the id)."""
    if isinstance(config.init_fn, IdAddressedInit):
        return config.init_fn
    return IdSeededUniform.for_config(config)


def check_virtual_tables(
    configs: Iterable[BaseEmbeddingConfig],
    params: Mapping[str, ParameterSharding],
    hot_rows: Mapping[str, Any] | None = None,
) -> None:
    """Refuses, naming the table and the option, a virtual table planned in a way the tiers
    cannot run it (checked when the sharder shards the module, before anything is built)."""
    for config in configs:
        if not is_virtual(config):
            continue
        name = config.name
        ps = params.get(name)
        if ps is None:
            continue
        if ps.compute_kernel != TIERED_KERNEL or not isinstance(ps, TieredParameterSharding):
            raise VirtualTableError(
                f"table {name!r} is a virtual table (use_virtual_table=True): plan it on the "
                f"tiered kernel with TieredParameterSharding and {OPTION} (TorchRec's own "
                "virtual-table kernels are CUDA-only and not in the public fbgemm wheels)"
            )
        if ps.sharding_type not in VIRTUAL_SHARDING_TYPES:
            raise VirtualTableError(
                f"virtual table {name!r}: sharding type {ps.sharding_type!r} is not supported; "
                f"use {' or '.join(VIRTUAL_SHARDING_TYPES)}"
            )
        if ps.tier_options.max_live_rows is None:
            raise VirtualTableError(
                f"virtual table {name!r}: set {OPTION}, the most ids it holds at once (its "
                "store's rows)"
            )
        if not 0 < config.num_embeddings <= MAX_VIRTUAL_ROWS:
            raise VirtualTableError(
                f"virtual table {name!r}: num_embeddings={config.num_embeddings} must be in "
                f"[1, 2**50]"
            )
        if ps.sharding_type == ShardingType.ROW_WISE.value:
            _check_buckets(config, ps)
        EvictionRule.from_policy(
            name, getattr(config, "virtual_table_eviction_policy", None), config.feature_names
        )
        if hot_rows and name in hot_rows:
            raise VirtualTableError(
                f"virtual table {name!r}: hot_rows cannot pin rows of a virtual table (its ids "
                "get rows when first trained)"
            )
        if getattr(config, "enable_embedding_update", False):
            raise VirtualTableError(
                f"virtual table {name!r}: enable_embedding_update is not supported on a tier"
            )


def bucket_rows(num_embeddings: int, buckets: int, world_size: int) -> list[int]:
    """Ids per rank of a row-wise virtual table as TorchRec's bucketized input distribution
    routes them: whole buckets of ``num_embeddings // buckets`` ids, the first
    ``buckets % world_size`` ranks one bucket more."""
    size = num_embeddings // buckets
    return [size * (buckets // world_size + (r < buckets % world_size)) for r in range(world_size)]


def _check_buckets(config: BaseEmbeddingConfig, ps: ParameterSharding) -> None:
    name = config.name
    buckets = getattr(config, "total_num_buckets", None)
    spec = ps.sharding_spec
    shards = sorted(getattr(spec, "shards", []) or [], key=lambda m: int(m.shard_offsets[0]))
    if buckets is None:
        return  # TorchRec routes by an even split, as the plan's
    if config.num_embeddings % buckets:
        raise VirtualTableError(
            f"virtual table {name!r}: num_embeddings={config.num_embeddings} is not a multiple "
            f"of total_num_buckets={buckets}"
        )
    if buckets < len(shards):
        raise VirtualTableError(
            f"virtual table {name!r}: total_num_buckets={buckets} is fewer than the "
            f"{len(shards)} ranks it is sharded over (a bucket cannot be split)"
        )
    expected = bucket_rows(config.num_embeddings, buckets, len(shards))
    planned = [int(m.shard_sizes[0]) for m in shards]
    if shards and planned != expected:
        raise VirtualTableError(
            f"virtual table {name!r}: the plan's row-wise shards hold {planned} ids, but "
            f"TorchRec's input distribution routes {expected} by its {buckets} buckets; plan it "
            f"with row_wise(num_buckets={buckets}) or TorchRec's planner"
        )


def shard_capacity(max_live_rows: int, shard_rows: int, num_embeddings: int) -> int:
    """Store rows of a shard holding ``shard_rows`` of a virtual table's ``num_embeddings``
    ids: its share of ``max_live_rows``, at least one row."""
    return max(1, math.ceil(max_live_rows * shard_rows / num_embeddings))


def physical_rows(
    shards: Sequence[tuple[int, int]], max_live_rows: int, num_embeddings: int
) -> list[tuple[int, int]]:
    """The store extents ``(first row, rows)`` of a virtual table's shards, given as ``(first
    id, ids)`` in id order: each its share of ``max_live_rows``, stacked in id order (column
    shards of the same ids share an extent)."""
    starts: dict[int, int] = {}
    out: list[tuple[int, int]] = []
    row = 0
    for first, ids in shards:
        capacity = shard_capacity(max_live_rows, ids, num_embeddings)
        if first not in starts:
            starts[first] = row
            row += capacity
        out.append((starts[first], capacity))
    return out


@dataclass(frozen=True)
class VirtualSpec:
    """What a virtual table's config says of its rows, for its kernels (TorchRec hands them
    neither the ``init_fn`` nor, table-wise, the eviction policy)."""

    init: IdAddressedInit
    eviction: EvictionRule

    @classmethod
    def of(cls, config: BaseEmbeddingConfig) -> VirtualSpec:
        policy = getattr(config, "virtual_table_eviction_policy", None)
        return cls(
            row_init(config), EvictionRule.from_policy(config.name, policy, config.feature_names)
        )


@dataclass(frozen=True)
class VirtualShard:
    """The id space of one virtual table shard, beside its store.

    Attributes:
        ids: how many ids the input distribution can hand this shard: they lie in
            ``[0, ids)`` here, ``[id_offset, id_offset + ids)`` in the table.
        id_offset: the table's id of the shard's id 0 (row-wise: the shard's first bucket).
        capacity: rows of the shard's store, the most ids live at once.
        spec: how rows are made and evicted.
    """

    ids: int
    id_offset: int
    capacity: int
    spec: VirtualSpec


def _physical_md(md: ShardMetadata, row_offset: int, rows: int) -> ShardMetadata:
    offsets = list(md.shard_offsets)
    sizes = list(md.shard_sizes)
    offsets[0], sizes[0] = row_offset, rows
    return ShardMetadata(shard_offsets=offsets, shard_sizes=sizes, placement=md.placement)


def physical_table(
    table: ShardedEmbeddingTable, max_live_rows: int, spec: VirtualSpec
) -> tuple[ShardedEmbeddingTable, VirtualShard]:
    """``table`` (a virtual table shard) on its store's extent, and its id space.

    Every shard of the table is resized to its capacity and the row-wise ones stacked in row
    order, so the global metadata each rank derives agrees without any exchange."""
    local = table.local_metadata
    global_md = table.global_metadata
    if local is None or global_md is None:
        raise VirtualTableError(f"virtual table {table.name!r}: its shard carries no metadata")
    ordered = sorted(global_md.shards_metadata, key=lambda m: tuple(m.shard_offsets))
    extents = physical_rows(
        [(int(m.shard_offsets[0]), int(m.shard_sizes[0])) for m in ordered],
        max_live_rows,
        table.num_embeddings,
    )
    physical = [_physical_md(md, start, rows) for md, (start, rows) in zip(ordered, extents)]
    row = max((start + rows for start, rows in extents), default=0)
    first = int(local.shard_offsets[0])
    starts = {int(md.shard_offsets[0]): start for md, (start, _) in zip(ordered, extents)}
    capacity = shard_capacity(max_live_rows, int(local.shard_sizes[0]), table.num_embeddings)
    new_global = ShardedTensorMetadata(
        shards_metadata=physical,
        size=_resized(global_md.size, row),
        tensor_properties=global_md.tensor_properties,
    )
    shard = VirtualShard(
        ids=int(local.shard_sizes[0]), id_offset=first, capacity=capacity, spec=spec
    )
    return (
        dataclasses.replace(
            table,
            num_embeddings=row,
            local_rows=capacity,
            local_metadata=_physical_md(local, starts[first], capacity),
            global_metadata=new_global,
            dtensor_metadata=None,
        ),
        shard,
    )


def _resized(size: Any, rows: int) -> Any:
    dims = list(size)
    dims[0] = rows
    return type(size)(dims)


def with_virtual_specs(
    options: Mapping[str, TieredTableOptions], configs: Iterable[BaseEmbeddingConfig]
) -> dict[str, TieredTableOptions]:
    """``options`` with each virtual table's :class:`VirtualSpec`, from its config."""
    out = dict(options)
    for config in configs:
        placed = out.get(config.name)
        if is_virtual(config) and placed is not None:
            out[config.name] = dataclasses.replace(placed, virtual=VirtualSpec.of(config))
    return out


def physical_config(
    config: GroupedEmbeddingConfig, options: Mapping[str, TieredTableOptions]
) -> tuple[GroupedEmbeddingConfig, dict[str, VirtualShard]]:
    """``config`` with its virtual tiered tables on their stores' extent (see
    :func:`physical_table`), and the id space of each, by table name."""
    spaces: dict[str, VirtualShard] = {}
    tables = []
    for table in config.embedding_tables:
        placed = options.get(table.name)
        if not is_virtual(table) or placed is None or not is_tiered(table):
            tables.append(table)
            continue
        if placed.max_live_rows is None:
            raise VirtualTableError(f"virtual table {table.name!r}: set {OPTION}")
        spec = placed.virtual
        if spec is None:  # options built without the sharded module: the config's defaults
            spec = VirtualSpec(IdSeededUniform.for_config(table), EvictionRule())
        physical, spaces[table.name] = physical_table(table, placed.max_live_rows, spec)
        tables.append(physical)
    if not spaces:
        return config, spaces
    return dataclasses.replace(config, embedding_tables=tables), spaces
