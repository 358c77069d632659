"""The tiered embedding kernels: fbgemm's fused table-batched module running over a row cache.

Each kernel builds one ``SplitTableBatchedEmbeddingBagsCodegen`` whose tiered tables have only as
many rows as their caches (in host memory on CPU, in HBM on CUDA). Before every forward the
batch's row ids are turned into cache slots by :class:`TieredTableGroup`, which reads missing
rows from their tier and writes evicted dirty rows back. Forward, backward and the fused
optimizer then run unchanged on the slots, so updates match TorchRec's FUSED kernel row for row.

A kernel computes one of TorchRec's table groups, as TorchRec groups them when the tiered tables
are FUSED (see :mod:`~torchrec_mtrains.distributed.grouping`): its *resident* tables, those the
plan keeps on TorchRec's own kernels, keep all their rows in the module where TorchRec's kernel
would keep them, and their ids go to fbgemm unchanged. So a lookup runs the fbgemm modules the
FUSED model runs, over the same tables in the same order, and its features and output columns
are where TorchRec puts them.

Why one file over ~600 lines: the pooled and the sequence kernel share their mixin and the fused
optimizer that exposes their tiers' state (a virtual table's as live rows); the storage side is
:mod:`.tiered_tables`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.distributed.batched_embedding_kernel import (
    BaseBatchedEmbedding,
    BaseBatchedEmbeddingBag,
    EmbeddingFusedOptimizer,
)
from torchrec.distributed.embedding_kernel import get_state_dict
from torchrec.distributed.embedding_types import (
    GroupedEmbeddingConfig,
    ShardedEmbeddingTable,
    compute_kernel_to_embedding_location,
)
from torchrec.distributed.types import ShardingType
from torchrec.distributed.utils import data_type_to_sparse_type
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains._compat import embedding as compat
from torchrec_mtrains._compat.torch_internals import ShardedTensor
from torchrec_mtrains.distributed.grouping import is_tiered
from torchrec_mtrains.distributed.options import TieredTableOptions, TierStorage
from torchrec_mtrains.distributed.sharded_state import (
    alias_registry,
    all_on_host,
    on_host,
    swap_aliases,
)
from torchrec_mtrains.distributed.tiered_tables import ResidentTable, TieredTableGroup
from torchrec_mtrains.distributed.virtual_eviction import EvictionKind
from torchrec_mtrains.distributed.virtual_state import (
    EVICTED_KEY,
    ID_KEY,
    SAVING_CHANGES,
    evicted_since,
    gather_incoming,
    gather_sizes,
    load_rows,
    read_live_rows,
    select_range,
    stacked,
)
from torchrec_mtrains.distributed.virtual_tables import VirtualShard, physical_config

if TYPE_CHECKING:  # the TorchRec kernel the mixin below is combined with (Any to mypy)
    from torchrec.distributed.embedding_kernel import BaseEmbedding as _KernelBase
else:
    _KernelBase = object

logger: logging.Logger = logging.getLogger(__name__)

# fused-param keys TorchRec or fbgemm use for other kernels that the cache module must not see
# (``cache_load_factor`` sizes fbgemm's own cache, kept for a resident UVM-caching table).
DROPPED_FUSED_PARAMS = ("cache_load_factor", "prefetch_pipeline", "enable_raw_embedding_streaming")
CACHE_LOAD_FACTOR = "cache_load_factor"


def is_resident(table: ShardedEmbeddingTable) -> bool:
    """Whether ``table`` is planned on one of TorchRec's kernels: a tiered kernel computing it
    keeps all its rows in the fbgemm module, with no tier and no cache of ours."""
    return not is_tiered(table)


def _location(table: ShardedEmbeddingTable, on_cuda: bool) -> EmbeddingLocation:
    """Where the module keeps ``table``: a tiered table's cache slots on the compute device, a
    resident table where TorchRec's fused kernel keeps it (HBM, UVM or UVM-cached on CUDA)."""
    if not on_cuda:
        return EmbeddingLocation.HOST
    if is_resident(table):
        return compute_kernel_to_embedding_location(table.compute_kernel)
    return EmbeddingLocation.DEVICE


