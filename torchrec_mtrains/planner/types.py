"""Shared types of the tiered planner: its config, the planning context, sharding options that
know their tier and cache, and the error raised when nothing fits.

TorchRec's planner types are reused as they are (``ShardingOption``, ``Shard``, ``Storage``,
``Perf``, ``PlannerError``); what TorchRec cannot express is added beside them: a placement on
one of five memory placements, a cache size per shard and a demand per tier (TorchRec's
``Storage`` has only ``hbm`` / ``ddr`` / ``ssd``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

from torchrec.distributed.planner.types import (
    PlannerError,
    PlannerErrorType,
    ShardingOption,
)

from torchrec_mtrains.cache.policies import DEFAULT_POLICY, registered_policy
from torchrec_mtrains.planner.access import TableAccess
from torchrec_mtrains.planner.perf_model import Placement, StepTime
from torchrec_mtrains.planner.sizes import format_size, parse_size
from torchrec_mtrains.planner.topology import HostTopology
from torchrec_mtrains.tiers._blockio import IDLE_PASSES
from torchrec_mtrains.types import Tier

IO_BUFFER_PASSES = IDLE_PASSES + 1  # the block stores' buffers: one pass in use, the idle ones

__all__ = [
    "PlacementError",
    "PlacementReport",
    "PlannerConfig",
    "PlanningContext",
    "TieredShardingOption",
]


@dataclass
class PlannerConfig:
    """Knobs of the tiered planner (Hydra group ``planner``, preset ``conf/planner/tiered.yaml``).

    Args:
        name: preset name (the app dispatches on it).
        cache_policy: eviction policy of tiered tables' caches, one registered in ``POLICIES``
            (``lru``, ``lfu``).
        cache_headroom: fraction of each rank's cache memory (HBM on GPU hosts, DRAM on CPU
            hosts) the cache sizing leaves free, for allocator slack and batch buffers.
        min_cache_factor: a cache holds at least this many times a step's expected distinct
            ids: every row of a batch must be resident at once, and batches vary.
        min_cache_rows: and at least this many rows.
        cache_steps: increments in which the greedy sizing hands out each rank's cache memory.
        overlap_tier_io: the training loop prefetches the next batch's rows while the current
            one computes (cDLRM look-ahead): a rank's step is the longer of the two, not the sum.
        default_pooling: ids per sample assumed for tables without a profile.
        split_tables: offer row-wise (GPU hosts) or column-wise (CPU hosts) sharding of tables,
            for tables too big for one rank and to spread a hot table's load.
        balance_rounds: after a plan fits, how many times to try splitting the busiest rank's
            heaviest table to shorten the step.
        profile: path of an access profile JSON (``python -m apps.dlrm.profile``);
            empty for none.
        dram_budget: host memory per host the embedding tables and their caches may use
            (e.g. ``2GB``), in place of the topology's DRAM capacity less ``dram_reserved``;
            empty for the topology's. This is how a run emulates a capacity-bound host.
        byte_scm_budget: likewise, the byte SCM capacity per host; empty for the topology's.
        pin_hot_rows: with a profile, keep each tiered table's hottest rows (up to a quarter of
            its cache) resident for good (FAE).
        max_live_rows: per virtual table (``use_virtual_table=True``), the most ids it holds
            at once: the planner sizes its store (and cache) from this bound, not from its
            ``num_embeddings`` id space.
    """

    name: str = "tiered"
    cache_policy: str = DEFAULT_POLICY
    cache_headroom: float = 0.05
    min_cache_factor: float = 2.0
    min_cache_rows: int = 1024
    cache_steps: int = 256
    overlap_tier_io: bool = False
    default_pooling: float = 1.0
    split_tables: bool = True
    balance_rounds: int = 8
    profile: str = ""
    dram_budget: str = ""
    byte_scm_budget: str = ""
    pin_hot_rows: bool = True
    max_live_rows: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        registered_policy(self.cache_policy, "cache_policy")
        for table, bound in self.max_live_rows.items():
            if int(bound) < 1:
                raise ValueError(f"planner.max_live_rows.{table} must be >= 1, got {bound}")
        for name in ("dram_budget", "byte_scm_budget"):  # "" leaves the topology's
            if getattr(self, name) != "":
                parse_size(getattr(self, name), f"planner.{name}")
        if not 0.0 <= self.cache_headroom < 1.0:
            raise ValueError(f"cache_headroom must be in [0, 1), got {self.cache_headroom}")
        if self.min_cache_factor < 1.0:
            raise ValueError(f"min_cache_factor must be >= 1, got {self.min_cache_factor}")
        for name in ("min_cache_rows", "cache_steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.balance_rounds < 0:
            raise ValueError(f"balance_rounds must be >= 0, got {self.balance_rounds}")
        if self.default_pooling <= 0 or not math.isfinite(self.default_pooling):
            raise ValueError(f"default_pooling must be positive, got {self.default_pooling}")

    def for_lookahead(self, lookahead: int) -> PlannerConfig:
        """This config for a training loop that prefetches ``lookahead`` batches ahead of the
        running one (cDLRM; 0 = no look-ahead).

        The ``lookahead + 1`` batches resident at once must all fit every cache, each with half
        a batch of slack as batches vary, so the smallest cache is ``1.5 * (lookahead + 1)``
        steps' distinct ids (never less than ``min_cache_factor``); and tier I/O overlaps
        compute whenever something is prefetched.

        Raises:
            ValueError: for a negative ``lookahead``.
        """
        if lookahead < 0:
            raise ValueError(f"lookahead={lookahead}: must be 0 or more batches")
        return replace(
            self,
            min_cache_factor=max(self.min_cache_factor, 1.5 * (lookahead + 1)),
            overlap_tier_io=lookahead > 0,
        )

    @classmethod
    def from_mapping(cls, node: Mapping[str, Any]) -> PlannerConfig:
        """Builds the config from a mapping (e.g. the app's ``cfg.planner``); unknown keys
        raise ``ValueError`` listing the known ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(node) - known)
        if unknown:
            raise ValueError(f"unknown planner keys {unknown}; known: {sorted(known)}")
        return cls(**{str(k): v for k, v in node.items()})


