"""Assigns shards to ranks honouring every tier's capacity on every rank, then sizes caches.

TorchRec's ``GreedyPerfPartitioner`` cannot be used: it rebuilds ``Storage(hbm, ddr, ssd)`` and
so cannot hold two storage-class tiers. :class:`TierPartitioner` implements TorchRec's
``Partitioner`` over our per-tier demands:

1. row-wise shards go to their own rank (shard ``i`` on rank ``i``);
2. the other shards, hardest to fit first (largest share of a rank's tier), each go to the
   least-loaded rank (by predicted step time) on which all their tier demands fit;
3. each rank's remaining cache memory (HBM on GPU hosts, DRAM on CPU hosts, less a headroom) is
   handed out greedily in small increments, each to the cached shard on that rank whose step
   time the increment shortens most per byte (:func:`size_caches`): the steeper a table's
   hit-rate curve at its current size, the more cache it gets.

When a shard fits on no rank, partitioning fails with a :class:`PlacementError` listing demand
against capacity per tier and rank.
"""

from __future__ import annotations

import copy
import heapq
import logging
import math

from torchrec.distributed.planner.types import (
    PartitionByType,
    Partitioner,
    PerfModel,
    ShardingOption,
    Topology,
)

from torchrec_mtrains.planner.perf_model import Placement, StepTime
from torchrec_mtrains.planner.shard_estimators import TieredShardEstimator
from torchrec_mtrains.planner.sizes import format_size
from torchrec_mtrains.planner.types import (
    PlacementError,
    PlacementReport,
    PlanningContext,
    TieredShardingOption,
)
from torchrec_mtrains.types import Tier

logger = logging.getLogger(__name__)

__all__ = ["TierPartitioner", "TierPerfModel", "rank_step_times", "size_caches"]


def _options(plan: list[ShardingOption]) -> list[TieredShardingOption]:
    out = []
    for option in plan:
        if not isinstance(option, TieredShardingOption):
            raise TypeError(f"{option.name}: expected a TieredShardingOption")
        out.append(option)
    return out


def rank_step_times(plan: list[ShardingOption], context: PlanningContext) -> list[StepTime]:
    """Per rank, the sum of its shards' step times (the fixed per-step cost not included)."""
    times = [StepTime() for _ in range(context.world_size)]
    for option in _options(plan):
        for shard, t in zip(option.shards, option.step_times):
            if shard.rank is not None:
                times[shard.rank] = times[shard.rank] + t
    return times


def rank_critical(t: StepTime, context: PlanningContext) -> float:
    """A rank's step time: fixed cost plus its shards' (overlapped when pipelined)."""
    return context.host.compute.step_overhead_us * 1e-6 + t.critical(context.config.overlap_tier_io)


class TierPerfModel(PerfModel):
    """Rates a plan by its step time: the slowest rank's, since ranks synchronise every step."""

    def __init__(self, context: PlanningContext) -> None:
        self.context = context

    def rate(self, plan: list[ShardingOption]) -> float:
        return max(rank_critical(t, self.context) for t in rank_step_times(plan, self.context))


def _fits(demand: dict[Tier, int], free: dict[Tier, int]) -> bool:
    return all(nbytes <= free.get(tier, 0) for tier, nbytes in demand.items() if nbytes > 0)


def _cache_tier(option: TieredShardingOption, context: PlanningContext) -> Tier:
    """fbgemm's UVM cache lives in HBM; the tiered kernel's in the compute device's memory."""
    return Tier.HBM if option.placement is Placement.CACHED_DRAM else context.host.cache_tier


