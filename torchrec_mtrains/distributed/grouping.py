"""Which tables each tiered kernel computes: the groups TorchRec makes when the tables are FUSED.

TorchRec batches a sharding's tables into groups (one fbgemm module each) by a key that includes
the compute kernel, so the tiered tables (``CUSTOMIZED_KERNEL``) would form groups of their own
beside the FUSED ones. The order of those groups decides the order of the lookup's features and
of its output columns: a plan interleaving tiered and resident tables (module order T, F, T)
would return its ``KeyedTensor`` as (T, T, F) where TorchRec's FUSED model returns (T, F, T), and
a model reading ``values()`` by position (a dense layer over the pooled embeddings) would train
each table's columns against another table's weights.

:func:`regroup_as_fused` therefore regroups a sharding's tables with TorchRec's own
``group_tables``, the tiered tables shown to it as FUSED: the groups, their order and the order
of tables in each are exactly those of the same plan with every tiered table on FUSED. A group
holding a tiered table becomes one tiered kernel, which also computes the group's resident
tables (they keep all their rows in its fbgemm module, where TorchRec's kernel would keep them);
the other groups stay TorchRec's. Feature order, output order and the order of the fbgemm
module's tables then all match the FUSED model, so results match it bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from torchrec.distributed.embedding_sharding import group_tables
from torchrec.distributed.embedding_types import (
    EmbeddingComputeKernel,
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
)

from torchrec_mtrains._compat.embedding import (
    groups_per_rank,
    keeps_groups_per_rank,
    set_groups,
    sharded_tables_per_rank,
)

TIERED = EmbeddingComputeKernel.CUSTOMIZED_KERNEL


def is_tiered(table: ShardedEmbeddingTable) -> bool:
    """Whether ``table`` is planned on a storage tier (the tiered kernel's own tables)."""
    return table.compute_kernel == TIERED


def has_tiered(configs: Sequence[GroupedEmbeddingConfig]) -> bool:
    """Whether any of ``configs`` holds a tiered table."""
    return any(is_tiered(t) for config in configs for t in config.embedding_tables)


def _shard_order(table: ShardedEmbeddingTable) -> tuple[int, int]:
    md = table.local_metadata
    if md is None or not md.shard_offsets:
        return 0, 0
    offsets = [*md.shard_offsets, 0, 0]
    return int(offsets[1]), int(offsets[0])  # column shards in column order, then rows


def tables_in_sharding_order(
    sharding: Any, table_names: Sequence[str]
) -> list[list[ShardedEmbeddingTable]]:
    """Each rank's table shards in the order the sharding created them, before grouping: table
    by table in module order (``table_names``), a table's shards in column, then row order.

    Table-wise and column-wise shardings keep that list (see
    :func:`~torchrec_mtrains._compat.embedding.sharded_tables_per_rank`); for the others it is
    rebuilt from the groups, which hold the same shard objects."""
    kept = sharded_tables_per_rank(sharding)
    if kept is not None:
        return kept
    position = {name: i for i, name in enumerate(table_names)}
    per_rank: list[list[ShardedEmbeddingTable]] = []
    for groups in groups_per_rank(sharding):
        tables = [t for group in groups for t in group.embedding_tables]
        missing = sorted({t.name for t in tables if t.name not in position})
        if missing:
            raise ValueError(f"tables {', '.join(missing)} are not tables of this module")
        per_rank.append(sorted(tables, key=lambda t: (position[t.name], *_shard_order(t))))
    return per_rank


def group_as_fused(
    tables_per_rank: Sequence[Sequence[ShardedEmbeddingTable]],
) -> list[list[GroupedEmbeddingConfig]]:
    """Per rank, TorchRec's groups of ``tables_per_rank`` with every tiered table shown as
    FUSED; a group holding a tiered table is marked for the tiered kernel and lists the real
    tables (tiered ones keep their kernel, so the kernel tells them from its resident ones)."""
    shown: list[list[ShardedEmbeddingTable]] = []
    real: dict[int, ShardedEmbeddingTable] = {}
    for tables in tables_per_rank:
        rank_shown = []
        for table in tables:
            view = (
                dataclasses.replace(table, compute_kernel=EmbeddingComputeKernel.FUSED)
                if is_tiered(table)
                else table
            )
            real[id(view)] = table
            rank_shown.append(view)
        shown.append(rank_shown)
    out: list[list[GroupedEmbeddingConfig]] = []
    for groups in group_tables(shown):
        rank_groups = []
        for group in groups:
            tables = [real[id(t)] for t in group.embedding_tables]
            if any(is_tiered(t) for t in tables):
                group = dataclasses.replace(group, compute_kernel=TIERED, embedding_tables=tables)
            rank_groups.append(group)
        out.append(rank_groups)
    return out


def regroup_as_fused(sharding: Any, table_names: Sequence[str]) -> None:
    """Regroups ``sharding``'s tables on every rank as :func:`group_as_fused` does, in place,
    before its lookups, input and output distributions are built (they all read the groups).

    Args:
        sharding: a table-, column-, table-column- or row-wise TorchRec embedding sharding.
        table_names: the module's tables in its order (the order TorchRec shards them in).

    Raises:
        TypeError: for a sharding that does not keep its groups per rank (the tiered sharders
            do not offer such sharding types for tiered tables).
    """
    if not keeps_groups_per_rank(sharding):
        raise TypeError(
            f"{type(sharding).__name__} keeps no per-rank table groups; tiered tables need a "
            "table-, column- or row-wise sharding"
        )
    # Column-wise: the order that reassembles a table's column shards follows the groups.
    set_groups(sharding, group_as_fused(tables_in_sharding_order(sharding, table_names)))