class BufferBudgetError(ValueError):
    """The block tier's I/O buffers alone take all of a rank's DRAM for tables.

    Attributes:
        held: the buffers' bytes a rank (two passes of ``max_pass_bytes``).
        dram: a rank's DRAM for tables and caches.
    """

    def __init__(self, held: int, dram: int) -> None:
        self.held, self.dram = held, dram
        super().__init__(
            f"the block tier's I/O buffers ({format_size(held)} a rank: {IO_BUFFER_PASSES} "
            f"passes of max_pass_bytes={held // IO_BUFFER_PASSES}) take all of a rank's DRAM "
            f"for tables ({format_size(dram)}); lower the block tier's max_pass_bytes or raise "
            "the DRAM budget"
        )


@dataclass
class PlanningContext:
    """Everything the enumerator, estimator, proposer and partitioner share for one plan.

    Args:
        host: the topology of every host.
        world_size: ranks in the job.
        local_world_size: ranks per host.
        batch_size: samples per rank per step.
        config: planner knobs.
        access: access statistics by table name, filled by the enumerator.
    """

    host: HostTopology
    world_size: int
    local_world_size: int
    batch_size: int
    config: PlannerConfig = field(default_factory=PlannerConfig)
    access: dict[str, TableAccess] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.batch_size < 1:
            raise ValueError(
                f"world_size and batch_size must be >= 1, got {self.world_size}, {self.batch_size}"
            )
        if not 1 <= self.local_world_size <= self.world_size:
            raise ValueError(
                f"local_world_size must be in [1, world_size={self.world_size}], got "
                f"{self.local_world_size}"
            )
        held = self.io_buffer_bytes()
        dram = self.host.rank_capacity(Tier.DRAM, self.local_world_size)
        if held and held >= dram:
            raise BufferBudgetError(held, dram)
        if self.host.gpu is not None and self.local_world_size > self.host.gpu.count:
            raise ValueError(
                f"host {self.host.name!r} has {self.host.gpu.count} GPUs; cannot run "
                f"{self.local_world_size} ranks on it"
            )

    @property
    def samples_per_step(self) -> int:
        """The global batch: every table-wise shard serves all of it."""
        return self.batch_size * self.world_size

    @property
    def num_hosts(self) -> int:
        return -(-self.world_size // self.local_world_size)

    def capacity(self, tier: Tier) -> int:
        """Bytes of ``tier`` each rank may use for tables and caches: on DRAM, less the I/O
        buffers of the rank's block stores (:meth:`io_buffer_bytes`)."""
        capacity = self.host.rank_capacity(tier, self.local_world_size)
        if tier is Tier.DRAM:
            capacity -= self.io_buffer_bytes()
        return capacity

    def io_buffer_bytes(self) -> int:
        """DRAM a rank's block stores take for I/O buffers: the tier worker moves one table's
        rows at a time through a pool its stores share, holding one pass's buffer in use and
        one idle (``max_pass_bytes`` each). None without a block tier."""
        block = self.host.block_scm
        if block is None:
            return 0
        return IO_BUFFER_PASSES * block.max_pass_bytes

    def tiers(self) -> tuple[Tier, ...]:
        return self.host.tiers()


class TieredShardingOption(ShardingOption):
    """A TorchRec ``ShardingOption`` that also knows where its rows live, each shard's cache
    size, per-tier demand and step-time breakdown.

    Args:
        placement: where the rows live and how they are computed.
        access: the table's access statistics (shared, never copied).
        table_rows / table_cols: the whole table's shape (shards may be parts of it); a
            virtual table's rows are its id space.
        state_width: optimizer-state values per row.
        element_bytes: bytes per stored weight (the optimizer state is fp32).
        live_rows: a virtual table's bound on live ids (its stores hold that many rows, split
            over row-wise shards by their share of the id space); ``None`` for other tables.
        **kwargs: TorchRec's ``ShardingOption`` arguments.
    """

    def __init__(
        self,
        *,
        placement: Placement,
        access: TableAccess,
        table_rows: int,
        table_cols: int,
        state_width: int,
        element_bytes: int,
        live_rows: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.live_rows = live_rows
        self.placement = placement
        self.access = access
        self.table_rows = table_rows
        self.table_cols = table_cols
        self.state_width = state_width
        self.element_bytes = element_bytes
        self.cache_rows: list[int] = [0] * len(self.shards)
        self.hit_rates: list[float] = [0.0] * len(self.shards)
        self.demands: list[dict[Tier, int]] = [{} for _ in self.shards]
        self.step_times: list[StepTime] = [StepTime() for _ in self.shards]

    def __hash__(self) -> int:
        return hash((super().__hash__(), self.placement, tuple(self.cache_rows)))

    def stored_rows(self, index: int) -> int:
        """Rows shard ``index`` stores: its rows, or a virtual table's share of its bound."""
        rows = int(self.shards[index].size[0])
        if self.live_rows is None:
            return rows
        return max(1, math.ceil(self.live_rows * rows / self.table_rows))

    def __deepcopy__(self, memo: dict[int, Any] | None) -> TieredShardingOption:
        cls = self.__class__
        result = cls.__new__(cls)
        for k, v in self.__dict__.items():
            shared = k in ("_tensor", "_module", "access")
            setattr(result, k, v if shared else copy.deepcopy(v, memo))
        return result

    @property
    def cache_load_factor_value(self) -> float:
        """The cache as a fraction of rows, one value for all shards (the smallest)."""
        stored = [self.stored_rows(i) for i in range(len(self.shards))]
        factors = [c / n for c, n in zip(self.cache_rows, stored) if n > 0]
        return min(factors) if factors else 0.0

    def total_demand(self) -> dict[Tier, int]:
        out: dict[Tier, int] = {}
        for demand in self.demands:
            for tier, nbytes in demand.items():
                out[tier] = out.get(tier, 0) + nbytes
        return out

    def critical_time(self, overlap_tier_io: bool) -> float:
        return sum(t.critical(overlap_tier_io) for t in self.step_times)

    def describe(self) -> str:
        return f"{self.name} ({self.sharding_type}, {self.placement.value})"


@dataclass(frozen=True)
class PlacementReport:
    """Demand against capacity per tier and rank for a placement that does not fit.

    Args:
        capacity: bytes per rank of each tier.
        demand: per rank, bytes asked of each tier by the shards placed there (shards that fit
            nowhere are charged to the rank with the most room in their largest demand).
        unplaced: descriptions of the shards that fit on no rank.
        world_size / local_world_size: the job's shape.
    """

    capacity: Mapping[Tier, int]
    demand: tuple[Mapping[Tier, int], ...]
    unplaced: tuple[str, ...]
    world_size: int
    local_world_size: int

    def over(self) -> list[tuple[Tier, int]]:
        """(tier, rank) pairs whose demand exceeds capacity."""
        return [
            (tier, rank)
            for tier, cap in self.capacity.items()
            for rank, d in enumerate(self.demand)
            if d.get(tier, 0) > cap
        ]

    def format(self, max_rows: int = 32) -> str:
        over = set(self.over())
        header = f"{'tier':<10} {'rank':>5} {'demand':>12} {'capacity':>12}  status"
        lines = [header, "-" * len(header)]
        shown = 0
        hidden = 0
        for tier, cap in self.capacity.items():
            demand_total = sum(d.get(tier, 0) for d in self.demand)
            if demand_total == 0 and cap == 0:
                continue
            for rank, d in enumerate(self.demand):
                used = d.get(tier, 0)
                is_over = (tier, rank) in over
                if shown >= max_rows and not is_over:
                    hidden += 1
                    continue
                shown += 1
                status = f"OVER by {format_size(used - cap)}" if is_over else "ok"
                lines.append(
                    f"{tier.value:<10} {rank:>5} {format_size(used):>12} "
                    f"{format_size(cap):>12}  {status}"
                )
            lines.append(
                f"{tier.value:<10} {'all':>5} {format_size(demand_total):>12} "
                f"{format_size(cap * self.world_size):>12}"
            )
        if hidden:
            lines.append(f"({hidden} more tier/rank rows within capacity not shown)")
        return "\n".join(lines)


class PlacementError(PlannerError):
    """No placement of the tables fits the ranks' tiers; the message lists demand against
    capacity per tier and rank for the most compact placement tried."""

    def __init__(self, report: PlacementReport, reason: str = "") -> None:
        self.report = report
        unplaced = ""
        if report.unplaced:
            unplaced = "\nshards that fit on no rank:\n  " + "\n  ".join(report.unplaced)
        message = (
            f"no placement of the embedding tables fits {report.world_size} rank(s) "
            f"({report.local_world_size} per host){': ' + reason if reason else ''}.\n"
            "Demand against capacity per tier and rank (most compact placement tried):\n"
            f"{report.format()}{unplaced}\n"
            "Add ranks or hosts, add a storage tier, or shrink the tables."
        )
        super().__init__(message, PlannerErrorType.INSUFFICIENT_STORAGE)
