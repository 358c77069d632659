"""TorchRec's embedding internals the tiered modules rely on: the sharded EBC / EC (their
lookups, shardings, state and table configs), the shardings' groups and process groups, the
grouped lookups' kernels and the batched kernels' process group and fbgemm module.

The hooks TorchRec calls on itself and the library's subclasses override
(:data:`EBC_CREATE_LOOKUPS`, :data:`EC_CREATE_LOOKUPS`, ``*_INITIALIZE_TORCH_STATE``,
:data:`POOLED_CREATE_KERNEL`, :data:`SEQUENCE_CREATE_KERNEL`) are recorded here with the
signatures TorchRec calls them with; :func:`torchrec_initialize_torch_state` and the
``torchrec_create_*_kernel`` functions call TorchRec's own implementation from the overrides.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableSequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.distributed import batched_embedding_kernel
from torchrec.distributed.embedding import EmbeddingCollectionSharder, ShardedEmbeddingCollection
from torchrec.distributed.embedding_lookup import (
    GroupedEmbeddingsLookup,
    GroupedPooledEmbeddingsLookup,
)
from torchrec.distributed.embedding_types import (
    GroupedEmbeddingConfig,
    ShardedEmbeddingModule,
    ShardedEmbeddingTable,
)
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import BaseEmbeddingConfig
from torchrec.optim.fused import EmptyFusedOptimizer

from torchrec_mtrains._compat.registry import (
    PrivateName,
    Use,
    declare,
    has_private_attr,
    private_attr,
    reaches,
    set_private_attr,
)

_EBC = "torchrec.distributed.embeddingbag:ShardedEmbeddingBagCollection"
_EC = "torchrec.distributed.embedding:ShardedEmbeddingCollection"
_MODULES = (_EBC, _EC)
_POOLED_LOOKUP = "torchrec.distributed.embedding_lookup:GroupedPooledEmbeddingsLookup"
_SEQUENCE_LOOKUP = "torchrec.distributed.embedding_lookup:GroupedEmbeddingsLookup"
_SHARDING = "torchrec.distributed.sharding"
_TW = (f"{_SHARDING}.tw_sharding:TwPooledEmbeddingSharding",)
_CW = (
    f"{_SHARDING}.cw_sharding:CwPooledEmbeddingSharding",
    f"{_SHARDING}.twcw_sharding:TwCwPooledEmbeddingSharding",
    f"{_SHARDING}.cw_sequence_sharding:CwSequenceEmbeddingSharding",
)
_TW_SEQUENCE = (f"{_SHARDING}.tw_sequence_sharding:TwSequenceEmbeddingSharding",)
_RW = (
    f"{_SHARDING}.rw_sharding:RwPooledEmbeddingSharding",
    f"{_SHARDING}.rw_sequence_sharding:RwSequenceEmbeddingSharding",
)
_SHARDINGS = (*_TW, *_CW, *_TW_SEQUENCE, *_RW)
"""The shardings the tiered sharders offer for tiered tables (table-, column-, table-column-
and row-wise, pooled and sequence)."""
_KERNEL = "torchrec.distributed.batched_embedding_kernel"
_KERNELS = (f"{_KERNEL}:BaseBatchedEmbeddingBag", f"{_KERNEL}:BaseBatchedEmbedding")
_SHARDED = "torchrec_mtrains.distributed.sharded"
_TIERED_KERNELS = (
    "torchrec_mtrains.distributed.kernel:TieredEmbeddingBag",
    "torchrec_mtrains.distributed.kernel:TieredEmbedding",
)

# ------------------------------------------------------------------- overridden hooks

EBC_CREATE_LOOKUPS = declare(
    _EBC,
    "_create_lookups",
    Use.OVERRIDDEN,
    parameters=("self",),
    reaches="called by the constructor to append one lookup per sharding to ``_lookups``.",
    breaks="tiered tables get TorchRec's lookup, whose kernel factory raises for "
    "CUSTOMIZED_KERNEL.",
    overridden_in=(f"{_SHARDED}:TieredShardedEmbeddingBagCollection",),
)

EC_CREATE_LOOKUPS = declare(
    _EC,
    "_create_lookups",
    Use.OVERRIDDEN,
    parameters=("self",),
    reaches="called by the constructor to append one lookup per sharding to ``_lookups`` "
    "(and its embedding updates to ``_updates``).",
    breaks="tiered tables get TorchRec's lookup, whose kernel factory raises for "
    "CUSTOMIZED_KERNEL.",
    overridden_in=(f"{_SHARDED}:TieredShardedEmbeddingCollection",),
)

EBC_INITIALIZE_TORCH_STATE = declare(
    _EBC,
    "_initialize_torch_state",
    Use.OVERRIDDEN,
    parameters=("self", "skip_registering"),
    reaches="called by the constructor to register the tables' parameters, sharded tensors "
    "and state-dict hooks; it skips CUSTOMIZED_KERNEL tables.",
    breaks="tiered tables have no state-dict entries, no row chunks and no load hooks.",
    overridden_in=(f"{_SHARDED}:TieredShardedEmbeddingBagCollection",),
)

EC_INITIALIZE_TORCH_STATE = declare(
    _EC,
    "_initialize_torch_state",
    Use.OVERRIDDEN,
    parameters=("self", "skip_registering"),
    # TorchRec 1.6.1's EC takes no argument (its EBC does): called without one unless set.
    parameters_by_version={"1.6.1": ("self",)},
    reaches="called by the constructor to register the tables' parameters, sharded tensors "
    "and state-dict hooks; it skips CUSTOMIZED_KERNEL tables.",
    breaks="tiered tables have no state-dict entries, no row chunks and no load hooks.",
    overridden_in=(f"{_SHARDED}:TieredShardedEmbeddingCollection",),
)

POOLED_CREATE_KERNEL = declare(
    _POOLED_LOOKUP,
    "_create_embedding_kernel",
    Use.OVERRIDDEN,
    parameters=("self", "config", "device", "pg", "sharding_type", "env"),
    reaches="the pooled lookup's kernel factory, called per table group by its constructor.",
    breaks="no tiered pooled kernel is built (TorchRec's factory raises for CUSTOMIZED_KERNEL).",
    overridden_in=(f"{_SHARDED}:TieredGroupedPooledEmbeddingsLookup",),
)

SEQUENCE_CREATE_KERNEL = declare(
    _SEQUENCE_LOOKUP,
    "_create_embedding_kernel",
    Use.OVERRIDDEN,
    parameters=("self", "config", "pg", "device", "env"),
    reaches="the sequence lookup's kernel factory, called per table group by its constructor.",
    breaks="no tiered sequence kernel is built (TorchRec's factory raises for CUSTOMIZED_KERNEL).",
    overridden_in=(f"{_SHARDED}:TieredGroupedEmbeddingsLookup",),
)

EMB_MODULE = declare(
    ("torchrec.distributed.embedding_kernel:BaseEmbedding",),
    "_emb_module",
    Use.PROVIDED,
    reaches="a kernel's fbgemm module, read off kernels by TorchRec's base kernel "
    "(``init_raw_id_tracker``), model tracker, inference and memory-stashing utilities.",
    breaks="those TorchRec features fail on a tiered kernel with an AttributeError.",
    overridden_in=_TIERED_KERNELS,
)

# ---------------------------------------------------------------- sharded EBC / EC state

EBC_SHARDINGS = declare(
    _EBC,
    "_embedding_shardings",
    Use.READ,
    reaches="the EBC's shardings, one per sharding type, in lookup order.",
    breaks="the EBC's lookups cannot be built.",
)

EC_SHARDINGS = declare(
    _EC,
    "_sharding_type_to_sharding",
    Use.READ,
    reaches="the EC's shardings by sharding type, in lookup order.",
    breaks="the EC's lookups cannot be built.",
)

LOOKUPS = declare(
    _MODULES,
    "_lookups",
    Use.READ,
    reaches="the module's lookups, one per sharding (DDP-wrapped for data-parallel tables).",
    breaks="lookups cannot be added, and the tiered kernels cannot be found.",
)

EC_UPDATES = declare(
    _EC,
    "_updates",
    Use.READ,
    reaches="the EC's embedding-update modules, one per sharding that writes embeddings.",
    breaks="an EC with tables that take embedding updates cannot be built.",
)

SHARDED_TENSORS = declare(
    _MODULES,
    "_model_parallel_name_to_sharded_tensor",
    Use.READ,
    reaches="the module's state-dict tensor of each table by name, filled by "
    "``_initialize_torch_state`` and read by its state-dict hooks.",
    breaks="tiered tables have no state-dict entries and no table is chunked.",
)

MODULE_ENV = declare(
    _MODULES,
    "_env",
    Use.READ,
    reaches="the module's ShardingEnv (world, rank, process group).",
    breaks="state-dict tensors cannot be built.",
)

MODULE_DEVICE = declare(
    _MODULES,
    "_device",
    Use.READ,
    reaches="the device the module was sharded onto (``meta`` when sharded without data).",
    breaks="reset_parameters would write tiers of a meta-device module.",
)

EBC_CONFIGS = declare(
    _EBC,
    "_embedding_bag_configs",
    Use.READ,
    reaches="the EBC's table configs; ``reset_parameters`` initializes every table listed.",
    breaks="tiered tables cannot be skipped by TorchRec's reset (they have no weight).",
)

EC_CONFIGS = declare(
    _EC,
    "_embedding_configs",
    Use.READ,
    reaches="the EC's table configs; ``reset_parameters`` initializes every table listed.",
    breaks="tiered tables cannot be skipped by TorchRec's reset (they have no weight).",
)

SCORE_COLLECTION = declare(
    _EC,
    "_enabled_feature_score_auto_collection",
    Use.READ,
    reaches="whether the module's input distribution puts each value's feature score "
    "(``FeatureScoreBasedEvictionPolicy`` with auto collection) in the input's weights; "
    "TorchRec 1.8's EBC sets it too.",
    breaks="every kernel of the module pools by the scores (0.0 for tables without the "
    "policy), and a weighted EBC's input is refused.",
)

SCORE_ACCUMULATION = declare(
    _EC,
    "_enable_feature_score_weight_accumulation",
    Use.READ,
    reaches="whether the EC's deduplicated input sums its weights as feature scores; "
    "TorchRec 1.8's EBC sets it too.",
    breaks="an EC's weights would be summed per unique id as scores.",
)

# ---------------------------------------------------------------------------- shardings

SHARDING_PG = declare(
    _SHARDINGS,
    "_pg",
    Use.READ,
    reaches="the sharding's process group, handed to its lookup.",
    breaks="a tiered lookup cannot be built like the sharding's own.",
)

SHARDING_DEVICE = declare(
    _SHARDINGS,
    "_device",
    Use.READ,
    reaches="the sharding's compute device, handed to its lookup.",
    breaks="a tiered lookup cannot be built like the sharding's own.",
)

SHARDING_ENV = declare(
    _SHARDINGS,
    "_env",
    Use.READ,
    reaches="the sharding's ShardingEnv, handed to its lookup.",
    breaks="a tiered lookup cannot be built like the sharding's own.",
)

SHARDING_RANK = declare(
    _SHARDINGS,
    "_rank",
    Use.READ,
    reaches="this rank's index in the sharding.",
    breaks="this rank's regrouped table groups cannot be picked.",
)

GROUPS_PER_RANK = declare(
    _SHARDINGS,
    "_grouped_embedding_configs_per_rank",
    Use.READ,
    reaches="every rank's table groups (one fbgemm module each), which the sharding's input "
    "and output distributions and lookups are built from; set to regroup.",
    breaks="tiered tables form groups of their own, so a plan interleaving tiered and "
    "resident tables orders features and output columns unlike TorchRec's FUSED model.",
)

GROUPS = declare(
    _SHARDINGS,
    "_grouped_embedding_configs",
    Use.READ,
    reaches="this rank's table groups; set to regroup.",
    breaks="as without ``_grouped_embedding_configs_per_rank``.",
)

SHARDED_TABLES_PER_RANK = declare(
    (*_TW, *_CW, *_TW_SEQUENCE),
    "_sharded_tables_per_rank",
    Use.READ,
    reaches="each rank's table shards as the sharding made them, before grouping "
    "(table-, column- and table-column-wise shardings keep it; for the others the groups are "
    "read instead).",
    breaks="the shards' order before grouping must be rebuilt from the groups.",
)

PERMUTE_EMBEDDINGS = declare(
    _CW,
    "_permute_embeddings",
    Use.READ,
    reaches="whether a column-wise sharding reorders its output to reassemble tables' column "
    "shards.",
    breaks="regrouped column-wise tables would keep the output order of the old groups.",
)

INIT_COMBINED_EMBEDDINGS = declare(
    _CW,
    "_init_combined_embeddings",
    Use.CALLED,
    parameters=("self",),
    reaches="recomputes a column-wise sharding's output permutation from its groups.",
    breaks="regrouped column-wise tables would keep the output order of the old groups.",
)

# ------------------------------------------------------------------ lookups and kernels

LOOKUP_KERNELS = declare(
    (_POOLED_LOOKUP, _SEQUENCE_LOOKUP),
    "_emb_modules",
    Use.READ,
    reaches="a grouped lookup's kernels, one per table group.",
    breaks="tiered kernels cannot be found, prefetched, flushed or checkpointed.",
)

LOOKUP_FEATURE_SPLITS = declare(
    (_POOLED_LOOKUP, _SEQUENCE_LOOKUP),
    "_feature_splits",
    Use.READ,
    reaches="how many features of the lookup's input each kernel takes, in order.",
    breaks="a batch cannot be split among the kernels to prefetch it.",
)

KERNEL_PG = declare(
    _KERNELS,
    "_pg",
    Use.READ,
    reaches="a batched kernel's process group.",
    breaks="the resident tables of a tiered kernel cannot be put in state dicts or "
    "named_parameters_by_table as TorchRec's FUSED kernel puts them.",
)

KERNEL_FEATURE_TABLE_MAP = declare(
    _KERNELS,
    "_feature_table_map",
    Use.READ,
    reaches="a batched kernel's table index of each input feature, in feature order.",
    breaks="the tiered kernel's fbgemm module and remapping cannot take features in the order "
    "TorchRec hands them to its kernel.",
)

KERNEL_LOCAL_COLS = declare(
    _KERNELS,
    "_local_cols",
    Use.READ,
    reaches="a batched kernel's local columns of each table.",
    breaks="the tiered kernel's fbgemm module cannot be shaped as TorchRec's.",
)

KERNEL_POOLING = declare(
    f"{_KERNEL}:BaseBatchedEmbeddingBag",
    "_pooling",
    Use.READ,
    reaches="the fbgemm pooling mode TorchRec chose for a pooled kernel's group (SUM for a "
    "row-wise MEAN table: the EBC divides after the output dist).",
    breaks="the tiered pooled kernel cannot pool as TorchRec's kernel does.",
)

PARAMETERS_BY_TABLE_FUSED = declare(
    _KERNEL,
    "_gen_named_parameters_by_table_fused",
    Use.CALLED,
    parameters=("emb_module", "table_name_to_count", "config", "pg"),
    reaches="the FUSED kernel's parameters by table: slices of its fbgemm module's weights, "
    "each with its own fused optimizer.",
    breaks="the resident tables of a tiered kernel are missing from named_parameters_by_table.",
)

IN_BACKWARD_OPTIMIZERS = declare(
    "torchrec.optim.optimizers",
    "_in_backward_optimizers",
    Use.PROVIDED,
    reaches="marks a parameter as updated in the backward by a fused optimizer; TorchRec's "
    "``in_backward_optimizer_filter`` leaves such parameters to it.",
    breaks="a dense optimizer built over model.named_parameters() would update resident "
    "tables a second time.",
    overridden_in=_TIERED_KERNELS,
)

INDEX_DEDUP = declare(
    "torchrec.distributed.embedding:EmbeddingCollectionSharder",
    "_use_index_dedup",
    Use.READ,
    reaches="whether the EC sharder's modules deduplicate ids before the input distribution.",
    breaks="the tiered EC sharder cannot build its module as TorchRec's does.",
)


# ----------------------------------------------------------------------- sharded modules


def _is_ebc(module: object) -> bool:
    return isinstance(module, ShardedEmbeddingBagCollection)


@reaches(EBC_SHARDINGS, EC_SHARDINGS)
def module_shardings(module: ShardedEmbeddingModule) -> list[Any]:
    """The sharded EBC's or EC's shardings, in the order of its lookups."""
    if _is_ebc(module):
        return list(private_attr(module, EBC_SHARDINGS))
    return list(private_attr(module, EC_SHARDINGS).values())


@reaches(SCORE_COLLECTION, SCORE_ACCUMULATION)
def keep_feature_scores_out_of_weights(module: ShardedEmbeddingModule) -> None:
    """Turns off TorchRec's collection of feature scores into the sharded module's input
    weights (the tiers read the scores from the policy: see
    :mod:`torchrec_mtrains.distributed.virtual_eviction`). TorchRec 1.6.1's EBC has neither
    setting."""
    for record in (SCORE_COLLECTION, SCORE_ACCUMULATION):
        if has_private_attr(module, record):
            set_private_attr(module, record, False)


@reaches(LOOKUPS)
def module_lookups(module: ShardedEmbeddingModule) -> MutableSequence[nn.Module]:
    """The sharded module's lookups (``_create_lookups`` appends to them)."""
    return cast(MutableSequence[nn.Module], private_attr(module, LOOKUPS))