def _build_cache_module(
    config: GroupedEmbeddingConfig,
    local_cols: list[int],
    feature_table_map: list[int],
    pooling: PoolingMode,
    device: torch.device | None,
    table_options: Mapping[str, TieredTableOptions],
) -> tuple[SplitTableBatchedEmbeddingBagsCodegen, list[TieredTableOptions | None]]:
    """The fbgemm module and, per table, its tier options (``None`` for a resident table)."""
    missing = [
        t.name
        for t in config.embedding_tables
        if not is_resident(t) and t.name not in table_options
    ]
    if missing:
        raise ValueError(
            f"tables {', '.join(missing)} use the tiered kernel but their sharding carries no "
            "tier; plan them with TieredParameterSharding (or the tiered planner)"
        )
    options = [None if is_resident(t) else table_options[t.name] for t in config.embedding_tables]
    on_cuda = device is not None and device.type == "cuda"
    locations = [_location(t, on_cuda) for t in config.embedding_tables]
    fused_params = dict(config.fused_params or {})
    uvm_cached = EmbeddingLocation.MANAGED_CACHING in locations
    for key in DROPPED_FUSED_PARAMS:
        if not (key == CACHE_LOAD_FACTOR and uvm_cached):
            fused_params.pop(key, None)
    compute = ComputeDevice.CUDA if on_cuda else ComputeDevice.CPU
    cache_rows = [
        t.local_rows if o is None else o.cache_rows(t.local_rows)
        for o, t in zip(options, config.embedding_tables)
    ]
    precision = data_type_to_sparse_type(config.data_type)
    fused_params.setdefault("cache_precision", precision)
    module = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[
            (r, c, loc, compute) for r, c, loc in zip(cache_rows, local_cols, locations)
        ],
        feature_table_map=feature_table_map,
        pooling_mode=pooling,
        weights_precision=precision,
        device=device,
        table_names=[t.name for t in config.embedding_tables],
        **fused_params,
    )
    return module, options


def _rank_of(pg: dist.ProcessGroup | None) -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def _placed_on_host(config: GroupedEmbeddingConfig) -> GroupedEmbeddingConfig:
    """``config`` with its tiered tables' shard placements moved to the host: the optimizer's
    ShardedTensors wrap tier views, which live there whatever device holds the cache. Resident
    tables stay where the module keeps them."""
    tables = [
        table
        if is_resident(table)
        else dataclasses.replace(
            table,
            local_metadata=None if table.local_metadata is None else on_host(table.local_metadata),
            global_metadata=None
            if table.global_metadata is None
            else all_on_host(table.global_metadata),
        )
        for table in config.embedding_tables
    ]
    return dataclasses.replace(config, embedding_tables=tables)