class _RankCaches:
    """Greedy cache sizing on one rank: repeatedly give a small increment of the rank's free
    cache memory to the cached shard whose step time it shortens most per byte."""

    def __init__(
        self,
        members: list[tuple[TieredShardingOption, int]],
        budgets: dict[Tier, int],
        context: PlanningContext,
        estimator: TieredShardEstimator,
    ) -> None:
        self.members = members
        self.budgets = budgets
        self.estimator = estimator
        self.overlap = context.config.overlap_tier_io
        self.context = context
        steps = context.config.cache_steps
        self.step_bytes = {tier: max(1, budget // steps) for tier, budget in budgets.items()}
        self.heap: list[tuple[float, int, int]] = []

    def tier_of(self, option: TieredShardingOption) -> Tier:
        return _cache_tier(option, self.context)

    def _bytes(self, option: TieredShardingOption, i: int, rows: int) -> int:
        return self.estimator.demand(option, i, rows).get(self.tier_of(option), 0)

    def offer(self, k: int) -> None:
        option, i = self.members[k]
        tier = self.tier_of(option)
        rows = option.stored_rows(i)
        current = option.cache_rows[i]
        per_row = self._bytes(option, i, current + 1) - self._bytes(option, i, current)
        if current >= rows or per_row <= 0:
            return
        inc = min(rows - current, max(1, self.step_bytes[tier] // per_row))
        inc = min(inc, self.budgets[tier] // per_row)
        if inc <= 0:
            return
        now = option.step_times[i].critical(self.overlap)
        after = self.estimator.step_time(option, i, current + inc).critical(self.overlap)
        gain = (now - after) / (inc * per_row)
        if gain > 0:
            heapq.heappush(self.heap, (-gain, k, inc))

    def run(self) -> None:
        for k in range(len(self.members)):
            self.offer(k)
        while self.heap:
            _, k, inc = heapq.heappop(self.heap)
            option, i = self.members[k]
            tier = self.tier_of(option)
            current = option.cache_rows[i]
            cost = self._bytes(option, i, current + inc) - self._bytes(option, i, current)
            if cost > self.budgets[tier]:
                self.offer(k)  # the budget shrank since this offer was made
                continue
            self.budgets[tier] -= cost
            self.estimator.update_shard(option, i, current + inc)
            self.offer(k)


def size_caches(
    plan: list[TieredShardingOption],
    free: list[dict[Tier, int]],
    context: PlanningContext,
    estimator: TieredShardEstimator,
) -> None:
    """Grows the caches of cached shards greedily, rank by rank, within each rank's free cache
    memory less the configured headroom (see :class:`_RankCaches`); then makes each table's
    cache one fraction of its rows for all its shards (a plan carries one cache load factor per
    table), the smallest any shard got, so no rank exceeds its budget. Updates demand, perf and
    ``free`` in place."""
    cfg = context.config
    for rank in range(context.world_size):
        members = [
            (option, i)
            for option in plan
            if option.placement.cached
            for i, shard in enumerate(option.shards)
            if shard.rank == rank
        ]
        if not members:
            continue
        tiers = {_cache_tier(o, context) for o, _ in members}
        budgets = {
            t: free[rank].get(t, 0) - int(cfg.cache_headroom * context.capacity(t)) for t in tiers
        }
        _RankCaches(members, budgets, context, estimator).run()
    # One cache fraction per table, the smallest of its shards'.
    for option in plan:
        if not option.placement.cached:
            continue
        factor = option.cache_load_factor_value * (1.0 - 1e-12)
        for i in range(len(option.shards)):
            rows = option.stored_rows(i)
            if rows > 0:
                cache = max(1, min(rows, math.ceil(factor * rows)))
                if cache != option.cache_rows[i]:
                    estimator.update_shard(option, i, cache)
    # What is left on each rank, from the shards' final demands.
    for rank in range(context.world_size):
        for tier in free[rank]:
            free[rank][tier] = context.capacity(tier)
    for option in plan:
        for shard, demand in zip(option.shards, option.demands):
            if shard.rank is not None:
                for tier, nbytes in demand.items():
                    free[shard.rank][tier] = free[shard.rank].get(tier, 0) - nbytes


class TierPartitioner(Partitioner):
    """Rank assignment with per-tier, per-rank capacities, then greedy cache sizing.

    Args:
        context: the planning context (capacities per rank come from its host topology).
        estimator: re-estimates shards whose cache grows.

    Attributes:
        last_report: demand against capacity of the last proposal that did not fit.
    """

    def __init__(self, context: PlanningContext, estimator: TieredShardEstimator) -> None:
        self.context = context
        self.estimator = estimator
        self.last_report: PlacementReport | None = None

    def _capacities(self) -> dict[Tier, int]:
        return {tier: self.context.capacity(tier) for tier in self.context.tiers()}

    def partition(
        self, proposal: list[ShardingOption], storage_constraint: Topology | None = None
    ) -> list[ShardingOption]:
        ctx = self.context
        plan = _options(copy.deepcopy(proposal))
        capacity = self._capacities()
        free = [dict(capacity) for _ in range(ctx.world_size)]
        used: list[dict[Tier, int]] = [{} for _ in range(ctx.world_size)]
        load = [0.0] * ctx.world_size
        unplaced: list[str] = []
        overlap = ctx.config.overlap_tier_io

        def place(option: TieredShardingOption, i: int, rank: int) -> None:
            option.shards[i].rank = rank
            for tier, nbytes in option.demands[i].items():
                free[rank][tier] = free[rank].get(tier, 0) - nbytes
                used[rank][tier] = used[rank].get(tier, 0) + nbytes
            load[rank] += option.step_times[i].critical(overlap)

        def describe(option: TieredShardingOption, i: int) -> str:
            demand = ", ".join(
                f"{t.value} {format_size(v)}" for t, v in option.demands[i].items() if v
            )
            return f"{option.describe()} shard {i}: {demand}"

        device: list[tuple[TieredShardingOption, int]] = []
        for option in plan:
            for i in range(len(option.shards)):
                if option.partition_by == PartitionByType.UNIFORM.value:
                    if not _fits(option.demands[i], free[i]):
                        unplaced.append(describe(option, i) + f" (fixed to rank {i})")
                    place(option, i, i)
                else:
                    device.append((option, i))

        def hardness(item: tuple[TieredShardingOption, int]) -> tuple[float, float]:
            option, i = item
            share = max(
                (n / capacity[t] if capacity.get(t) else math.inf)
                for t, n in option.demands[i].items()
            )
            return (-share, -option.step_times[i].critical(overlap))

        for option, i in sorted(device, key=hardness):
            demand = option.demands[i]
            fitting = [r for r in range(ctx.world_size) if _fits(demand, free[r])]
            if fitting:
                rank = min(fitting, key=lambda r: (load[r], r))
            else:
                unplaced.append(describe(option, i))
                biggest = max(demand, key=lambda t: demand[t])
                rank = max(range(ctx.world_size), key=lambda r: free[r].get(biggest, 0))
            place(option, i, rank)

        if unplaced:
            self.last_report = PlacementReport(
                capacity=capacity,
                demand=tuple(used),
                unplaced=tuple(unplaced),
                world_size=ctx.world_size,
                local_world_size=ctx.local_world_size,
            )
            raise PlacementError(self.last_report)
        size_caches(plan, free, ctx, self.estimator)
        return list(plan)
