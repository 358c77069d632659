"""The tiered sharding planner: TorchRec's ``EmbeddingShardingPlanner`` with this package's
enumerator, estimator, proposer, partitioner and perf model.

What is reused from TorchRec: the planner's propose -> partition -> rate loop and best-plan
bookkeeping (``EmbeddingShardingPlanner.plan``), ``ShardingOption`` / ``Shard`` / ``Storage`` /
``Perf``, shard geometry (``calculate_shard_sizes_and_offsets``), ``to_sharding_plan`` and the
plan validations. What is ours, behind TorchRec's ABCs (``Enumerator``, ``ShardEstimator``,
``Proposer``, ``Partitioner``, ``PerfModel``, ``StorageReservation``): everything that must know
about more tiers than TorchRec's ``Storage(hbm, ddr, ssd)`` or estimate the customized kernel
(TorchRec's estimator raises for it).

The result is a TorchRec ``ShardingPlan`` whose tiered tables carry a
:class:`~torchrec_mtrains.distributed.TieredParameterSharding` (tier, cache load factor, policy),
ready for ``DistributedModelParallel`` with the tiered sharders.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.stats import NoopEmbeddingStats
from torchrec.distributed.planner.types import (
    KernelConfig,
    PlannerError,
    PlannerErrorType,
    StorageReservation,
    Topology,
    TopologyFactory,
    TrainerConfig,
)
from torchrec.distributed.types import (
    CacheParams,
    EmbeddingModuleShardingPlan,
    ModuleSharder,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_mtrains._compat import planner as compat
from torchrec_mtrains.cache.policies import fbgemm_cache_algorithm
from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    TieredParameterSharding,
    TieredTableOptions,
)
from torchrec_mtrains.distributed.sharders import TieredEmbeddingBagCollectionSharder
from torchrec_mtrains.planner.access import TableAccess
from torchrec_mtrains.planner.enumerators import TieredEnumerator, offered_kernels
from torchrec_mtrains.planner.partitioners import TierPartitioner, TierPerfModel
from torchrec_mtrains.planner.perf_model import Placement
from torchrec_mtrains.planner.proposers import TierDemotionProposer
from torchrec_mtrains.planner.shard_estimators import TieredShardEstimator
from torchrec_mtrains.planner.stats import PlanSummary, summarize
from torchrec_mtrains.planner.topology import HostTopology
from torchrec_mtrains.planner.types import (
    PlacementError,
    PlannerConfig,
    PlanningContext,
    TieredShardingOption,
)
from torchrec_mtrains.profiler.types import AccessProfile
from torchrec_mtrains.types import Tier

logger = logging.getLogger(__name__)

__all__ = [
    "TablePlan",
    "TieredShardingPlanner",
    "plan_tables",
    "torchrec_topology",
]


def torchrec_topology(context: PlanningContext) -> Topology:
    """TorchRec's view of the job: HBM and DDR per rank, and the two SCM tiers as ``ssd``
    (TorchRec only reports it; our partitioner enforces the real per-tier capacities)."""
    scm = context.capacity(Tier.BYTE_SCM) + context.capacity(Tier.BLOCK_SCM)
    return TopologyFactory.create_topology(
        trainer_config=TrainerConfig(
            world_size=context.world_size,
            local_world_size=context.local_world_size,
            hbm_cap_bytes=context.capacity(Tier.HBM),
            ddr_cap_bytes=context.capacity(Tier.DRAM),
            ssd_cap_bytes=scm,
        ),
        kernel_config=KernelConfig(compute_device=context.host.compute_device),
    )


class _HostReservation(StorageReservation):
    """The host topology already sets aside DRAM for the process (``dram_reserved``); TorchRec's
    heuristic reservation (a share of HBM/DDR) would reserve it twice."""

    def __init__(self) -> None:
        self._last: Topology | None = None
        compat.set_reserved_share(self, 0.0)  # TorchRec's planner reads it in its reports

    def reserve(
        self,
        topology: Topology,
        batch_size: int,
        module: nn.Module,
        sharders: list[ModuleSharder[nn.Module]],
        constraints: Any = None,
    ) -> Topology:
        self._last = topology
        return topology

    @property
    def last_reserved_topology(self) -> Topology | None:
        return self._last


class TieredShardingPlanner(EmbeddingShardingPlanner):
    """Plans tables onto HBM, DRAM, byte SCM and block SCM, with cache sizes.

    Args:
        host: topology of every host.
        world_size: ranks in the job.
        batch_size: samples per rank per step.
        profile: measured access profile; tables without one are assumed uniform (and the
            summary says so).
        local_world_size: ranks per host (default: ``min(world_size, host.ranks_per_host)``).
        config: planner knobs; its ``dram_budget`` / ``byte_scm_budget`` replace the host's
            capacities (see :func:`with_budgets`).
        access: per-table access statistics overriding the profile (e.g. stated Zipf skews).
        poolings: ids per sample of tables without a profile.

    Example::

        planner = TieredShardingPlanner(load_topology("local"), world_size=1, batch_size=512,
                                        profile=AccessProfile.from_json("profile.json"))
        plan = planner.plan(model, [sharder])
        print(planner.last_summary)
    """

    def __init__(
        self,
        host: HostTopology,
        world_size: int,
        batch_size: int,
        profile: AccessProfile | None = None,
        *,
        local_world_size: int | None = None,
        config: PlannerConfig | None = None,
        access: Mapping[str, TableAccess] | None = None,
        poolings: Mapping[str, float] | None = None,
    ) -> None:
        config = config or PlannerConfig()
        # The budgets stand in for the host's capacities, wherever the plan is asked for.
        host = with_budgets(host, config.dram_budget, config.byte_scm_budget)
        local = local_world_size or min(world_size, host.ranks_per_host)
        self.context = PlanningContext(
            host=host,
            world_size=world_size,
            local_world_size=local,
            batch_size=batch_size,
            config=config,
        )
        self.estimator = TieredShardEstimator(self.context)
        self.tiered_enumerator = TieredEnumerator(
            self.context, self.estimator, profile, dict(access or {}), dict(poolings or {})
        )
        self.tier_partitioner = TierPartitioner(self.context, self.estimator)
        self.profile = profile
        self.last_summary: PlanSummary | None = None
        super().__init__(
            topology=torchrec_topology(self.context),
            batch_size=batch_size,
            enumerator=self.tiered_enumerator,
            storage_reservation=_HostReservation(),
            proposer=TierDemotionProposer(self.context),
            partitioner=self.tier_partitioner,
            performance_model=TierPerfModel(self.context),
            stats=[NoopEmbeddingStats()],
            debug=False,
        )

    def _notes(self) -> list[str]:
        uniform = self.tiered_enumerator.assumed_uniform
        total = len(self.context.access)
        notes = [
            f"virtual table {name}: max_live_rows {bound:,}, the distinct ids its profile saw "
            f"(set planner.max_live_rows.{name} to choose another)"
            for name, bound in sorted(self.tiered_enumerator.bounds_from_profile.items())
        ]
        if self.profile is None and uniform:
            notes.append(
                f"no access profile given: assumed uniform access for all {total} tables "
                "(pessimistic for skewed traffic: caches and hit rates are lower bounds)"
            )
        elif uniform:
            notes.append(
                f"no profile for {len(uniform)} of {total} tables ({', '.join(uniform)}): "
                "assumed uniform access for them"
            )
        sources = {a.source for a in self.context.access.values()}
        if any(s.startswith("assumed zipf") for s in sources):
            notes.append("hit rates of tables marked 'assumed zipf' come from their stated skew")
        if self.context.config.overlap_tier_io:
            notes.append("tier I/O assumed overlapped with compute (look-ahead prefetch)")
        return notes

    def plan(self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]) -> ShardingPlan:
        """Plans ``module``; tiered tables get a ``TieredParameterSharding``.

        Raises:
            PlacementError: when no placement fits, with demand against capacity per tier and
                rank.
        """
        self.tier_partitioner.last_report = None
        try:
            plan = super().plan(module, sharders)
        except PlacementError:
            raise
        except PlannerError as e:
            # TorchRec reports that no proposal partitioned; our partitioner knows why.
            report = self.tier_partitioner.last_report
            no_fit = e.error_type in (
                PlannerErrorType.INSUFFICIENT_STORAGE,
                PlannerErrorType.STRICT_CONSTRAINTS,
            )
            if report is None or not no_fit:
                raise
            raise PlacementError(report) from e
        best = cast(list[TieredShardingOption], compat.best_plan(self))
        by_name = {(o.path, o.name): o for o in best}
        for path, module_plan in plan.plan.items():
            for name, sharding in list(module_plan.items()):
                option = by_name[(path, name)]
                if option.compute_kernel == TIERED_KERNEL:
                    module_plan[name] = TieredParameterSharding.wrap(
                        sharding,
                        TieredTableOptions(
                            tier=option.placement.rows_tier,
                            cache_load_factor=_load_factor(option),
                            cache_policy=self.context.config.cache_policy,
                            max_live_rows=option.live_rows,
                        ),
                    )
                elif option.placement is Placement.CACHED_DRAM:
                    # fbgemm's cache runs the policy too (its default, LRU, would stand in).
                    policy = self.context.config.cache_policy
                    try:
                        algorithm = fbgemm_cache_algorithm(policy)
                    except ValueError as e:
                        raise ValueError(
                            f"table {name!r} is planned on FUSED_UVM_CACHING, whose cache cannot "
                            f"run cache_policy={policy!r}: {e}"
                        ) from None
                    sharding.cache_params = CacheParams(
                        load_factor=min(_load_factor(option), 0.999), algorithm=algorithm
                    )
        self.last_summary = summarize(best, self.context, self._notes())
        logger.info("tiered plan:\n%s", self.last_summary)
        return plan


def _load_factor(option: TieredShardingOption) -> float:
    """The fraction of rows that reproduces each shard's cache size (see ``size_caches``)."""
    factor = option.cache_load_factor_value
    return min(1.0, max(factor, 1e-12))


