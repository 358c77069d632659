"""The plan printout: one line per table (where it lives, its cache and expected hit rate, its
ranks and bytes per tier), one per rank (predicted step time, bytes against capacity), and the
plan's predicted step time and throughput.

Where a measured profile holds policy curves, each cached table's line also shows the hit rate
of Belady's optimal replacement (MIN) at the planned cache size on the profiled trace, and that
of the cache's own policy when it is not LRU (the planner's estimate is LRU's): how far the
cache is from the best any policy could do at that size. Reported only: the plan is the same
with or without them."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from torchrec.distributed.types import ShardingType

from torchrec_mtrains.cache.policies import DEFAULT_POLICY
from torchrec_mtrains.planner.enumerators import kernel_for
from torchrec_mtrains.planner.partitioners import rank_critical, rank_step_times
from torchrec_mtrains.planner.sizes import format_size
from torchrec_mtrains.planner.types import PlanningContext, TieredShardingOption
from torchrec_mtrains.profiler.types import ReplacementPolicy
from torchrec_mtrains.types import Tier

__all__ = ["PlanSummary", "RankLine", "TableLine", "summarize"]

_KERNEL_NAMES = {"customized_kernel": "tiered"}


@dataclass(frozen=True)
class TableLine:
    """One table of the plan.

    ``optimal_hit_rate`` is MIN's hit rate at the planned cache size on the profiled trace,
    ``policy_hit_rate`` the cache's own policy's there when it is not LRU; ``None`` without a
    profile's policy curves (or for a table without a cache)."""

    table: str
    rows: int
    dim: int
    tier: Tier
    kernel: str
    sharding: str
    cache_rows: int
    hit_rate: float | None
    ranks: tuple[int, ...]
    bytes: Mapping[Tier, int]
    source: str
    step_ms: float
    optimal_hit_rate: float | None = None
    policy_hit_rate: float | None = None


@dataclass(frozen=True)
class RankLine:
    """One rank of the plan."""

    rank: int
    step_ms: float
    io_ms: float
    used: Mapping[Tier, int]