@reaches(EC_UPDATES)
def module_updates(module: ShardedEmbeddingCollection) -> MutableSequence[nn.Module]:
    """The sharded EC's embedding updates (``_create_lookups`` appends to them)."""
    return cast(MutableSequence[nn.Module], private_attr(module, EC_UPDATES))


@reaches(SHARDED_TENSORS)
def sharded_tensors(module: ShardedEmbeddingModule) -> dict[str, Any]:
    """The sharded module's state-dict tensor of each table by name (a ``ShardedTensor``, or a
    tensor for a data-parallel table); entries set here are what its state dict holds."""
    return cast(dict[str, Any], private_attr(module, SHARDED_TENSORS))


@reaches(MODULE_ENV)
def module_env(module: ShardedEmbeddingModule) -> ShardingEnv:
    """The sharded module's ``ShardingEnv``."""
    return private_attr(module, MODULE_ENV)


@reaches(MODULE_DEVICE)
def module_device(module: ShardedEmbeddingModule) -> torch.device | None:
    """The device the module was sharded onto (``None`` if not given)."""
    return cast(torch.device | None, private_attr(module, MODULE_DEVICE))


def _configs_record(module: object) -> PrivateName:
    return EBC_CONFIGS if _is_ebc(module) else EC_CONFIGS


