"""Sharders that let one sharding plan mix TorchRec's kernels with tables on storage tiers.

Tables planned with :data:`TIERED_KERNEL` and a :class:`TieredParameterSharding` live on their
tier behind a cache; every other table gets TorchRec's own kernel (FUSED in DRAM or HBM,
FUSED_UVM_CACHING on CUDA) exactly as with the stock sharders, except for one thing: a batch
holding an id outside its table is refused with an error naming the table, the feature and the id
(:class:`BoundsCheck` ``ERROR``, the default) for every table, where TorchRec's kernels would warn
and train row 0 instead (``WARN``, on request, for every table too).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_mtrains._compat import embedding as compat
from torchrec_mtrains.distributed.id_bounds import OutOfRangeIdError
from torchrec_mtrains.distributed.options import (
    BOUNDS_CHECK_MODE_KEY,
    TIERED_KERNEL,
    BoundsCheck,
    TieredParameterSharding,
    TierStorage,
)
from torchrec_mtrains.distributed.sharded import (
    TieredShardedEmbeddingBagCollection,
    TieredShardedEmbeddingCollection,
)
from torchrec_mtrains.distributed.virtual_tables import check_virtual_tables

if TYPE_CHECKING:  # what the mixin below is combined with (Any to mypy)
    from torchrec.distributed.embedding_types import BaseEmbeddingSharder as _SharderBase
else:
    _SharderBase = object

__all__ = [
    "BoundsCheck",
    "OutOfRangeIdError",
    "TieredEmbeddingBagCollectionSharder",
    "TieredEmbeddingCollectionSharder",
]

_TIERED_SHARDING_TYPES = (
    ShardingType.TABLE_WISE.value,
    ShardingType.COLUMN_WISE.value,
    ShardingType.TABLE_COLUMN_WISE.value,
    ShardingType.ROW_WISE.value,
)


def _fused_params_with_bounds_check(
    fused_params: dict[str, Any] | None, bounds_check: BoundsCheck
) -> dict[str, Any]:
    """``fused_params`` with fbgemm's mode for ``bounds_check``; one set there already must
    be that mode (the sharder's argument is the one place the rule is chosen)."""
    out = dict(fused_params or {})
    given = out.get(BOUNDS_CHECK_MODE_KEY)
    if given is not None and given != bounds_check.fbgemm_mode:
        raise ValueError(
            f"fused_params[{BOUNDS_CHECK_MODE_KEY!r}]={given!r} contradicts "
            f"bounds_check={bounds_check.value!r} (fbgemm {bounds_check.fbgemm_mode.name}): "
            "choose the rule with the sharder's bounds_check argument (BoundsCheck.ERROR or "
            "BoundsCheck.WARN) and leave it out of fused_params"
        )
    out[BOUNDS_CHECK_MODE_KEY] = bounds_check.fbgemm_mode
    return out


def _check_tiered_plan(
    params: dict[str, ParameterSharding],
    storage: TierStorage,
    env: ShardingEnv,
    hot_rows: Mapping[str, Sequence[int]],
    bounds_check: BoundsCheck,
) -> None:
    """Fails at sharding time, naming the table or path, for plans the kernel cannot run and
    for a table whose plan sets another fbgemm bounds check mode than the sharder's rule."""
    for table, ps in params.items():
        mode = ps.bounds_check_mode
        if mode is not None and mode != bounds_check.fbgemm_mode:
            raise ValueError(
                f"table {table!r}: the plan sets bounds_check_mode={mode!r}, but the sharder "
                f"applies bounds_check={bounds_check.value!r} (fbgemm "
                f"{bounds_check.fbgemm_mode.name}) to every table; leave it unset in the plan"
            )
    for table in hot_rows:
        if table not in params or params[table].compute_kernel != TIERED_KERNEL:
            raise ValueError(
                f"hot_rows names table {table!r}, which is not planned on the tiered kernel "
                "in this module"
            )
    rank = dist.get_rank(env.process_group) if dist.is_initialized() else 0
    for table, ps in params.items():
        if ps.compute_kernel != TIERED_KERNEL:
            continue
        if not isinstance(ps, TieredParameterSharding):
            raise ValueError(
                f"table {table!r} is planned on the tiered kernel without a tier: use "
                "TieredParameterSharding (or the tiered planner) for it"
            )
        if ps.sharding_type not in _TIERED_SHARDING_TYPES:
            raise ValueError(
                f"table {table!r}: sharding type {ps.sharding_type!r} is not supported on a "
                f"tier; use one of {', '.join(_TIERED_SHARDING_TYPES)}"
            )
        storage.directory(ps.tier_options.tier, rank)


class _TieredSharderMixin(_SharderBase):
    """Construction and kernel/sharding-type offers shared by both tiered sharders."""

    def __init__(
        self,
        storage: TierStorage | None = None,
        offer_tiered_kernel: bool = False,
        fused_params: dict[str, Any] | None = None,
        hot_rows: Mapping[str, Sequence[int]] | None = None,
        bounds_check: BoundsCheck = BoundsCheck.ERROR,
        **kwargs: Any,
    ) -> None:
        self._bounds_check = BoundsCheck.parse(bounds_check)
        super().__init__(
            fused_params=_fused_params_with_bounds_check(fused_params, self._bounds_check),
            **kwargs,
        )
        self._storage = storage or TierStorage()
        self._offer_tiered = offer_tiered_kernel
        self._hot_rows = dict(hot_rows or {})

    def compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """TorchRec's kernels, exactly as its own sharder offers them, so that TorchRec's stock
        planner plans a model without tiered tables as it would without this plugin.

        Raises:
            ValueError: when the sharder offers the tiered kernel: only the tiered planner can
                estimate it (TorchRec's stock planner calls this method; ours calls
                :meth:`planner_compute_kernels`).
        """
        if self._offer_tiered:
            raise ValueError(
                f"{type(self).__name__}(offer_tiered_kernel=True) is being asked for kernels "
                "by a planner other than the tiered one, and TorchRec's stock planner cannot "
                "place or estimate tables on a storage tier: plan with "
                "torchrec_mtrains.planner.TieredShardingPlanner (or plan_tables), or build the "
                "sharder with offer_tiered_kernel=False to get TorchRec's own plan"
            )
        return list(super().compute_kernels(sharding_type, compute_device_type))

    def planner_compute_kernels(self, sharding_type: str, compute_device_type: str) -> list[str]:
        """The kernels the tiered planner may choose: TorchRec's, plus the tiered kernel for the
        sharding types it runs when ``offer_tiered_kernel`` is set."""
        kernels = list(super().compute_kernels(sharding_type, compute_device_type))
        if self._offer_tiered and sharding_type in _TIERED_SHARDING_TYPES:
            kernels.append(TIERED_KERNEL)
        return kernels

    def planner_sharding_types(self, compute_device_type: str) -> list[str]:
        """The sharding types the tiered planner may choose: TorchRec's, plus row-wise on CPU,
        which TorchRec leaves out there although it runs over gloo (reduce-scatter and
        all-to-all; the parity suite checks it). :meth:`sharding_types` stays TorchRec's own."""
        types = list(super().sharding_types(compute_device_type))
        if ShardingType.ROW_WISE.value not in types:
            types.append(ShardingType.ROW_WISE.value)
        return types

    @property
    def bounds_check(self) -> BoundsCheck:
        return self._bounds_check

    @property
    def storage(self) -> TierStorage:
        return self._storage

    @property
    def hot_rows(self) -> Mapping[str, Sequence[int]]:
        return self._hot_rows

    @hot_rows.setter
    def hot_rows(self, value: Mapping[str, Sequence[int]]) -> None:
        """Hot rows are usually known only once a planner has put tables on the tiered kernel."""
        self._hot_rows = dict(value)


class TieredEmbeddingBagCollectionSharder(_TieredSharderMixin, EmbeddingBagCollectionSharder):
    """Shards ``EmbeddingBagCollection`` with tables on TorchRec kernels or storage tiers.

    Args:
        storage: where tier files go (default: ``runs/tiers`` under the working directory).
        hot_rows: per tiered table, global row ids to keep resident in its cache for good
            (FAE's hot set, e.g. ``TableProfile.hot_rows`` from the access profiler).
        offer_tiered_kernel: let the tiered planner choose the tiered kernel (it asks
            :meth:`planner_compute_kernels`). TorchRec's stock planner cannot estimate that
            kernel, so with this set it gets an error naming the tiered planner; without it,
            the stock planner plans exactly as with TorchRec's sharder. Hand-written plans work
            either way.
        fused_params: as for TorchRec's sharder (optimizer, learning rate, ...), without
            ``bounds_check_mode``: ``bounds_check`` sets it.
        bounds_check: what a batch holding a row id outside its table does, the same for
            every table: ``BoundsCheck.ERROR`` (default) refuses it before any lookup with
            :class:`~torchrec_mtrains.distributed.id_bounds.OutOfRangeIdError` naming the table,
            the feature, the id and the valid range; ``BoundsCheck.WARN`` does what TorchRec's
            kernels do by default (fbgemm's WARNING mode): logs it and looks up row 0 of the
            table instead. A string (``"error"``, ``"warn"``) is accepted too.

    Example::

        sharder = TieredEmbeddingBagCollectionSharder(
            TierStorage(root="/mnt/run1"), fused_params={"optimizer": OptimType.EXACT_SGD,
                                                        "learning_rate": 0.1})
        model = DistributedModelParallel(model, plan=plan, sharders=[sharder])
    """

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> TieredShardedEmbeddingBagCollection:
        _check_tiered_plan(params, self._storage, env, self._hot_rows, self._bounds_check)
        check_virtual_tables(module.embedding_bag_configs(), params, self._hot_rows)
        return TieredShardedEmbeddingBagCollection(
            module=module,
            table_name_to_parameter_sharding=params,
            env=env,
            fused_params=self.fused_params,
            device=device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            module_fqn=module_fqn,
            storage=self._storage,
            hot_rows=self._hot_rows,
            bounds_check=self._bounds_check,
        )


class TieredEmbeddingCollectionSharder(_TieredSharderMixin, EmbeddingCollectionSharder):
    """Shards ``EmbeddingCollection`` with tables on TorchRec kernels or storage tiers; see
    :class:`TieredEmbeddingBagCollectionSharder` for the arguments."""

    def shard(
        self,
        module: EmbeddingCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> TieredShardedEmbeddingCollection:
        _check_tiered_plan(params, self._storage, env, self._hot_rows, self._bounds_check)
        check_virtual_tables(module.embedding_configs(), params, self._hot_rows)
        return TieredShardedEmbeddingCollection(
            module,
            params,
            env,
            self.fused_params,
            device,
            qcomm_codecs_registry=self.qcomm_codecs_registry,
            use_index_dedup=compat.index_dedup(self),
            module_fqn=module_fqn,
            storage=self._storage,
            hot_rows=self._hot_rows,
            bounds_check=self._bounds_check,
        )