@dataclass(frozen=True)
class PlanSummary:
    """What a plan does, for people: printed by ``str(summary)``.

    Attributes:
        host: hardware preset name.
        world_size / local_world_size / batch_size: the job.
        tables / ranks: per-table and per-rank lines.
        capacity: bytes per rank of each tier.
        step_time_s: predicted step time (slowest rank).
        notes: statements about the inputs (e.g. that access was assumed uniform).
        cache_policy: the tiered caches' eviction policy.
    """

    host: str
    world_size: int
    local_world_size: int
    batch_size: int
    tables: tuple[TableLine, ...]
    ranks: tuple[RankLine, ...]
    capacity: Mapping[Tier, int]
    step_time_s: float
    notes: tuple[str, ...]
    cache_policy: str = DEFAULT_POLICY

    @property
    def hosts(self) -> int:
        return -(-self.world_size // self.local_world_size)

    @property
    def throughput(self) -> float:
        """Predicted samples per second of the whole job."""
        return self.batch_size * self.world_size / self.step_time_s

    def bytes_per_tier(self) -> dict[Tier, int]:
        out: dict[Tier, int] = {}
        for line in self.tables:
            for tier, nbytes in line.bytes.items():
                out[tier] = out.get(tier, 0) + nbytes
        return out

    def format(self, max_ranks: int = 16, max_tables: int = 64) -> str:
        tiers = [t for t in self.capacity if any(line.bytes.get(t) for line in self.tables)]
        cols = "".join(f"{t.value:>11}" for t in tiers)
        profiled = [
            (label, attr)
            for label, attr in (
                (self.cache_policy.upper(), "policy_hit_rate"),
                ("MIN", "optimal_hit_rate"),
            )
            if any(getattr(line, attr) is not None for line in self.tables)
        ]
        header = (
            f"{'table':<16}{'rows':>14}{'dim':>5}  {'tier':<10}{'kernel':<18}{'cache rows':>12}"
            f"{'hit rate':>9}{''.join(f'{label:>7}' for label, _ in profiled)}  {'ranks':<12}"
            f"{cols}  source"
        )
        out = [
            f"plan for {self.world_size} rank(s) on {self.hosts} {self.host} host(s) "
            f"({self.local_world_size} per host), batch {self.batch_size} per rank",
            *[f"note: {n}" for n in self.notes],
            header,
            "-" * len(header),
        ]
        for line in self.tables[:max_tables]:
            hit = "-" if line.hit_rate is None else f"{line.hit_rate:.3f}"
            cache = "-" if line.hit_rate is None else str(line.cache_rows)
            ranks = _ranks(line.ranks)
            sizes = "".join(f"{format_size(line.bytes.get(t, 0)):>11}" for t in tiers)
            rates = "".join(f"{_rate(getattr(line, attr)):>7}" for _, attr in profiled)
            out.append(
                f"{line.table:<16}{line.rows:>14}{line.dim:>5}  {line.tier.value:<10}"
                f"{line.kernel:<18}{cache:>12}{hit:>9}{rates}  {ranks:<12}{sizes}  {line.source}"
            )
        if len(self.tables) > max_tables:
            out.append(f"({len(self.tables) - max_tables} more tables not shown)")
        totals = self.bytes_per_tier()
        out.append(
            "bytes per tier: "
            + ", ".join(f"{t.value} {format_size(totals.get(t, 0))}" for t in tiers)
        )
        rank_cols = "".join(f"{t.value + ' used/cap':>24}" for t in tiers)
        out += ["", f"{'rank':>5}{'step ms':>10}{'tier I/O ms':>13}{rank_cols}"]
        slowest = sorted(self.ranks, key=lambda r: -r.step_ms)
        shown = sorted(slowest[:max_ranks], key=lambda r: r.rank)
        for r in shown:
            usage = "".join(
                f"{format_size(r.used.get(t, 0)) + ' / ' + format_size(self.capacity[t]):>24}"
                for t in tiers
            )
            out.append(f"{r.rank:>5}{r.step_ms:>10.2f}{r.io_ms:>13.2f}{usage}")
        if len(self.ranks) > max_ranks:
            out.append(f"({len(self.ranks) - max_ranks} faster ranks not shown)")
        out.append(
            f"predicted step time {self.step_time_s * 1e3:.2f} ms (slowest rank), "
            f"throughput {self.throughput:,.0f} samples/s"
        )
        return "\n".join(out)

    def __str__(self) -> str:
        return self.format()


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _natural(name: str) -> tuple[str | int, ...]:
    """Sort key putting ``t_cat_2`` before ``t_cat_10``."""
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name))


def _ranks(ranks: Sequence[int]) -> str:
    uniq = sorted(set(ranks))
    if len(uniq) > 3 and uniq == list(range(uniq[0], uniq[-1] + 1)):
        return f"{uniq[0]}-{uniq[-1]}"
    text = ",".join(map(str, uniq))
    return text if len(text) <= 11 else text[:9] + ".."