@reaches(EBC_CONFIGS, EC_CONFIGS)
def table_configs(module: ShardedEmbeddingModule) -> list[BaseEmbeddingConfig]:
    """The sharded EBC's or EC's table configs, in module order."""
    return list(private_attr(module, _configs_record(module)))


@contextmanager
@reaches(EBC_CONFIGS, EC_CONFIGS)
def tables_hidden(module: ShardedEmbeddingModule, names: set[str]) -> Iterator[None]:
    """Within the block, the module's table configs leave out ``names`` (so TorchRec's
    ``reset_parameters``, which initializes every table listed, skips them)."""
    record = _configs_record(module)
    saved = private_attr(module, record)
    set_private_attr(module, record, [c for c in saved if c.name not in names])
    try:
        yield
    finally:
        set_private_attr(module, record, saved)


@reaches(EBC_INITIALIZE_TORCH_STATE, EC_INITIALIZE_TORCH_STATE)
def torchrec_initialize_torch_state(module: ShardedEmbeddingModule, skip_registering: bool) -> None:
    """TorchRec's own ``_initialize_torch_state`` of the sharded EBC or EC (for an override to
    call first). Without ``skip_registering`` it is called without the argument, which
    TorchRec 1.6.1's EC does not take."""
    base: Any = ShardedEmbeddingBagCollection if _is_ebc(module) else ShardedEmbeddingCollection
    initialize = getattr(base, EBC_INITIALIZE_TORCH_STATE.name)
    if skip_registering:
        initialize(module, skip_registering=True)
    else:
        initialize(module)


