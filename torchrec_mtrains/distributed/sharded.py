"""Sharded EmbeddingBagCollection / EmbeddingCollection that host tiered tables.

TorchRec's sharded modules build their lookups through the sharding objects, whose kernel factory
raises for ``CUSTOMIZED_KERNEL``, and skip such tables when they build state dicts. These
subclasses supply grouped lookups that create the tiered kernels, expose each tiered table as a
``ShardedTensor`` viewing its tier (split into row chunks, so checkpointing never materializes a
table), load state dicts into the tiers chunk by chunk, and initialize tiered tables chunk by
chunk; a virtual table's state dict entries are its live rows, built at each call (see
:mod:`.virtual_state`). Tables on TorchRec's own kernels are untouched.

Why one file over ~600 lines: the EBC and EC subclasses share one mixin, and its state handling
(views, chunking, loads, virtual tables' live rows) runs from TorchRec's hooks on the module;
each part reads with those hooks beside it. The row-level work lives in the modules it calls.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import (
    GroupedEmbeddingsLookup,
    GroupedPooledEmbeddingsLookup,
)
from torchrec.distributed.embedding_types import EmbeddingComputeKernel, GroupedEmbeddingConfig
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains._compat import embedding as compat
from torchrec_mtrains._compat.torch_internals import (
    Shard,
    ShardedTensor,
    ShardMetadata,
    TensorProperties,
    prepend_load_state_dict_pre_hook,
)
from torchrec_mtrains.distributed.grouping import has_tiered, regroup_as_fused
from torchrec_mtrains.distributed.id_bounds import IdBoundsCheck
from torchrec_mtrains.distributed.kernel import TieredEmbedding, TieredEmbeddingBag
from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    BoundsCheck,
    TieredTableOptions,
    TierStorage,
    tier_options_by_table,
)
from torchrec_mtrains.distributed.sharded_state import (
    TIER_DEVICE,
    all_on_host,
    chunk_sharded_tensor,
    init_sharded_tensor,
)
from torchrec_mtrains.distributed.table_shard import TieredTableShard
from torchrec_mtrains.distributed.tier_rows_param import TierRowsParameter
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.distributed.virtual_state import (
    BUCKET_KEY,
    EVICTED_KEY,
    ID_KEY,
    METADATA_KEY,
    SAVING_CHANGES,
    SINCE_COLUMNS,
    SINCE_KEY,
    LiveRows,
    bucket_counts,
    evicted_since,
    gather_incoming,
    load_rows,
    read_live_rows,
    select_range,
    since_parent,
    stacked,
)
from torchrec_mtrains.distributed.virtual_state import (
    gather_sizes as _gather_sizes,
)
from torchrec_mtrains.distributed.virtual_tables import VirtualSpec, is_virtual, with_virtual_specs
from torchrec_mtrains.initializers import RowAddressedInit

if TYPE_CHECKING:  # what the mixins below are combined with (Any to mypy)
    from torchrec.distributed.embedding_lookup import BaseEmbeddingLookup as _LookupBase
    from torchrec.distributed.embedding_types import ShardedEmbeddingModule as _ShardedBase
else:
    _LookupBase = _ShardedBase = object

logger: logging.Logger = logging.getLogger(__name__)

_CUSTOM = EmbeddingComputeKernel.CUSTOMIZED_KERNEL


class _TieredLookupMixin(_LookupBase):
    """Storage for the tiered kernels a grouped lookup creates, and their prefetch (TorchRec's
    lookups only prefetch its own caching kernels)."""

    _tier_storage: TierStorage
    _tier_options: Mapping[str, TieredTableOptions]

    def __init__(
        self,
        *,
        storage: TierStorage,
        table_options: Mapping[str, TieredTableOptions],
        **kwargs: Any,
    ) -> None:
        # Set before TorchRec's constructor, which creates the kernels.
        object.__setattr__(self, "_tier_storage", storage)
        object.__setattr__(self, "_tier_options", dict(table_options))
        super().__init__(**kwargs)

    def prefetch(
        self, sparse_features: KeyedJaggedTensor, forward_stream: Any | None = None
    ) -> None:
        super().prefetch(sparse_features, forward_stream)
        kernels = compat.lookup_kernels(self)
        if not kernels:
            return
        splits = compat.lookup_feature_splits(self)
        for kernel, features in zip(kernels, sparse_features.split(splits)):
            if isinstance(kernel, (TieredEmbeddingBag, TieredEmbedding)):
                kernel.prefetch(features)


class TieredGroupedPooledEmbeddingsLookup(_TieredLookupMixin, GroupedPooledEmbeddingsLookup):
    """Grouped pooled lookup that builds :class:`TieredEmbeddingBag` for tiered groups."""

    def _create_embedding_kernel(  # TorchRec's hook: compat.POOLED_CREATE_KERNEL
        self,
        config: GroupedEmbeddingConfig,
        device: torch.device | None,
        pg: dist.ProcessGroup | None,
        sharding_type: ShardingType | None,
        env: ShardingEnv | None,
    ) -> Any:
        if config.compute_kernel == _CUSTOM:
            return TieredEmbeddingBag(
                config, self._tier_storage, self._tier_options, pg, device, sharding_type
            )
        return compat.torchrec_create_pooled_kernel(self, config, device, pg, sharding_type, env)


class TieredGroupedEmbeddingsLookup(_TieredLookupMixin, GroupedEmbeddingsLookup):
    """Grouped sequence lookup that builds :class:`TieredEmbedding` for tiered groups."""

    def _create_embedding_kernel(  # TorchRec's hook: compat.SEQUENCE_CREATE_KERNEL
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        device: torch.device | None,
        env: ShardingEnv | None = None,
    ) -> Any:
        if config.compute_kernel == _CUSTOM:
            return TieredEmbedding(config, self._tier_storage, self._tier_options, pg, device)
        return compat.torchrec_create_sequence_kernel(self, config, pg, device, env)


class _TieredShardedMixin(_ShardedBase):
    """State handling shared by the tiered sharded EBC and EC.

    Subclasses set ``_tables_attr`` (``embedding_bags`` / ``embeddings``, where the module's
    state dict keeps its tables)."""

    _tables_attr: str
    _tier_storage: TierStorage
    _tier_hot_rows: Mapping[str, Sequence[int]]
    _id_check: IdBoundsCheck

    def __init__(
        self,
        *args: Any,
        storage: TierStorage,
        hot_rows: Mapping[str, Sequence[int]] | None = None,
        bounds_check: BoundsCheck = BoundsCheck.ERROR,
        **kwargs: Any,
    ) -> None:
        # Set before TorchRec's constructor, which builds the lookups and state through the
        # overridden hooks below.
        object.__setattr__(self, "_tier_storage", storage)
        check = IdBoundsCheck(self._configs, BoundsCheck.parse(bounds_check))
        object.__setattr__(self, "_id_check", check)
        object.__setattr__(self, "_tier_hot_rows", dict(hot_rows or {}))
        super().__init__(*args, **kwargs)
        # The tiers read a FeatureScoreBasedEvictionPolicy's scores from the policy itself
        # (see virtual_eviction). TorchRec's auto collection would put them in the input's
        # weights, which every kernel of the module pools by, fbgemm's FUSED ones included
        # (0.0 for tables without the policy), and would refuse a weighted EBC's input.
        compat.keep_feature_scores_out_of_weights(self)

    def _configs(self) -> list[BaseEmbeddingConfig]:
        return compat.table_configs(self)

    def _config_by_name(self) -> Mapping[str, BaseEmbeddingConfig]:
        return {c.name: c for c in self._configs()}

    def input_dist(self, ctx: Any, features: Any) -> Any:
        return super().input_dist(ctx, self._check_ids(features))

    def _check_ids(self, features: Any) -> Any:
        """The batch as the module's bounds check lets it in (see :class:`IdBoundsCheck`)."""
        return self._id_check.apply(features)

    def id_bounds_check(self) -> IdBoundsCheck:
        """The module's bounds check, for a pipeline to run on a batch still on the host (see
        :class:`~torchrec_mtrains.distributed.id_bounds.HostBoundsCheck`)."""
        return self._id_check

    def _initialize_torch_state(self, skip_registering: bool = False) -> None:
        # TorchRec's hook (compat.*_INITIALIZE_TORCH_STATE): its state, then the tiered ones'.
        compat.torchrec_initialize_torch_state(self, skip_registering)
        self._register_tiered_state()
        self._chunk_other_tables()
        if not skip_registering:
            self.register_load_state_dict_pre_hook(_tiered_load_hook)
            # Before TorchRec's own hook, which would concatenate the chunks into a copy.
            prepend_load_state_dict_pre_hook(self, _chunked_tables_load_hook)
            # TorchRec copies the resident tables in after the pre-hooks: a load, not training.
            self.register_load_state_dict_post_hook(_loaded_hook)
            if self._virtual_table_names():
                self.register_state_dict_post_hook(_virtual_state_hook)

    def _chunk_other_tables(self) -> None:
        """Row chunks in the state dict for this module's other tables too (TorchRec's own
        DRAM/HBM kernels). Their weights are views into their kernel's one flat buffer, and a
        checkpoint writer clones a view that does not own its storage: a table of several GiB
        would be copied whole at once. Only tables whose every shard spans all columns, one
        per rank (table- or row-wise), so a rank's chunks are consecutive rows of one shard."""
        chunk = self._tier_storage.checkpoint_chunk_rows
        tiered = set(self._tiered_table_names())
        originals: dict[str, ShardedTensor] = {}
        tensors = compat.sharded_tensors(self)
        for name, tensor in list(tensors.items()):
            if name in tiered or not isinstance(tensor, ShardedTensor):
                continue
            md = tensor.metadata()
            placements = [str(s.placement) for s in md.shards_metadata]
            if (
                len(md.size) != 2
                or any(s.shard_sizes[1] != md.size[1] for s in md.shards_metadata)
                or len(set(placements)) != len(placements)
                or all(s.shard_sizes[0] <= chunk for s in md.shards_metadata)
            ):
                continue
            tensors[name] = chunk_sharded_tensor(
                tensor, chunk, compat.module_env(self).process_group
            )
            originals[name] = tensor
        self.__dict__["_unchunked_tables"] = originals

    def _load_chunked_tables(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Copies chunked (non-tiered) tables from ``state_dict`` chunk by chunk (nothing when
        they are this module's own views, as after ``dcp.load`` into its state dict), then
        hands TorchRec the table as it built it (one local shard, viewing the kernel), which
        it copies onto itself: given the chunks it would concatenate them into a copy."""
        for name, original in self.__dict__.get("_unchunked_tables", {}).items():
            key = f"{prefix}{self._tables_attr}.{name}.weight"
            value = state_dict.get(key)
            if not isinstance(value, ShardedTensor):
                continue
            mine = compat.sharded_tensors(self)[name].local_shards()
            theirs = {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
            if not mine or set(theirs) != {tuple(s.metadata.shard_offsets) for s in mine}:
                continue  # another layout: TorchRec's hook handles it
            with torch.no_grad():
                for shard in mine:
                    src = theirs[tuple(shard.metadata.shard_offsets)]
                    if src.data_ptr() != shard.tensor.data_ptr():
                        shard.tensor.copy_(src)
            state_dict[key] = original

    def reset_parameters(self) -> None:
        device = compat.module_device(self)
        if device is not None and device.type == "meta":
            return
        # TorchRec's reset initializes every table through its registered weight; tiered
        # tables have none and are initialized chunk by chunk on their tiers instead. Tables
        # whose init_fn fills rows by their place in the table are filled shard by shard at
        # their offsets (TorchRec hands init_fn a rank's rows without them).
        tiered = set(self._tiered_table_names())
        addressed = [
            c
            for c in self._configs()
            if c.name not in tiered and isinstance(c.init_fn, RowAddressedInit)
        ]
        with compat.tables_hidden(self, tiered | {c.name for c in addressed}):
            super().reset_parameters()
        for config in addressed:
            self._fill_by_offsets(config.name, config.init_fn)
        self._reset_tiered_parameters()

    @torch.no_grad()
    def _fill_by_offsets(self, table: str, init_fn: RowAddressedInit) -> None:
        """Fills this rank's shards of a table on TorchRec's kernels, each at its offsets."""
        tensor = compat.sharded_tensors(self).get(table)
        if isinstance(tensor, ShardedTensor):
            for shard in tensor.local_shards():
                row, col = [*shard.metadata.shard_offsets, 0, 0][:2]
                init_fn.fill(shard.tensor, int(row), int(col))
        elif isinstance(tensor, torch.Tensor):  # data-parallel: the whole table on every rank
            init_fn.fill(tensor, 0, 0)

    def _regrouped(self, sharding: Any) -> list[GroupedEmbeddingConfig]:
        """This rank's table groups of ``sharding``, regrouped as for an all-FUSED plan when any
        rank's groups hold a tiered table (see :mod:`~torchrec_mtrains.distributed.grouping`),
        so the lookups, the input and the output distribution built from them put features and
        output columns where TorchRec's FUSED model puts them."""
        if any(has_tiered(configs) for configs in compat.groups_per_rank(sharding)):
            regroup_as_fused(sharding, [c.name for c in self._configs()])
        return compat.groups(sharding)

    def _tiered_table_names(self) -> list[str]:
        return [
            name
            for name, ps in self.module_sharding_plan.items()
            if ps.compute_kernel == TIERED_KERNEL
        ]

    def _virtual_table_names(self) -> list[str]:
        tiered = set(self._tiered_table_names())
        return [c.name for c in self._configs() if is_virtual(c) and c.name in tiered]

    def _kernel_table_options(self) -> dict[str, TieredTableOptions]:
        """Each tiered table's options for its kernel, a virtual table's with its spec."""
        return with_virtual_specs(tier_options_by_table(self.module_sharding_plan), self._configs())

    def tiered_groups(self) -> Iterator[TieredTableGroup]:
        """The tier/cache state of every tiered kernel on this rank (TorchRec hides lookups
        from ``named_modules()``)."""
        for lookup in compat.module_lookups(self):
            for kernel in compat.lookup_kernels(lookup):
                if isinstance(kernel, (TieredEmbeddingBag, TieredEmbedding)):
                    yield kernel.tiers

    def _tiered_shards(
        self, table: str
    ) -> Iterator[tuple[TieredTableGroup, int, TieredTableShard]]:
        for group in self.tiered_groups():
            for i, shard in enumerate(group.shards):
                if shard.name == table:
                    yield group, i, shard

    def out_of_range_ids(self) -> dict[str, int]:
        """Out-of-range ids replaced by row 0 so far (``WARN`` only), per table."""
        return self._id_check.out_of_range_ids()

    def _register_tiered_state(self) -> None:
        """Builds a chunked, tier-backed ShardedTensor per tiered table for state dicts."""
        pg = compat.module_env(self).process_group
        configs = self._config_by_name()
        virtual = set(self._virtual_table_names())
        for name in self._tiered_table_names():
            if name in virtual:  # live rows, built per state dict: see _virtual_state_entries
                continue
            self._expose_rows(name)
            local = [
                Shard(group.views.weight_view(i), _local_metadata(shard))
                for group, i, shard in self._tiered_shards(name)
            ]
            spec = self.module_sharding_plan[name].sharding_spec
            config = configs[name]
            global_md = all_on_host(
                spec.build_metadata(
                    tensor_sizes=torch.Size([config.num_embeddings, config.embedding_dim]),
                    tensor_properties=TensorProperties(dtype=data_type_to_dtype(config.data_type)),
                )
            )
            whole = init_sharded_tensor(local, global_md, pg)
            compat.sharded_tensors(self)[name] = chunk_sharded_tensor(
                whole, self._tier_storage.checkpoint_chunk_rows, pg
            )
        self._chunk_optimizer_state(pg)

    def _expose_rows(self, name: str) -> None:
        """Gives a tiered table with one shard on this rank the ``weight`` attribute TorchRec's
        FUSED table has (``embedding_bags.<table>.weight``, its local rows), indexed by row:
        see :class:`TierRowsParameter`. Not registered, so no optimizer or state dict sees it."""
        shards = list(self._tiered_shards(name))
        if len(shards) == 1:
            group, index, _ = shards[0]
            tables = getattr(self, self._tables_attr)
            tables[name].__dict__["weight"] = TierRowsParameter(group, index)

    def _chunk_optimizer_state(self, pg: dist.ProcessGroup | None) -> None:
        """Splits the tier-backed optimizer states into row chunks too (same reason). The
        kernel's resident tables keep theirs as TorchRec's FUSED kernel lays them out."""
        chunk = self._tier_storage.checkpoint_chunk_rows
        tiered = [f"{name}.weight" for name in self._tiered_table_names()]
        for lookup in compat.module_lookups(self):
            for kernel in compat.lookup_kernels(lookup):
                if not isinstance(kernel, (TieredEmbeddingBag, TieredEmbedding)):
                    continue
                optimizer = kernel.fused_optimizer
                for name, param in optimizer.params.items():
                    # Keys are "<table>.weight", prefixed by the module path once registered.
                    if not any(name == key or name.endswith(f".{key}") for key in tiered):
                        continue
                    states = optimizer.unsynced_state[param]
                    for key, value in list(states.items()):
                        if isinstance(value, ShardedTensor):
                            states[key] = chunk_sharded_tensor(value, chunk, pg)

    def _reset_tiered_parameters(self) -> None:
        configs = self._config_by_name()
        chunk = self._tier_storage.checkpoint_chunk_rows
        for name in self._tiered_table_names():
            init_fn = configs[name].init_fn
            if init_fn is None:
                raise ValueError(f"table {name!r} has no init_fn")
            for group, _, shard in self._tiered_shards(name):
                if shard.virtual is not None:
                    continue  # its rows are made when their ids are first trained
                if shard.created and self._tier_storage.initialize_created:
                    group.initialize(shard, init_fn, chunk)
        self._pin_hot_rows()

    def _pin_hot_rows(self) -> None:
        """Pins each tiered table's profiled hot rows (global ids) in the caches of the shards
        that hold them."""
        for name, global_ids in self._tier_hot_rows.items():
            ids = torch.as_tensor(list(global_ids), dtype=torch.int64)
            for group, index, shard in self._tiered_shards(name):
                mine = ids[(ids >= shard.row_offset) & (ids < shard.row_offset + shard.local_rows)]
                group.pin_hot_rows(index, mine - shard.row_offset)

    def _load_tiered_state(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Copies tiered tables out of ``state_dict`` into their tiers, chunk by chunk, and
        removes their keys so TorchRec's own loading skips them. (TorchRec's pre-load hook
        has purged the caches, taking in what was written through the views before.)"""
        self._load_virtual_state(state_dict, prefix)
        loaded: set[int] = set()
        virtual = set(self._virtual_table_names())
        for name in self._tiered_table_names():
            if name in virtual:
                continue
            key = f"{prefix}{self._tables_attr}.{name}.weight"
            if key not in state_dict:
                continue
            value = state_dict.pop(key)
            mine = compat.sharded_tensors(self)[name]
            for group, i, _ in self._tiered_shards(name):
                if value is mine:  # its own views: what they hold is stored as the tier's
                    group.views.store_as_tier(i)
                else:  # foreign rows go through the views: bring copies up to date
                    group.views.mark_written(i)
            loaded.update(id(group) for group, _, _ in self._tiered_shards(name))
            with torch.no_grad():
                if isinstance(value, ShardedTensor):
                    _copy_sharded(value, mine, name)
                elif isinstance(value, torch.Tensor):
                    for shard in mine.local_shards():
                        rows = slice(
                            shard.metadata.shard_offsets[0],
                            shard.metadata.shard_offsets[0] + shard.metadata.shard_sizes[0],
                        )
                        cols = slice(
                            shard.metadata.shard_offsets[1],
                            shard.metadata.shard_offsets[1] + shard.metadata.shard_sizes[1],
                        )
                        shard.tensor.copy_(value[rows, cols])
                else:
                    raise TypeError(f"state_dict[{key!r}]: unexpected type {type(value).__name__}")
        for group in self.tiered_groups():
            if id(group) in loaded:
                group.absorb_view_writes(loaded=True)

    def _virtual_shards(self, name: str) -> list[tuple[TieredTableGroup, int, TieredTableShard]]:
        return [(g, i, sh) for g, i, sh in self._tiered_shards(name) if sh.virtual is not None]

    def _virtual_state_entries(self, prefix: str) -> dict[str, Any]:
        """The virtual tables' state-dict entries (see :mod:`.virtual_state`): every rank
        takes part (one all-gather of live counts)."""
        names = self._virtual_table_names()
        configs = self._config_by_name()
        env = compat.module_env(self)
        pg, rank = (
            env.process_group,
            dist.get_rank(env.process_group) if dist.is_initialized() else 0,
        )
        increment = SAVING_CHANGES.get()
        local: list[tuple[LiveRows, torch.Tensor]] = []
        # an incremental checkpoint's: per table, ids evicted since the last, and since_parent
        changes: list[tuple[torch.Tensor, torch.Tensor]] = []
        flushed: set[int] = set()
        for name in names:
            shards = self._virtual_shards(name)
            if len(shards) > 1:
                raise ValueError(f"virtual table {name!r}: more than one shard on a rank")
            config = configs[name]
            buckets = getattr(config, "total_num_buckets", None)
            if not shards:
                dtype = data_type_to_dtype(config.data_type)
                columns = len(VirtualSpec.of(config).eviction.columns)
                empty = LiveRows(
                    torch.empty(0, dtype=torch.int64),
                    torch.empty(0, config.embedding_dim, dtype=dtype),
                    [],
                    torch.empty(0, columns, dtype=torch.float64),
                )
                local.append((empty, torch.empty(0, 1, dtype=torch.int64)))
                if increment:
                    none = torch.empty(0, 1, dtype=torch.int64)
                    changes.append((none, torch.empty(0, len(SINCE_COLUMNS), dtype=torch.int64)))
                continue
            group, _, shard = shards[0]
            if id(group) not in flushed:  # its rows are read from the tiers
                group.flush()
                flushed.add(id(group))
            rows = read_live_rows(shard, states=False)  # (its optimizer's state dict has them)
            assert shard.virtual is not None
            if increment:
                changes.append((evicted_since(shard), since_parent(shard)))
            space = shard.virtual.space
            if buckets is None:  # TorchRec's default: a bucket per shard
                local.append((rows, torch.tensor([[len(rows.ids)]], dtype=torch.int64)))
                continue
            counts, _ = bucket_counts(rows.ids, config.num_embeddings, buckets)
            size = config.num_embeddings // buckets
            first, last = space.id_offset // size, (space.id_offset + space.ids) // size
            local.append((rows, counts[first:last]))
        # per table: live rows, buckets (and an increment's evicted ids and shard records)
        local_sizes = [[len(r.ids), len(b)] for r, b in local]
        for count, (evicted, since) in zip(local_sizes, changes):
            count += [len(evicted), len(since)]
        sizes = _gather_sizes(local_sizes, pg)
        out: dict[str, Any] = {}
        for t, (name, (rows, bucket)) in enumerate(zip(names, local)):
            key = f"{prefix}{self._tables_attr}.{name}"
            live = [per_rank[t][0] for per_rank in sizes]
            out[f"{key}.weight"] = stacked(rows.weights, live, rank, pg)
            out[f"{key}.{ID_KEY}"] = stacked(rows.ids.reshape(-1, 1), live, rank, pg)
            out[f"{key}.{BUCKET_KEY}"] = stacked(
                bucket, [per_rank[t][1] for per_rank in sizes], rank, pg
            )
            if rows.metadata.shape[1]:  # a table that evicts
                out[f"{key}.{METADATA_KEY}"] = stacked(rows.metadata, live, rank, pg)
            if increment:
                evicted, since = changes[t]
                for part, value, column in ((EVICTED_KEY, evicted, 2), (SINCE_KEY, since, 3)):
                    counts_t = [per_rank[t][column] for per_rank in sizes]
                    out[f"{key}.{part}"] = stacked(value, counts_t, rank, pg)
        return out

    def _load_virtual_state(self, state_dict: dict[str, Any], prefix: str) -> None:
        """Loads the virtual tables' entries of ``state_dict`` into their shards (TorchRec's
        pre-load hook has purged the caches) and removes them."""
        for name in self._virtual_table_names():
            key = f"{prefix}{self._tables_attr}.{name}"
            weight = state_dict.pop(f"{key}.weight", None)
            ids = state_dict.pop(f"{key}.{ID_KEY}", None)
            metadata = state_dict.pop(f"{key}.{METADATA_KEY}", None)
            state_dict.pop(f"{key}.{BUCKET_KEY}", None)
            if weight is None and ids is None:
                continue
            if weight is None or ids is None:
                raise KeyError(
                    f"virtual table {name!r}: the state dict holds only one of {key}.weight and "
                    f"{key}.{ID_KEY}"
                )
            all_ids, all_rows = gather_incoming(ids), gather_incoming(weight)
            parts = [all_rows]
            if metadata is not None:
                parts.append(gather_incoming(metadata))
            for group, _, shard in self._virtual_shards(name):
                assert shard.virtual is not None
                space = shard.virtual.space
                mine, rows, *meta = select_range(all_ids, space.id_offset, space.ids, *parts)
                group.purge()
                load_rows(shard, mine, rows, None, meta[0] if meta else None)

    def tier_stats(self) -> dict[str, dict[str, float]]:
        """Cache and tier counters per tiered table shard on this rank."""
        out: dict[str, dict[str, float]] = {}
        for group in self.tiered_groups():
            out.update(group.stats())
        return out

    def flush_tiers(self) -> None:
        """Writes every dirty cached row back to its tier and syncs the tiers."""
        for group in self.tiered_groups():
            group.flush()


def _local_metadata(shard: TieredTableShard) -> ShardMetadata:
    """This rank's shard of a tiered table, placed where its rows are (the host), not where
    its cache is (see :data:`TIER_DEVICE`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    return ShardMetadata(
        shard_offsets=[shard.row_offset, shard.col_offset],
        shard_sizes=[shard.local_rows, shard.cols],
        placement=f"rank:{rank}/{TIER_DEVICE}",
    )


def _copy_sharded(src: ShardedTensor, dst: ShardedTensor, table: str) -> None:
    """Copies the overlap of every local shard of ``src`` into the local shards of ``dst``."""
    for d in dst.local_shards():
        d_off, d_size = d.metadata.shard_offsets, d.metadata.shard_sizes
        covered = 0
        for s in src.local_shards():
            s_off, s_size = s.metadata.shard_offsets, s.metadata.shard_sizes
            lo = [max(a, b) for a, b in zip(d_off, s_off)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(d_off, d_size, s_off, s_size)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            if s.tensor.data_ptr() == d.tensor.data_ptr() and s_off == d_off:
                covered += d_size[0] * d_size[1]
                continue  # a view of our own tier: already in place
            d_part = d.tensor[
                lo[0] - d_off[0] : hi[0] - d_off[0], lo[1] - d_off[1] : hi[1] - d_off[1]
            ]
            s_part = s.tensor[
                lo[0] - s_off[0] : hi[0] - s_off[0], lo[1] - s_off[1] : hi[1] - s_off[1]
            ]
            d_part.copy_(s_part)
            covered += (hi[0] - lo[0]) * (hi[1] - lo[1])
        if covered < d_size[0] * d_size[1]:
            raise ValueError(
                f"table {table!r}: state dict holds no data on this rank for rows "
                f"[{d_off[0]}, {d_off[0] + d_size[0]}) cols [{d_off[1]}, {d_off[1] + d_size[1]}); "
                "load a state dict sharded like this model or use torch.distributed.checkpoint"
            )


def _sharding_type_of(sharding: Any) -> ShardingType | None:
    return ShardingType.ROW_WISE if isinstance(sharding, RwPooledEmbeddingSharding) else None


class TieredShardedEmbeddingBagCollection(_TieredShardedMixin, ShardedEmbeddingBagCollection):
    """ShardedEmbeddingBagCollection whose plan may place tables on storage tiers.

    Args:
        storage: where tier files go.
        hot_rows: per tiered table, global row ids pinned in its cache.
        The other arguments are ShardedEmbeddingBagCollection's.
    """

    _tables_attr = "embedding_bags"

    def _create_lookups(self) -> None:  # TorchRec's hook: compat.EBC_CREATE_LOOKUPS
        lookups = compat.module_lookups(self)
        for sharding in compat.module_shardings(self):
            configs = self._regrouped(sharding)
            if not has_tiered(configs):
                lookups.append(sharding.create_lookup())
                continue
            args = compat.lookup_args(sharding)
            lookups.append(
                TieredGroupedPooledEmbeddingsLookup(
                    storage=self._tier_storage,
                    table_options=self._kernel_table_options(),
                    grouped_configs=configs,
                    pg=args.pg,
                    device=args.device,
                    sharding_type=_sharding_type_of(sharding),
                    env=args.env,
                )
            )


class TieredShardedEmbeddingCollection(_TieredShardedMixin, ShardedEmbeddingCollection):
    """ShardedEmbeddingCollection whose plan may place tables on storage tiers; arguments as
    for :class:`TieredShardedEmbeddingBagCollection`."""

    _tables_attr = "embeddings"

    def _create_lookups(self) -> None:  # TorchRec's hook: compat.EC_CREATE_LOOKUPS
        lookups = compat.module_lookups(self)
        for sharding in compat.module_shardings(self):
            configs = self._regrouped(sharding)
            if not has_tiered(configs):
                lookup = sharding.create_lookup()
            else:
                args = compat.lookup_args(sharding)
                lookup = TieredGroupedEmbeddingsLookup(
                    storage=self._tier_storage,
                    table_options=self._kernel_table_options(),
                    grouped_configs=configs,
                    pg=args.pg,
                    device=args.device,
                    env=args.env,
                )
            if self.enable_embedding_update and sharding.enable_embedding_update:
                compat.module_updates(self).append(sharding.create_update(lookup))
            lookups.append(lookup)


def _virtual_state_hook(
    module: _TieredShardedMixin, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    state_dict.update(module._virtual_state_entries(prefix))


def _chunked_tables_load_hook(
    module: _TieredShardedMixin, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    module._load_chunked_tables(state_dict, prefix)


def _loaded_hook(module: _TieredShardedMixin, incompatible_keys: Any) -> None:
    for group in module.tiered_groups():
        group.absorb_view_writes(loaded=True)


def _tiered_load_hook(
    module: _TieredShardedMixin, state_dict: dict[str, Any], prefix: str, *args: Any
) -> None:
    # TorchRec's own pre-load hook (registered first) has already flushed and emptied the
    # caches via lookup.purge(), so the tiers are the only copy and can be written directly.
    module._load_tiered_state(state_dict, prefix)