class _TierBackedFusedOptimizer(EmbeddingFusedOptimizer):
    """TorchRec's fused optimizer over state tensors that view the tiers.

    The cache holds the newest optimizer state of its rows, so reading the state (TorchRec's
    ``CombinedOptimizer.state_dict()`` reads ``state`` of each optimizer) first writes dirty
    cached rows back, and loading a state dict (copied into the tier views in place, by
    ``load_state_dict`` or by the user, e.g. ``dcp.load``) reaches the tiers and the cached
    rows (see :meth:`TieredTableGroup.absorb_view_writes`). Otherwise a save would miss recent
    updates and a load would be undone by stale cached rows."""

    def __init__(self, *args: Any, tiers: TieredTableGroup, **kwargs: Any) -> None:
        self._tiers = tiers
        self._virtual_pg: dist.ProcessGroup | None = args[2] if len(args) > 2 else kwargs.get("pg")
        # Loaded state of virtual tables, by shard index, until post_load_state_dict.
        self._virtual_loads: dict[int, dict[str, Any]] = {}
        # TorchRec's constructor lists the state's keys, reading no value: syncing then would
        # export a copy of every log-structured table each time a model is built.
        self._sync_on_read = False
        super().__init__(*args, **kwargs)
        self._sync_on_read = True

    @property
    def state(self) -> Any:
        if not self._sync_on_read:
            return self._tier_state
        self._tiers.sync_views()
        virtual = self._virtual_params()
        if not virtual:
            return self._tier_state
        # A virtual table's state: its live rows, as its module's state dict holds them, read
        # from the tiers once the caches are written back.
        self._tiers.flush()
        out = dict(self._tier_state)
        for param, (index, table) in virtual.items():
            out[param] = self._virtual_state(param, index, table)
        return out

    @state.setter
    def state(self, value: Any) -> None:
        self._tier_state = value

    def _virtual_params(self) -> dict[Any, tuple[int, str]]:
        """Virtual tables' params (``<table>.weight``) -> their shard index and table name."""
        shards = {s.name: i for i, s in enumerate(self._tiers.shards) if s.virtual is not None}
        out: dict[Any, tuple[int, str]] = {}
        for name, param in self.params.items():
            table = name.split(".")[-2] if name.endswith(".weight") else name
            if table in shards:
                out[param] = (shards[table], table)
        return out

    def _virtual_state(self, param: Any, index: int, table: str) -> dict[str, Any]:
        """Live-row ShardedTensors of a virtual table's optimizer states and ids (the caller
        has flushed the caches); loading into them (TorchRec's
        ``KeyedOptimizer.load_state_dict`` calls each one's ``load_state_dict``) keeps what is
        loaded until :meth:`post_load_state_dict`."""
        shard = self._tiers.shards[index]
        rows = read_live_rows(shard, weights=False)  # (its module's state dict has them)
        placements = {
            str(md.placement) for md in (shard_global_shards(self._tier_state[param]) or [])
        }
        rank = dist.get_rank(self._virtual_pg) if dist.is_initialized() else 0
        world = dist.get_world_size(self._virtual_pg) if dist.is_initialized() else 1
        # an incremental checkpoint's: the ids evicted since the last one
        evicted = evicted_since(shard) if SAVING_CHANGES.get() else None
        local = [len(rows.ids), 0 if evicted is None else len(evicted)]
        if len(placements) > 1:  # row-wise: every rank holds a shard and takes part
            sizes = [c[0] for c in gather_sizes([local], self._virtual_pg)]
        else:  # table-wise: this rank alone holds it
            sizes = [local if r == rank else [0, 0] for r in range(world)]
        keys = list(self._tier_state[param].keys())
        parts = {k: v for k, v in zip(keys, rows.states)}
        parts[f"{table}.{ID_KEY}"] = rows.ids.reshape(-1, 1)
        out: dict[str, Any] = {}
        for key, value in parts.items():
            st = stacked(value, [s[0] for s in sizes], rank, self._virtual_pg)
            # What TorchRec's KeyedOptimizer.load_state_dict calls with the loaded value.
            setattr(st, "load_state_dict", functools.partial(self._keep_loaded, index, key))  # noqa: B010
            out[key] = st
        if evicted is not None:
            counts = [s[1] for s in sizes]
            out[f"{table}.{EVICTED_KEY}"] = stacked(evicted, counts, rank, self._virtual_pg)
        return out

    def _keep_loaded(self, index: int, key: str, value: Any) -> None:
        self._virtual_loads.setdefault(index, {})[key] = value

    @property
    def unsynced_state(self) -> Any:
        """``state`` without bringing the views up to date: for re-wrapping its tensors, which
        reads nothing (syncing would export every log-structured table)."""
        return self._tier_state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        # What was written through the views before is taken in first (a state dict the user
        # loaded in place, e.g. with dcp). State that is not this optimizer's own views is
        # copied into them: copies of log-structured tables must be current first (see
        # TierViews.mark_written).
        self._tiers.absorb_view_writes()
        own = {id(v) for states in self._tier_state.values() for v in states.values()}
        foreign = any(
            id(v) not in own for states in state_dict["state"].values() for v in states.values()
        )
        if foreign:
            for index, shard in enumerate(self._tiers.shards):
                if shard.virtual is None:  # (a virtual table's load goes by ids)
                    self._tiers.views.mark_written(index)
        super().load_state_dict(state_dict)

    def post_load_state_dict(self) -> None:
        super().post_load_state_dict()
        loads, self._virtual_loads = self._virtual_loads, {}
        for index, entries in loads.items():
            shard = self._tiers.shards[index]
            assert shard.virtual is not None
            id_key = next((k for k in entries if k.endswith(f".{ID_KEY}")), None)
            if id_key is None:
                raise KeyError(f"virtual table {shard.name!r}: the optimizer state has no ids")
            ids = gather_incoming(entries.pop(id_key))
            names = [k for k in self._tier_state_keys(index) if k in entries]
            space = shard.virtual.space
            mine, *states = select_range(
                ids, space.id_offset, space.ids, *(gather_incoming(entries[k]) for k in names)
            )
            self._tiers.purge()
            load_rows(shard, mine, None, states)
        # The loaded state goes to the tiers and to the cached rows (whose weights stay).
        # (DMP's combined optimizer loads into this one's state and calls this alone.)
        self._tiers.absorb_view_writes(loaded=True)

    def _tier_state_keys(self, index: int) -> list[str]:
        """TorchRec's names of the optimizer states of shard ``index``, in fbgemm's order."""
        for param, (i, _) in self._virtual_params().items():
            if i == index:
                return list(self._tier_state[param].keys())
        return []