# ---------------------------------------------------------------------------- shardings


@dataclass(frozen=True)
class LookupArgs:
    """What a sharding hands the lookup it creates."""

    pg: dist.ProcessGroup | None
    device: torch.device | None
    env: ShardingEnv


@reaches(SHARDING_PG, SHARDING_DEVICE, SHARDING_ENV)
def lookup_args(sharding: Any) -> LookupArgs:
    """The process group, device and env ``sharding`` builds its lookup with."""
    return LookupArgs(
        pg=private_attr(sharding, SHARDING_PG),
        device=private_attr(sharding, SHARDING_DEVICE),
        env=private_attr(sharding, SHARDING_ENV),
    )


@reaches(GROUPS_PER_RANK, GROUPS)
def keeps_groups_per_rank(sharding: Any) -> bool:
    """Whether ``sharding`` keeps every rank's table groups (so they can be regrouped)."""
    return has_private_attr(sharding, GROUPS_PER_RANK) and has_private_attr(sharding, GROUPS)


@reaches(GROUPS_PER_RANK)
def groups_per_rank(sharding: Any) -> list[list[GroupedEmbeddingConfig]]:
    """Every rank's table groups of ``sharding`` (none for a sharding that keeps none)."""
    if not has_private_attr(sharding, GROUPS_PER_RANK):
        return []
    return [list(groups) for groups in private_attr(sharding, GROUPS_PER_RANK)]


