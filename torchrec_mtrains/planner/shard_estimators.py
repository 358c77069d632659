"""Storage and perf estimates of tiered sharding options, behind TorchRec's ``ShardEstimator``.

TorchRec's own estimators cannot be used: the default perf estimator raises for
``CUSTOMIZED_KERNEL`` and its storage estimate knows only HBM / DDR / SSD. This one fills, per
shard, the demand on each of our tiers, TorchRec's ``Storage`` (HBM, DDR, and the two SCM tiers
summed as ``ssd``, so TorchRec's own bookkeeping stays meaningful) and ``Perf`` from
:mod:`~torchrec_mtrains.planner.perf_model`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

from torchrec.distributed.planner.types import (
    Perf,
    ShardEstimator,
    ShardingOption,
    Storage,
    Topology,
)
from torchrec.distributed.types import ShardingType

from torchrec_mtrains.planner.access import TableAccess
from torchrec_mtrains.planner.perf_model import (
    Placement,
    ShardWork,
    StepTime,
    cache_bytes,
    shard_step_time,
    slot_map_bytes,
)
from torchrec_mtrains.planner.topology import BlockTierConfig
from torchrec_mtrains.planner.types import PlanningContext, TieredShardingOption
from torchrec_mtrains.tiers.log_block_scm import index_bytes_per_row
from torchrec_mtrains.types import Tier, stored_row_bytes

logger = logging.getLogger(__name__)

__all__ = ["TieredShardEstimator", "optimizer_state_width", "table_work"]

# optimizer -> (state values per row independent of dim, state values per column)
_STATE_WIDTH: dict[str, tuple[int, int]] = {
    "EXACT_SGD": (0, 0),
    "SGD": (0, 0),
    "EXACT_ROWWISE_ADAGRAD": (1, 0),
    "ROWWISE_ADAGRAD": (1, 0),
    "EMAINPLACE_ROWWISE_ADAGRAD": (1, 0),
    "EXACT_ADAGRAD": (0, 1),
    "ADAM": (0, 2),
    "PARTIAL_ROWWISE_ADAM": (1, 1),
    "LAMB": (0, 2),
}
_warned: set[str] = set()


def optimizer_state_width(fused_params: dict[str, Any] | None, dim: int) -> int:
    """Optimizer-state values per row for the sharder's fused optimizer (row-wise Adagrad, 1,
    when none is named: TorchRec's usual choice)."""
    optimizer = (fused_params or {}).get("optimizer")
    name = getattr(optimizer, "name", str(optimizer) if optimizer is not None else "")
    if not name:
        return 1
    width = _STATE_WIDTH.get(name.upper())
    if width is None:
        if name not in _warned:
            _warned.add(name)
            logger.warning("unknown fused optimizer %s: assuming one state value per row", name)
        return 1
    per_row, per_col = width
    return per_row + per_col * dim


def table_work(
    access: TableAccess,
    cols: int,
    samples: float,
    *,
    state_width: int = 1,
    element_bytes: int = 4,
    rows: int | None = None,
    row_fraction: float = 1.0,
    pooled: bool = True,
) -> ShardWork:
    """The traffic per step of a table (or of a shard holding ``row_fraction`` of its rows, or
    ``cols`` of its columns) serving ``samples`` samples: what the estimator predicts from."""
    return ShardWork(
        rows=rows if rows is not None else access.num_rows,
        cols=cols,
        state_width=state_width,
        element_bytes=element_bytes,
        samples=samples,
        lookups=access.lookups(samples) * row_fraction,
        unique_rows=access.unique_rows(samples) * row_fraction,
        pooled=pooled,
    )