def shard_global_shards(states: Mapping[str, Any]) -> list[Any] | None:
    """The global shard metadata of the first ShardedTensor among ``states``."""
    for value in states.values():
        if isinstance(value, ShardedTensor):
            return list(value.metadata().shards_metadata)
    return None


class _TieredKernelMixin(_KernelBase):
    """What the pooled and the sequence tiered kernels share: the cache module, the tier-backed
    optimizer view, remapping, flush/purge and statistics, and the resident tables' state as
    TorchRec's FUSED kernel exposes it."""

    _optim: _TierBackedFusedOptimizer
    tiers: TieredTableGroup
    training: bool
    # TorchRec 1.8's row-wise lookup hands a weighted group with a score-evicted virtual table
    # its weights as (weight, score) pairs (see _pooling_weights)
    _packs_scores: bool = False

    def _init_tiers(
        self,
        config: GroupedEmbeddingConfig,
        pg: dist.ProcessGroup | None,
        options: list[TieredTableOptions | None],
        storage: TierStorage,
        virtual: Mapping[str, VirtualShard],
    ) -> None:
        self.storage = storage
        # Config index of each tiered table, in the group's order; resident ones are not in it.
        tiered = [t for t, o in enumerate(options) if o is not None]
        self._tiered_index = {t: i for i, t in enumerate(tiered)}
        module_weights = self.emb_module.split_embedding_weights()
        module_states = self.emb_module.get_optimizer_state() or [{} for _ in options]
        feature_tables = compat.kernel_feature_table_map(self)
        self.tiers = TieredTableGroup(
            tables=[config.embedding_tables[t] for t in tiered],
            # Features of resident tables (-1) keep their ids.
            feature_table_map=[self._tiered_index.get(t, -1) for t in feature_tables],
            # ``.data``: loading rows into slots (possibly from the prefetch thread while another
            # batch sits between its forward and backward) must not bump the autograd version
            # of the weights that batch saved; it never touches that batch's slots.
            weight_slots=[module_weights[t].data for t in tiered],
            states=[{k: v.data for k, v in module_states[t].items()} for t in tiered],
            options=[o for o in options if o is not None],
            storage=storage,
            rank=_rank_of(pg),
            virtual=[virtual.get(config.embedding_tables[t].name) for t in tiered],
            resident=[
                ResidentTable(
                    name=config.embedding_tables[t].name,
                    features=[f for f, ft in enumerate(feature_tables) if ft == t],
                    weights=module_weights[t].data,
                    states={k: v.data for k, v in module_states[t].items()},
                    watched=[module_weights[t], *module_states[t].values()],
                )
                for t in range(len(options))
                if t not in self._tiered_index
            ],
        )
        # The fused optimizer exposes the tiered tables' state as it lives on the tiers
        # (fbgemm's own state tensors only hold the cached rows), resident tables' as fbgemm
        # keeps it. Learning rate and step go to the module.
        weights, registry = alias_registry(self._table_weights())
        states: list[dict[str, torch.Tensor]] = []
        for t, module_state in enumerate(module_states):
            views = (
                self.tiers.views.state_views(self._tiered_index[t])
                if t in self._tiered_index
                else module_state
            )
            aliases, more = alias_registry(list(views.values()))
            registry.update(more)
            states.append(dict(zip(views.keys(), aliases)))
        self._route_row_resets()
        self._optim = _TierBackedFusedOptimizer(
            _placed_on_host(config),
            self.emb_module,
            pg,
            embedding_weights_by_table=weights,
            all_optimizer_states=states,
            tiers=self.tiers,
        )
        for param, param_state in self._optim.unsynced_state.items():
            if isinstance(param, ShardedTensor):
                swap_aliases(param, registry)
            for value in param_state.values():
                if isinstance(value, ShardedTensor):
                    swap_aliases(value, registry)

    def _route_row_resets(self) -> None:
        """TorchRec's managed-collision modules reset the rows of the slots they give to new ids
        by calling fbgemm's ``reset_embedding_weight_momentum`` with row ids on the kernel's
        module. A tiered table's rows there are cache slots, so its rows are reset where they
        live instead (:meth:`TieredTableGroup.set_rows`), as fbgemm resets a whole table's: the
        weights and the row-wise momentum to zero under ``EXACT_ROWWISE_ADAGRAD``, nothing
        under the other optimizers. Resident tables keep fbgemm's own reset."""
        module = self.emb_module
        original = module.reset_embedding_weight_momentum
        tiered = self._tiered_index

        def reset(
            pruned_indices: torch.Tensor,
            pruned_indices_offsets: torch.Tensor,
            logical_table_ids: torch.Tensor,
            buffer_ids: torch.Tensor,
        ) -> None:
            pairs = list(zip(logical_table_ids.tolist(), buffer_ids.tolist()))
            others = [(t, b) for t, b in pairs if t not in tiered]
            if others:
                original(
                    pruned_indices=pruned_indices,
                    pruned_indices_offsets=pruned_indices_offsets,
                    logical_table_ids=torch.tensor([t for t, _ in others], dtype=torch.int32),
                    buffer_ids=torch.tensor([b for _, b in others], dtype=torch.int32),
                )
            if len(others) == len(pairs):
                return
            if module.optimizer == OptimType.NONE:
                raise NotImplementedError(
                    f"Resetting embedding weight momentum is not supported for {module.optimizer}"
                )
            if module.optimizer != OptimType.EXACT_ROWWISE_ADAGRAD:
                return  # fbgemm resets nothing then
            offsets = pruned_indices_offsets.tolist()
            for t, b in pairs:
                if t in tiered:
                    ids = pruned_indices[offsets[b] : offsets[b + 1]]
                    self.tiers.set_rows(tiered[t], ids, weights=torch.zeros(()), zero_states=True)

        module.reset_embedding_weight_momentum = reset

    def _table_weights(self) -> list[torch.Tensor]:
        """Every table's weights, in config order: a tier view for a tiered table, fbgemm's
        own rows for a resident one."""
        module_weights = self.emb_module.split_embedding_weights()
        return [
            self.tiers.views.weight_view(self._tiered_index[t])
            if t in self._tiered_index
            else cast(torch.Tensor, w)
            for t, w in enumerate(module_weights)
        ]

    def _remap(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        train = self.training and torch.is_grad_enabled()
        slots = self.tiers.remap(features.values(), features.length_per_key(), train)
        # Only the ids change: the batch layout, variable batch per feature (VBE) included,
        # goes to fbgemm as it came.
        variable = features.variable_stride_per_key()
        return KeyedJaggedTensor(
            keys=features.keys(),
            values=slots,
            weights=self._pooling_weights(features.weights_or_none()),
            lengths=features.lengths(),
            offsets=features.offsets(),
            stride=None if variable else features.stride(),
            stride_per_key_per_rank=features.stride_per_key_per_rank() if variable else None,
            length_per_key=features.length_per_key(),
            offset_per_key=features.offset_per_key(),
            inverse_indices=features.inverse_indices_or_none(),
        )

    def _pooling_weights(self, weights: torch.Tensor | None) -> torch.Tensor | None:
        """The per-value weights fbgemm pools by. Where a group holds a table evicted by
        ``FeatureScoreBasedEvictionPolicy``, TorchRec 1.8's lookup packs each weight beside a
        score into one float64 (as its virtual-table kernels expect; the tiers turn the
        collection off, so the score is the weight again): the weight is the first half."""
        if self._packs_scores and weights is not None and weights.dtype == torch.float64:
            return weights.view(torch.float32).reshape(-1, 2)[:, 0].contiguous()
        return weights

    def _watch_backward(self, out: torch.Tensor) -> torch.Tensor:
        if out.requires_grad:
            out.register_hook(self.tiers.backward_started)  # type: ignore[no-untyped-call]  # unannotated in torch
        return out

    def prefetch(self, features: KeyedJaggedTensor) -> None:
        """Plans a later batch's rows and starts reading the missing ones (see
        :meth:`TieredTableGroup.prefetch`); the forward given the same features uses them.
        Planned for training or evaluation as the module is now (a forward then trains)."""
        train = self.training and torch.is_grad_enabled()
        self.tiers.prefetch(features.values(), features.length_per_key(), train)

    @property
    def emb_module(self) -> SplitTableBatchedEmbeddingBagsCodegen:
        return compat.emb_module(self)

    @property
    def fused_optimizer(self) -> _TierBackedFusedOptimizer:
        return self._optim

    def flush(self) -> None:
        # TorchRec calls this before a state dict reads the tables: fbgemm's own cache of a
        # resident UVM-cached table writes its rows back to their UVM rows (as TorchRec's
        # kernel flushes it; nothing without one), the tiered tables' caches to their tiers.
        self.emb_module.flush()
        self.tiers.sync_views()

    def purge(self) -> None:
        # TorchRec calls this before a load writes the tables: cached rows would shadow the
        # loaded ones (fbgemm's cache of resident UVM-cached tables, and the tiered caches).
        self.emb_module.reset_cache_states()
        self.tiers.purge()

    def init_parameters(self) -> None:
        """Resident tables start as TorchRec's FUSED kernel starts them (uniform within their
        config's bounds). A tiered table's initial values are written by the sharded module's
        ``reset_parameters`` (chunked, straight to the tier); its cache starts empty."""
        for table, weight in self._resident_tables():
            weight.data.uniform_(table.get_weight_init_min(), table.get_weight_init_max())

    def tier_stats(self) -> dict[str, dict[str, float]]:
        return self.tiers.stats()

    def named_split_embedding_weights(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        for table, weight in zip(self.config.embedding_tables, self._table_weights()):
            yield f"{prefix}{table.name}.weight", weight

    def split_embedding_weights(self) -> list[torch.Tensor]:
        return self._table_weights()

    def _resident_tables(self) -> list[tuple[ShardedEmbeddingTable, torch.Tensor]]:
        tables = self.config.embedding_tables
        weights = self.emb_module.split_embedding_weights()
        return [
            (table, cast(torch.Tensor, w))
            for t, (table, w) in enumerate(zip(tables, weights))
            if t not in self._tiered_index
        ]

    def named_parameters_by_table(self) -> Iterator[tuple[str, Any]]:
        # Resident tables as TorchRec's FUSED kernel yields them (a slice of the module's
        # weights with its own fused optimizer). Tiered tables register their (tier-backed)
        # state themselves; see the sharded modules.
        counts = Counter(table.name for table, _ in self._resident_tables())
        if counts:
            yield from compat.named_parameters_by_table_fused(
                self.emb_module, dict(counts), self.config, compat.kernel_pg(self)
            )

    def named_buffers(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        yield from ()

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        # Resident tables as TorchRec's FUSED kernel yields them (marked as updated in the
        # backward, so no dense optimizer takes them); tiered tables have no parameter.
        for table, weight in self._resident_tables():
            yield (
                f"{prefix}{table.name}.weight",
                compat.mark_updated_in_backward(nn.Parameter(weight)),
            )

    def state_dict(
        self,
        destination: dict[str, Any] | None = None,
        prefix: str = "",
        keep_vars: bool = False,
    ) -> dict[str, Any]:
        # Resident tables as TorchRec's FUSED kernel gives them; the sharded module builds the
        # tier-backed sharded tensors of the tiered ones.
        resident = self._resident_tables()
        if not resident:
            return destination if destination is not None else {}
        return get_state_dict(
            [table for table, _ in resident],
            [weight for _, weight in resident],
            compat.kernel_pg(self),
            destination,
            prefix,
        )


class TieredEmbeddingBag(
    _TieredKernelMixin, BaseBatchedEmbeddingBag[torch.Tensor], FusedOptimizerModule
):
    """Pooled tiered kernel (EmbeddingBagCollection tables).

    Args:
        config: the group of tables this kernel computes (every tiered table of its lookup).
        storage: where tier files go.
        table_options: tier, cache size and policy of each table, by name.
        pg / device / sharding_type: as for TorchRec's fused kernel.
    """

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        storage: TierStorage,
        table_options: Mapping[str, TieredTableOptions],
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
        sharding_type: ShardingType | None = None,
    ) -> None:
        # A virtual table's kernel is built on its store's rows (see virtual_tables).
        config, spaces = physical_config(config, table_options)
        BaseBatchedEmbeddingBag.__init__(self, config, pg, device, sharding_type)
        self._packs_scores = any(
            space.spec.eviction.kind is EvictionKind.SCORE for space in spaces.values()
        )
        module, options = _build_cache_module(
            config,
            compat.kernel_local_cols(self),
            compat.kernel_feature_table_map(self),
            compat.kernel_pooling(self),
            device,
            table_options,
        )
        compat.set_emb_module(self, module)
        self._init_tiers(config, pg, options, storage, spaces)
        self.init_parameters()

    def forward(
        self,
        features: KeyedJaggedTensor,
        vbe_output: torch.Tensor | None = None,
        vbe_output_offsets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # With variable batch per feature and several kernels in a lookup, TorchRec hands each
        # kernel the output so far to fill in (``vbe_output``); fbgemm does that on CUDA only.
        out = BaseBatchedEmbeddingBag.forward(
            self,
            self._remap(features),
            vbe_output=vbe_output,
            vbe_output_offsets=vbe_output_offsets,
        )
        return self._watch_backward(cast(torch.Tensor, out))


class TieredEmbedding(_TieredKernelMixin, BaseBatchedEmbedding[torch.Tensor], FusedOptimizerModule):
    """Sequence tiered kernel (EmbeddingCollection tables); see :class:`TieredEmbeddingBag`."""

    def __init__(
        self,
        config: GroupedEmbeddingConfig,
        storage: TierStorage,
        table_options: Mapping[str, TieredTableOptions],
        pg: dist.ProcessGroup | None = None,
        device: torch.device | None = None,
    ) -> None:
        config, spaces = physical_config(config, table_options)  # see TieredEmbeddingBag
        BaseBatchedEmbedding.__init__(self, config, pg, device)
        module, options = _build_cache_module(
            config,
            compat.kernel_local_cols(self),
            compat.kernel_feature_table_map(self),
            PoolingMode.NONE,
            device,
            table_options,
        )
        compat.set_emb_module(self, module)
        self._init_tiers(config, pg, options, storage, spaces)
        self.init_parameters()

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        out = BaseBatchedEmbedding.forward(self, self._remap(features))
        return self._watch_backward(cast(torch.Tensor, out))