@reaches(GROUPS)
def groups(sharding: Any) -> list[GroupedEmbeddingConfig]:
    """This rank's table groups of ``sharding`` (none for a sharding that keeps none)."""
    if not has_private_attr(sharding, GROUPS):
        return []
    return list(private_attr(sharding, GROUPS))


@reaches(GROUPS_PER_RANK, GROUPS, SHARDING_RANK, PERMUTE_EMBEDDINGS, INIT_COMBINED_EMBEDDINGS)
def set_groups(sharding: Any, per_rank: list[list[GroupedEmbeddingConfig]]) -> None:
    """Replaces every rank's table groups of ``sharding`` by ``per_rank``, before its lookups,
    input and output distributions are built (they all read the groups); a column-wise
    sharding's output permutation follows."""
    set_private_attr(sharding, GROUPS_PER_RANK, per_rank)
    set_private_attr(sharding, GROUPS, per_rank[private_attr(sharding, SHARDING_RANK)])
    if getattr(sharding, PERMUTE_EMBEDDINGS.name, False):
        private_attr(sharding, INIT_COMBINED_EMBEDDINGS)()


@reaches(SHARDED_TABLES_PER_RANK)
def sharded_tables_per_rank(sharding: Any) -> list[list[ShardedEmbeddingTable]] | None:
    """Each rank's table shards in the order ``sharding`` made them, where it keeps them
    (table-, column- and table-column-wise); ``None`` otherwise."""
    kept = getattr(sharding, SHARDED_TABLES_PER_RANK.name, None)
    return None if kept is None else [list(tables) for tables in kept]