class TieredShardEstimator(ShardEstimator):
    """Fills ``storage`` and ``perf`` of every shard of :class:`TieredShardingOption` options.

    Args:
        context: the planning context (host figures, world, batch, access statistics).
        topology: unused; accepted for TorchRec's ``ShardEstimator`` signature.
    """

    def __init__(
        self,
        context: PlanningContext,
        topology: Topology | None = None,
        constraints: Any = None,
    ) -> None:
        self.context = context

    # ------------------------------------------------------------------------------ per shard

    def work(self, option: TieredShardingOption, index: int) -> ShardWork:
        """The traffic of shard ``index`` of ``option`` per step."""
        shard = option.shards[index]
        return table_work(
            option.access,
            int(shard.size[1]),
            float(self.context.samples_per_step),
            state_width=option.state_width,
            element_bytes=option.element_bytes,
            rows=option.stored_rows(index),
            row_fraction=self._row_fraction(option, index),
            pooled=option.is_pooled,
        )

    def _row_fraction(self, option: TieredShardingOption, index: int) -> float:
        """Row-wise shards see the share of ids that falls in their rows."""
        if option.sharding_type != ShardingType.ROW_WISE.value:
            return 1.0
        return max(int(option.shards[index].size[0]) / option.table_rows, 1e-12)

    def hit_rate(self, option: TieredShardingOption, index: int, cache_rows: float) -> float:
        """Hit rate of a cache of ``cache_rows`` rows in front of shard ``index``: a row-wise
        shard's cache behaves like a proportionally larger cache of the whole table."""
        frac = self._row_fraction(option, index)
        return option.access.hit_rate(cache_rows / frac, float(self.context.samples_per_step))

    def min_cache_rows(self, option: TieredShardingOption, index: int) -> int:
        """The smallest cache that holds every row of a batch (with margin)."""
        rows = option.stored_rows(index)
        cfg = self.context.config
        unique = self.work(option, index).unique_rows
        return max(1, min(rows, max(cfg.min_cache_rows, math.ceil(cfg.min_cache_factor * unique))))

    def demand(self, option: TieredShardingOption, index: int, cache_rows: int) -> dict[Tier, int]:
        """Bytes shard ``index`` asks of each tier with a cache of ``cache_rows`` rows."""
        shard = option.shards[index]
        rows, cols = option.stored_rows(index), int(shard.size[1])
        row_bytes = stored_row_bytes(cols, option.state_width, option.element_bytes)
        placement = option.placement
        out: dict[Tier, int] = {placement.rows_tier: rows * row_bytes}
        if placement is Placement.CACHED_DRAM:  # FUSED_UVM_CACHING: fbgemm's cache in HBM
            out[Tier.HBM] = out.get(Tier.HBM, 0) + cache_rows * row_bytes
        elif placement.cached:  # the tiered kernel: cache + its slot map
            cache_tier = self.context.host.cache_tier
            out[cache_tier] = out.get(cache_tier, 0) + cache_bytes(cache_rows, row_bytes)
            virtual = option.live_rows is not None  # a virtual table: its id -> row map too
            out[Tier.DRAM] = out.get(Tier.DRAM, 0) + slot_map_bytes(rows, virtual)
            tier = self.context.host.memory(placement.rows_tier)
            if isinstance(tier, BlockTierConfig) and tier.layout == "log":  # the log's index
                index = math.ceil(rows * index_bytes_per_row(rows, tier.max_space_amplification))
                out[Tier.DRAM] += index
        return out

    def step_time(self, option: TieredShardingOption, index: int, cache_rows: float) -> StepTime:
        """Step time of shard ``index`` with a cache of ``cache_rows`` rows."""
        hit = self.hit_rate(option, index, cache_rows) if option.placement.cached else 0.0
        return shard_step_time(
            option.placement,
            self.work(option, index),
            self.context.host,
            cache_rows=cache_rows,
            hit_rate=hit,
            world_size=self.context.world_size,
            local_world_size=self.context.local_world_size,
        )

    def update_shard(self, option: TieredShardingOption, index: int, cache_rows: int) -> None:
        """Sets shard ``index``'s cache and refreshes its demand, storage and perf."""
        option.cache_rows[index] = cache_rows
        demand = self.demand(option, index, cache_rows)
        option.demands[index] = demand
        t = self.step_time(option, index, cache_rows)
        option.step_times[index] = t
        option.hit_rates[index] = (
            self.hit_rate(option, index, cache_rows) if option.placement.cached else 1.0
        )
        shard = option.shards[index]
        shard.storage = Storage(
            hbm=demand.get(Tier.HBM, 0),
            ddr=demand.get(Tier.DRAM, 0),
            ssd=demand.get(Tier.BYTE_SCM, 0) + demand.get(Tier.BLOCK_SCM, 0),
        )
        shard.perf = Perf(
            fwd_compute=t.compute / 3.0,
            fwd_comms=t.comms / 2.0,
            bwd_compute=2.0 * t.compute / 3.0,
            bwd_comms=t.comms / 2.0,
            prefetch_compute=t.cache + t.io,
        )

    # ------------------------------------------------------------------------- TorchRec API

    def estimate(
        self,
        sharding_options: list[ShardingOption],
        sharder_data_map: Any = None,
    ) -> None:
        """Estimates every shard with its smallest workable cache (the partitioner's cache
        sizing grows caches once shards have ranks)."""
        for option in sharding_options:
            if not isinstance(option, TieredShardingOption):
                raise TypeError(
                    f"{type(option).__name__} for {option.name}: the tiered estimator needs "
                    "options from the tiered enumerator"
                )
            for i in range(len(option.shards)):
                cache = self.min_cache_rows(option, i) if option.placement.cached else 0
                self.update_shard(option, i, cache)