class TablePlan(NamedTuple):
    """What :func:`plan_tables` returns: the module plan and its printout."""

    plan: EmbeddingModuleShardingPlan
    summary: PlanSummary


def _sharder_offers_tiers(sharder: ModuleSharder[nn.Module], device: str) -> bool:
    return TIERED_KERNEL in offered_kernels(sharder, "table_wise", device)


def plan_tables(
    tables: EmbeddingBagCollection | Sequence[EmbeddingBagConfig],
    topology: HostTopology,
    world_size: int,
    batch_size: int,
    profile: AccessProfile | None,
    sharder: TieredEmbeddingBagCollectionSharder | None = None,
    *,
    local_world_size: int | None = None,
    config: PlannerConfig | None = None,
    access: Mapping[str, TableAccess] | None = None,
    poolings: Mapping[str, float] | None = None,
) -> TablePlan:
    """Plans an ``EmbeddingBagCollection`` (or its table configs) onto the memory hierarchy.

    Args:
        tables: the collection to shard, or its table configs (a meta-device collection is
            built from them).
        topology: the host topology (every host alike).
        world_size: ranks in the job.
        batch_size: samples per rank per step.
        profile: access profile, or ``None`` for the uniform fallback (stated in the summary).
        sharder: the sharder the model will be sharded with; it must offer the tiered kernel
            (``offer_tiered_kernel=True``) when the host has a storage tier. Default: one with
            row-wise Adagrad.
        local_world_size: ranks per host (default: ``min(world_size, ranks_per_host)``).
        config: planner knobs.
        access / poolings: see :class:`TieredShardingPlanner`.

    Returns:
        ``(plan, summary)``: the ``EmbeddingModuleShardingPlan`` of the collection, ready for
        ``DistributedModelParallel(..., plan=ShardingPlan({path: plan}), sharders=[sharder])``,
        and its printout (``print(summary)``).

    Raises:
        PlacementError: when no placement fits (demand vs capacity per tier and rank).
        ValueError: when the sharder does not offer the tiered kernel but the host has SCM.

    Example::

        plan, summary = plan_tables(ebc, load_topology("local"), world_size=1,
                                    batch_size=512, profile=None, sharder=sharder)
        print(summary)
    """
    if isinstance(tables, EmbeddingBagCollection):
        ebc = tables
    else:
        configs = list(tables)
        if not configs:
            raise ValueError("no tables to plan")
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    if sharder is None:
        sharder = TieredEmbeddingBagCollectionSharder(
            offer_tiered_kernel=True,
            fused_params={"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01},
        )
    has_scm = topology.byte_scm is not None or topology.block_scm is not None
    if has_scm and not _sharder_offers_tiers(sharder, topology.compute_device):
        raise ValueError(
            f"host {topology.name!r} has storage tiers but the sharder does not offer the tiered "
            "kernel: build it with TieredEmbeddingBagCollectionSharder(..., "
            "offer_tiered_kernel=True)"
        )
    planner = TieredShardingPlanner(
        topology,
        world_size,
        batch_size,
        profile,
        local_world_size=local_world_size,
        config=config,
        access=access,
        poolings=poolings,
    )
    sharding_plan = planner.plan(ebc, [cast(ModuleSharder[nn.Module], sharder)])
    module_plan = sharding_plan.plan.get("")
    if module_plan is None or planner.last_summary is None:
        raise ValueError("the planner returned no plan for the collection")
    return TablePlan(cast(EmbeddingModuleShardingPlan, module_plan), planner.last_summary)


def with_budgets(topology: HostTopology, dram_budget: str, byte_scm_budget: str) -> HostTopology:
    """``topology`` with its DRAM capacity set so that ``dram_budget`` is left for tables and
    caches after ``dram_reserved``, and its byte SCM capacity set to ``byte_scm_budget``
    (empty strings keep the topology's; zero is refused, not read as "no budget").

    Raises:
        ValueError: for an unparsable or zero budget, or a byte SCM budget without byte SCM.
    """
    from torchrec_mtrains.planner.sizes import parse_size

    if dram_budget != "":
        usable = parse_size(dram_budget, "planner.dram_budget")
        if usable <= 0:
            raise ValueError(
                f"planner.dram_budget={dram_budget!r} leaves no DRAM for tables and caches: "
                "give a positive size (e.g. 64MB), or leave it empty for the hardware's"
            )
        capacity = usable + parse_size(topology.dram_reserved, "hardware.dram_reserved")
        topology = dataclasses.replace(
            topology, dram=dataclasses.replace(topology.dram, capacity=str(capacity))
        )
    if byte_scm_budget != "":
        if topology.byte_scm is None:
            raise ValueError("planner.byte_scm_budget is set but the hardware has no byte SCM")
        size = parse_size(byte_scm_budget, "planner.byte_scm_budget")
        if size <= 0:
            raise ValueError(
                f"planner.byte_scm_budget={byte_scm_budget!r}: give a positive size, or leave it "
                "empty for the hardware's (to plan without byte SCM, use a preset without it)"
            )
        topology = dataclasses.replace(
            topology, byte_scm=dataclasses.replace(topology.byte_scm, capacity=str(size))
        )
    return topology