# -------------------------------------------------------------------- lookups and kernels


@reaches(LOOKUP_KERNELS)
def lookup_kernels(lookup: nn.Module) -> list[nn.Module]:
    """The kernels of one of a sharded module's lookups (unwrapping data parallel's wrapper);
    none for a lookup that is not a grouped one."""
    module = getattr(lookup, "module", lookup)
    return list(getattr(module, LOOKUP_KERNELS.name, []))


@reaches(LOOKUP_FEATURE_SPLITS)
def lookup_feature_splits(lookup: nn.Module) -> list[int]:
    """How many of a grouped lookup's input features each of its kernels takes, in order."""
    return list(private_attr(lookup, LOOKUP_FEATURE_SPLITS))


@reaches(POOLED_CREATE_KERNEL)
def torchrec_create_pooled_kernel(
    lookup: GroupedPooledEmbeddingsLookup,
    config: GroupedEmbeddingConfig,
    device: torch.device | None,
    pg: dist.ProcessGroup | None,
    sharding_type: ShardingType | None,
    env: ShardingEnv | None,
) -> nn.Module:
    """TorchRec's own kernel for ``config`` in a pooled lookup (for an override to fall back
    to)."""
    create = getattr(GroupedPooledEmbeddingsLookup, POOLED_CREATE_KERNEL.name)
    return cast(nn.Module, create(lookup, config, device, pg, sharding_type, env))


