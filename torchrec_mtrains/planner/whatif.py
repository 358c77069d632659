"""What-if: how many hosts of each kind does a model need?

For one base host (a hardware preset with both storage tiers) four host types are compared:
HBM + DRAM only (DRAM only on CPU hosts), plus byte SCM, plus block SCM, plus both. For each,
the smallest number of hosts is searched for on which the tiered planner finds a placement
that fits every tier of every rank and, given a target, whose predicted throughput
(``world_size * batch_size / step time``) reaches it. Capacity alone sets a lower bound; the
search doubles the host count from there until a plan qualifies, then bisects. It assumes that
more hosts never hurt, which holds for capacity and, with row-wise splits, for throughput.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_mtrains.distributed.sharders import TieredEmbeddingBagCollectionSharder
from torchrec_mtrains.planner.access import TableAccess, from_profile, zipf_access
from torchrec_mtrains.planner.planners import TablePlan, plan_tables, with_budgets
from torchrec_mtrains.planner.stats import PlanSummary
from torchrec_mtrains.planner.topology import HostTopology
from torchrec_mtrains.planner.types import PlacementError, PlannerConfig
from torchrec_mtrains.profiler.types import AccessProfile
from torchrec_mtrains.types import Tier

logger = logging.getLogger(__name__)

__all__ = [
    "HostCount",
    "ModelTables",
    "host_variants",
    "min_hosts",
    "model_tables",
    "plan_model",
]


@dataclass(frozen=True)
class ModelTables:
    """A model config's tables as the planner needs them.

    Attributes:
        configs: one ``EmbeddingBagConfig`` per sparse feature, named as the DLRM app names
            them (``t_cat_<i>`` for feature ``cat_<i>``).
        poolings: ids per sample by table (from ``pooling_factors``, default 1).
        access: stated access statistics by table (from ``zipf_exponents``), if any.
        max_live_rows: each virtual table's bound on live rows (from ``virtual``), which
            sizes it instead of its id space.
    """

    configs: tuple[EmbeddingBagConfig, ...]
    poolings: Mapping[str, float]
    access: Mapping[str, TableAccess]
    max_live_rows: Mapping[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        """Weights only (fp32; a virtual table's live rows); the planner adds optimizer
        state."""
        return sum(
            self.max_live_rows.get(c.name, c.num_embeddings) * c.embedding_dim * 4
            for c in self.configs
        )

    def planner_config(self, config: PlannerConfig | None) -> PlannerConfig:
        """``config`` (the default one when ``None``) with the virtual tables' bounds, where it
        does not bound them itself."""
        config = config or PlannerConfig()
        if not self.max_live_rows:
            return config
        return replace(config, max_live_rows={**self.max_live_rows, **config.max_live_rows})


def _per_table(values: Any, n: int, key: str) -> list[Any] | None:
    if values is None:
        return None
    out = list(values)
    if len(out) == 1:
        return out * n
    if len(out) != n:
        raise ValueError(f"model.{key} has {len(out)} entries; give one per table ({n}) or one")
    return out


def model_tables(model: Mapping[str, Any], profile: AccessProfile | None = None) -> ModelTables:
    """Reads the app's model config keys: ``num_embeddings_per_feature``, ``embedding_dim``,
    and optionally per-table ``embedding_dims``, ``pooling_factors``, ``zipf_exponents``, and
    ``virtual`` (``features`` whose tables are virtual, their ``max_live_rows`` and
    ``total_num_buckets``).

    A measured profile takes precedence over the stated skews for the tables it covers.
    """
    sizes = [int(n) for n in model["num_embeddings_per_feature"]]
    n = len(sizes)
    if n == 0 or any(s < 1 for s in sizes):
        raise ValueError(f"model.num_embeddings_per_feature={sizes}: need >= 1 row per table")
    dims = (
        _per_table(model.get("embedding_dims"), n, "embedding_dims")
        or [int(model["embedding_dim"])] * n
    )
    poolings = _per_table(model.get("pooling_factors"), n, "pooling_factors") or [1.0] * n
    zipfs = _per_table(model.get("zipf_exponents"), n, "zipf_exponents")
    virtual = dict(model.get("virtual") or {})
    features = [int(f) for f in virtual.get("features") or []]
    bounds = _per_table(virtual.get("max_live_rows"), len(features), "virtual.max_live_rows")
    if features and not bounds:
        raise ValueError("model.virtual.max_live_rows: give the bound of each virtual table")
    live = {f"t_cat_{f}": int(b) for f, b in zip(features, bounds or [])}
    configs = tuple(
        EmbeddingBagConfig(
            name=f"t_cat_{i}",
            embedding_dim=int(d),
            num_embeddings=rows,
            feature_names=[f"cat_{i}"],
            use_virtual_table=f"t_cat_{i}" in live,
            total_num_buckets=virtual.get("total_num_buckets") if f"t_cat_{i}" in live else None,
        )
        for i, (rows, d) in enumerate(zip(sizes, dims))
    )
    access: dict[str, TableAccess] = {}
    for i, config in enumerate(configs):
        if profile is not None and config.name in profile:
            access[config.name] = from_profile(profile[config.name])
        elif zipfs is not None:
            access[config.name] = zipf_access(
                config.name, config.num_embeddings, float(poolings[i]), float(zipfs[i])
            )
    return ModelTables(
        configs=configs,
        poolings={c.name: float(p) for c, p in zip(configs, poolings)},
        access=access,
        max_live_rows=live,
    )


def plan_model(
    model: ModelTables,
    host: HostTopology,
    hosts: int,
    batch_size: int,
    *,
    profile: AccessProfile | None = None,
    sharder: TieredEmbeddingBagCollectionSharder | None = None,
    config: PlannerConfig | None = None,
) -> TablePlan:
    """:func:`plan_tables` for ``model`` on ``hosts`` hosts like ``host``, one rank per
    ``host.ranks_per_host``, with the model's access statistics and poolings.

    Raises:
        PlacementError: when the tables do not fit.
    """
    return plan_tables(
        list(model.configs),
        host,
        hosts * host.ranks_per_host,
        batch_size,
        profile,
        sharder,
        local_world_size=host.ranks_per_host,
        config=model.planner_config(config),
        access=dict(model.access),
        poolings=dict(model.poolings),
    )


def host_variants(base: HostTopology) -> list[tuple[str, HostTopology]]:
    """The four host types derived from ``base`` (those its tiers allow)."""
    fast = "HBM+DRAM" if base.gpu is not None else "DRAM"
    out = [(f"{fast} only", base.without(Tier.BYTE_SCM, Tier.BLOCK_SCM))]
    if base.byte_scm is not None:
        out.append((f"{fast} + byte SCM", base.without(Tier.BLOCK_SCM)))
    if base.block_scm is not None:
        out.append((f"{fast} + block SCM", base.without(Tier.BYTE_SCM)))
    if base.byte_scm is not None and base.block_scm is not None:
        out.append((f"{fast} + both SCM", base))
    return out


@dataclass(frozen=True)
class HostCount:
    """The result of :func:`min_hosts` for one host type.

    Attributes:
        host_type: label of the host type.
        hosts: the smallest qualifying number of hosts, or ``None`` if none up to the limit.
        limited_by: ``capacity`` (the smallest host count that fits also meets the target),
            ``throughput`` (more hosts than capacity needs), or ``not reached``.
        summary: the plan at that host count (``None`` if none qualified).
        capacity_hosts: the fewest hosts on which the tables fit at all.
    """

    host_type: str
    hosts: int | None
    limited_by: str
    summary: PlanSummary | None
    capacity_hosts: int | None

    @property
    def throughput(self) -> float | None:
        return None if self.summary is None else self.summary.throughput


def _capacity_bound(model: ModelTables, host: HostTopology) -> int:
    """Hosts the bytes need at best (every tier full, smallest footprint per table)."""
    total = model.total_bytes  # weights only: a lower bound whatever the optimizer
    per_host = sum(host.host_capacity(t) for t in host.tiers())
    return max(1, math.ceil(total / per_host))


def min_hosts(
    model: ModelTables,
    host: HostTopology,
    batch_size: int,
    target_throughput: float | None = None,
    *,
    host_type: str = "",
    config: PlannerConfig | None = None,
    max_hosts: int = 4096,
    sharder: TieredEmbeddingBagCollectionSharder | None = None,
) -> HostCount:
    """The fewest hosts of type ``host`` that fit ``model`` (and reach the target throughput).

    Args:
        model: the tables.
        host: the host type.
        batch_size: samples per rank per step.
        target_throughput: samples per second of the whole job, or ``None`` for capacity only.
        host_type: label for the result.
        config: planner knobs.
        max_hosts: give up beyond this many hosts.
        sharder: the sharder to plan for (default: row-wise Adagrad, tiered kernel offered).
    """
    config = config or PlannerConfig()
    host = with_budgets(host, config.dram_budget, config.byte_scm_budget)
    cache: dict[int, PlanSummary | None] = {}

    def plan_at(hosts: int) -> PlanSummary | None:
        if hosts not in cache:
            try:
                cache[hosts] = plan_model(
                    model, host, hosts, batch_size, sharder=sharder, config=config
                ).summary
            except PlacementError:
                cache[hosts] = None
            found = cache[hosts]
            logger.info(
                "%s: %d host(s) -> %s",
                host_type or host.name,
                hosts,
                "no fit" if found is None else f"{found.throughput:,.0f} samples/s",
            )
        return cache[hosts]

    def fits(hosts: int) -> bool:
        return plan_at(hosts) is not None

    def fast_enough(hosts: int) -> bool:
        found = plan_at(hosts)
        if found is None:
            return False
        return target_throughput is None or found.throughput >= target_throughput

    capacity = _first(fits, _capacity_bound(model, host), max_hosts)
    if capacity is None:
        return HostCount(host_type, None, "not reached", None, None)
    hosts = _first(fast_enough, capacity, max_hosts)
    if hosts is None:
        return HostCount(host_type, None, "not reached", None, capacity)
    limited = "capacity" if hosts == capacity else "throughput"
    return HostCount(host_type, hosts, limited, cache[hosts], capacity)


def _first(pred: Any, start: int, limit: int) -> int | None:
    """The smallest ``n >= start`` with ``pred(n)``, for a monotone ``pred``: doubling, then
    bisection; ``None`` if not even ``limit`` qualifies."""
    if pred(start):
        return start
    lo, hi = start, start
    while True:
        if hi >= limit:
            return None
        lo, hi = hi, min(limit, hi * 2)
        if pred(hi):
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid
    return hi


def compare_host_types(
    model: ModelTables,
    base: HostTopology,
    batch_size: int,
    target_throughput: float | None,
    *,
    config: PlannerConfig | None = None,
    max_hosts: int = 4096,
) -> list[HostCount]:
    """:func:`min_hosts` for each of the four host types of ``base``; ``config``'s budgets
    apply to ``base`` before its tiers are taken away."""
    config = config or PlannerConfig()
    base = with_budgets(base, config.dram_budget, config.byte_scm_budget)
    config = replace(config, dram_budget="", byte_scm_budget="")
    return [
        min_hosts(
            model,
            variant,
            batch_size,
            target_throughput,
            host_type=label,
            config=config,
            max_hosts=max_hosts,
        )
        for label, variant in host_variants(base)
    ]


def format_host_counts(counts: Sequence[HostCount], target: float | None) -> str:
    """The comparison as a table, with each host type's reduction against the first."""
    goal = f"target {target:,.0f} samples/s" if target else "capacity only"
    header = (
        f"{'host type':<26}{'hosts':>7}{'ranks':>7}{'fits on':>9}{'step ms':>10}"
        f"{'samples/s':>14}  {'limited by':<12}{'vs first':>9}"
    )
    lines = [f"minimum hosts ({goal})", header, "-" * len(header)]
    base = counts[0].hosts if counts else None
    for c in counts:
        if c.hosts is None or c.summary is None:
            lines.append(
                f"{c.host_type:<26}{'-':>7}{'-':>7}{'-':>9}{'-':>10}{'-':>14}  {c.limited_by}"
            )
            continue
        ratio = f"{base / c.hosts:.2f}x" if base else "-"
        fits = "-" if c.capacity_hosts is None else str(c.capacity_hosts)
        lines.append(
            f"{c.host_type:<26}{c.hosts:>7}{c.summary.world_size:>7}{fits:>9}"
            f"{c.summary.step_time_s * 1e3:>10.2f}{c.summary.throughput:>14,.0f}  "
            f"{c.limited_by:<12}{ratio:>9}"
        )
    return "\n".join(lines)