def summarize(
    plan: Sequence[TieredShardingOption], context: PlanningContext, notes: Sequence[str] = ()
) -> PlanSummary:
    """Builds the printout of a partitioned plan."""
    on_gpu = context.host.gpu is not None
    overlap = context.config.overlap_tier_io
    policy = context.config.cache_policy
    tables = []
    for option in sorted(plan, key=lambda o: _natural(o.name)):
        cached = option.placement.cached
        unique = [option.access.unique_rows(context.samples_per_step)] * len(option.shards)
        weight = sum(unique) or 1.0
        hit = sum(h * u for h, u in zip(option.hit_rates, unique)) / weight if cached else None
        kernel = kernel_for(option.placement, on_gpu)
        tables.append(
            TableLine(
                table=option.name,
                rows=option.table_rows,
                dim=option.table_cols,
                tier=option.placement.rows_tier,
                kernel=_KERNEL_NAMES.get(kernel, kernel),
                sharding=option.sharding_type,
                cache_rows=sum(option.cache_rows) if cached else 0,
                hit_rate=hit,
                ranks=tuple(int(s.rank) for s in option.shards if s.rank is not None),
                bytes=option.total_demand(),
                source=option.access.source,
                step_ms=option.critical_time(overlap) * 1e3,
                optimal_hit_rate=_profiled_rate(option, ReplacementPolicy.MIN, unique)
                if cached
                else None,
                policy_hit_rate=_profiled_rate(option, policy, unique)
                if cached and policy != ReplacementPolicy.LRU.value
                else None,
            )
        )
    times = rank_step_times(list(plan), context)
    used: list[dict[Tier, int]] = [{} for _ in range(context.world_size)]
    for option in plan:
        for shard, demand in zip(option.shards, option.demands):
            if shard.rank is None:
                continue
            for tier, nbytes in demand.items():
                used[shard.rank][tier] = used[shard.rank].get(tier, 0) + nbytes
    ranks = tuple(
        RankLine(
            rank=r,
            step_ms=rank_critical(t, context) * 1e3,
            io_ms=t.io * 1e3,
            used=used[r],
        )
        for r, t in enumerate(times)
    )
    return PlanSummary(
        host=context.host.name,
        world_size=context.world_size,
        local_world_size=context.local_world_size,
        batch_size=context.batch_size,
        tables=tuple(tables),
        ranks=ranks,
        capacity={t: context.capacity(t) for t in context.tiers()},
        step_time_s=max(r.step_ms for r in ranks) / 1e3,
        notes=tuple(notes) + _buffer_note(context) + _policy_note(plan, policy),
        cache_policy=policy,
    )


def _profiled_rate(
    option: TieredShardingOption, policy: str, weights: Sequence[float]
) -> float | None:
    """The profiled hit rate of ``policy`` at the option's planned caches, its shards weighted
    as for the plan's hit rate; ``None`` where the profile has no such curve or a cache is
    below the smallest that runs the profiled trace."""
    if policy not in {p.value for p in ReplacementPolicy}:
        return None  # a policy of its own: no profiled curve
    rates = []
    for index, rows in enumerate(option.cache_rows):
        # A row-wise shard's cache acts as a proportionally larger one of the whole table, as
        # the shard estimator costs it.
        shard_rows = int(option.shards[index].size[0])
        row_wise = option.sharding_type == ShardingType.ROW_WISE.value
        fraction = max(shard_rows / option.table_rows, 1e-12) if row_wise else 1.0
        rate = option.access.policy_hit_rate(policy, rows / fraction)
        if rate is None:
            return None
        rates.append(rate)
    weight = sum(weights) or 1.0
    return sum(r * w for r, w in zip(rates, weights)) / weight


def _policy_note(plan: Sequence[TieredShardingOption], policy: str) -> tuple[str, ...]:
    lookaheads = sorted(
        {o.access.policy_curves.lookahead for o in plan if o.access.policy_curves is not None}
    )
    if not lookaheads:
        return ()
    which = "MIN" if policy == ReplacementPolicy.LRU.value else f"{policy.upper()} and MIN"
    return (
        f"{which}: hit rates at the planned cache size on the profiled trace, look-ahead "
        f"{'/'.join(map(str, lookaheads))} (the rows of the batches in flight held); MIN is "
        "Belady's optimal replacement, the bound for any policy; 'hit rate' is the planner's "
        "estimate, LRU's",
    )


def _buffer_note(context: PlanningContext) -> tuple[str, ...]:
    held = context.io_buffer_bytes()
    if not held:
        return ()
    return (f"{format_size(held)} of DRAM per rank held for the block tier's I/O buffers",)