@reaches(SEQUENCE_CREATE_KERNEL)
def torchrec_create_sequence_kernel(
    lookup: GroupedEmbeddingsLookup,
    config: GroupedEmbeddingConfig,
    pg: dist.ProcessGroup | None,
    device: torch.device | None,
    env: ShardingEnv | None,
) -> nn.Module:
    """TorchRec's own kernel for ``config`` in a sequence lookup (for an override to fall back
    to)."""
    create = getattr(GroupedEmbeddingsLookup, SEQUENCE_CREATE_KERNEL.name)
    return cast(nn.Module, create(lookup, config, pg, device, env))


@reaches(KERNEL_PG)
def kernel_pg(kernel: nn.Module) -> dist.ProcessGroup | None:
    """A batched kernel's process group."""
    return cast(dist.ProcessGroup | None, private_attr(kernel, KERNEL_PG))


@reaches(KERNEL_FEATURE_TABLE_MAP)
def kernel_feature_table_map(kernel: nn.Module) -> list[int]:
    """A batched kernel's table index of each input feature."""
    return list(private_attr(kernel, KERNEL_FEATURE_TABLE_MAP))


@reaches(KERNEL_LOCAL_COLS)
def kernel_local_cols(kernel: nn.Module) -> list[int]:
    """A batched kernel's local columns of each table."""
    return list(private_attr(kernel, KERNEL_LOCAL_COLS))


@reaches(KERNEL_POOLING)
def kernel_pooling(kernel: nn.Module) -> PoolingMode:
    """The fbgemm pooling mode of a pooled batched kernel."""
    return cast(PoolingMode, private_attr(kernel, KERNEL_POOLING))


@reaches(EMB_MODULE)
def set_emb_module(kernel: nn.Module, module: SplitTableBatchedEmbeddingBagsCodegen) -> None:
    """Sets a kernel's fbgemm module where TorchRec reads it (a registered submodule)."""
    set_private_attr(kernel, EMB_MODULE, module)


@reaches(EMB_MODULE)
def emb_module(kernel: nn.Module) -> SplitTableBatchedEmbeddingBagsCodegen:
    """A kernel's fbgemm module, as :func:`set_emb_module` set it."""
    return cast(SplitTableBatchedEmbeddingBagsCodegen, private_attr(kernel, EMB_MODULE))


@reaches(PARAMETERS_BY_TABLE_FUSED)
def named_parameters_by_table_fused(
    module: SplitTableBatchedEmbeddingBagsCodegen,
    table_counts: dict[str, int],
    config: GroupedEmbeddingConfig,
    pg: dist.ProcessGroup | None,
) -> Iterator[tuple[str, Any]]:
    """The tables ``table_counts`` names of the fbgemm ``module``, as TorchRec's FUSED kernel
    yields them from ``named_parameters_by_table``."""
    generate = getattr(batched_embedding_kernel, PARAMETERS_BY_TABLE_FUSED.name)
    return cast(Iterator[tuple[str, Any]], generate(module, table_counts, config, pg))


@reaches(IN_BACKWARD_OPTIMIZERS)
def mark_updated_in_backward(param: nn.Parameter) -> nn.Parameter:
    """``param``, marked as TorchRec marks a FUSED table's weight: updated in the backward by
    its fused optimizer, so TorchRec leaves it out of dense optimizers."""
    set_private_attr(param, IN_BACKWARD_OPTIMIZERS, [EmptyFusedOptimizer()])
    return param


@reaches(INDEX_DEDUP)
def index_dedup(sharder: EmbeddingCollectionSharder) -> bool:
    """Whether the EC sharder deduplicates ids before the input distribution."""
    return bool(private_attr(sharder, INDEX_DEDUP))
