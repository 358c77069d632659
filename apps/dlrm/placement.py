"""Turns a model's tables into a TorchRec sharding plan that puts large tables on storage tiers.

This is the size rule used when no access profile drives placement: the smallest tables stay in
the compute device's memory (DRAM on CPU, HBM on CUDA) on TorchRec's FUSED kernel until
``dram_budget`` is spent, the rest go to byte SCM, or to
block SCM when at least ``block_scm_min_bytes``, each behind a cache of ``cache_load_factor``.
With ``large_tables=LargeTables.UVM_CACHING`` the rest go to TorchRec's FUSED_UVM_CACHING kernel
instead (CUDA only), with the same cache load factor and policy (one that fbgemm's cache runs:
LRU or LFU): the baseline the tiers are compared with.
Tables are placed table-wise; ranks are balanced by bytes, largest table first, each to the
least-loaded rank (longest-processing-time first), so the big tiered tables spread evenly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from apps.dlrm.errors import ConfigError
from torchrec_mtrains.cache.policies import fbgemm_cache_algorithm
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredParameterSharding,
    TieredTableOptions,
)
from torchrec_mtrains.types import Tier

UVM_CACHING_KERNEL = "fused_uvm_caching"


class LargeTables(str, Enum):
    """Where :func:`size_rule_plan` puts the tables past the DRAM budget
    (``planner.large_tables``)."""

    TIERED = "tiered"  # byte or block SCM, behind the tiered kernel's cache
    UVM_CACHING = "uvm_caching"  # TorchRec's FUSED_UVM_CACHING: host memory, an HBM cache


@dataclass(frozen=True)
class TablePlacement:
    """Where one table went, for the plan printout."""

    table: str
    rows: int
    dim: int
    tier: Tier
    kernel: str
    cache_rows: int
    rank: int
    bytes: int


def table_bytes(config: EmbeddingBagConfig, state_width: int = 1) -> int:
    """Bytes of a table's weights plus row-wise optimizer state, in float32."""
    return config.num_embeddings * (config.embedding_dim + state_width) * 4


def balance_ranks(configs: list[EmbeddingBagConfig], world_size: int) -> dict[str, int]:
    """Table name -> rank: largest first, each onto the rank holding the fewest bytes."""
    load = [0] * world_size
    out: dict[str, int] = {}
    for config in sorted(configs, key=lambda c: (-table_bytes(c), c.name)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += table_bytes(config)
        out[config.name] = rank
    return out


def check_large_tables(large_tables: LargeTables, device_type: str) -> None:
    """Refuses ``planner.large_tables=uvm_caching`` where the job does not compute on CUDA.

    Raises:
        ConfigError: naming the option and the device."""
    if large_tables == LargeTables.UVM_CACHING and device_type != "cuda":
        raise ConfigError(
            "planner.large_tables=uvm_caching: TorchRec's FUSED_UVM_CACHING kernel (fbgemm's "
            f"UVM) runs on CUDA only, and this run computes on {device_type}; give "
            "run.device=cuda, or planner.large_tables=tiered for the SCM tiers"
        )


def size_rule_plan(
    ebc: EmbeddingBagCollection,
    sharder: EmbeddingBagCollectionSharder,
    world_size: int,
    dram_budget: int,
    block_scm_min_bytes: int,
    cache_load_factor: float,
    cache_policy: str,
    device_type: str = "cpu",
    large_tables: LargeTables = LargeTables.TIERED,
) -> tuple[EmbeddingModuleShardingPlan, list[TablePlacement]]:
    """Builds the plan and a per-table summary (see the module docstring for the rule).

    ``device_type`` is where the job computes: FUSED tables live in its memory (DRAM on
    ``cpu``, HBM on ``cuda``), as do the tiered tables' caches.

    Raises:
        ConfigError: see :func:`check_large_tables`; or tables on FUSED_UVM_CACHING with a
            ``cache_policy`` fbgemm's cache does not run, naming them."""
    check_large_tables(large_tables, device_type)
    uvm = large_tables == LargeTables.UVM_CACHING
    configs = sorted(ebc.embedding_bag_configs(), key=lambda c: (table_bytes(c), c.name))
    ranks = balance_ranks(configs, world_size)
    placements: list[TablePlacement] = []
    generators = {}
    options: dict[str, TieredTableOptions] = {}
    spent = 0
    fast = Tier.HBM if device_type == "cuda" else Tier.DRAM
    for config in configs:
        size = table_bytes(config)
        rank = ranks[config.name]
        rows = config.num_embeddings
        if spent + size <= dram_budget:
            spent += size
            tier, kernel, compute_kernel, cache_rows = fast, "fused", "fused", rows
        elif uvm:  # rows in host memory, mapped for the GPU; a cache of them in HBM
            tier, kernel, compute_kernel = Tier.DRAM, "uvm_caching", UVM_CACHING_KERNEL
            cache_rows = int(rows * cache_load_factor)
        else:
            tier = Tier.BLOCK_SCM if size >= block_scm_min_bytes else Tier.BYTE_SCM
            opts = TieredTableOptions(
                tier=tier, cache_load_factor=cache_load_factor, cache_policy=cache_policy
            )
            options[config.name] = opts
            kernel, compute_kernel, cache_rows = "tiered", TIERED_KERNEL, opts.cache_rows(rows)
        generators[config.name] = table_wise(rank=rank, compute_kernel=compute_kernel)
        placements.append(
            TablePlacement(
                config.name, rows, config.embedding_dim, tier, kernel, cache_rows, rank, size
            )
        )
    plan = construct_module_sharding_plan(
        ebc,
        generators,
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type=device_type,
    )
    for name, opts in options.items():
        plan[name] = TieredParameterSharding.wrap(plan[name], opts)
    on_uvm = [p.table for p in placements if p.kernel == "uvm_caching"]
    if on_uvm:
        try:
            algorithm = fbgemm_cache_algorithm(cache_policy)
        except ValueError as e:
            raise ConfigError(
                f"tables {', '.join(on_uvm)} on FUSED_UVM_CACHING cannot run "
                f"planner.cache_policy={cache_policy!r}: {e}"
            ) from None
        cache = CacheParams(algorithm=algorithm, load_factor=cache_load_factor)
        for name in on_uvm:
            plan[name] = dataclasses.replace(plan[name], cache_params=cache)
    return plan, placements


def format_placements(placements: list[TablePlacement]) -> str:
    """The plan as a readable table."""
    header = f"{'table':<12}{'rows':>12}{'dim':>6}  {'tier':<10}{'kernel':<12}{'cache rows':>12}{'rank':>6}{'MB':>10}"
    lines = [header, "-" * len(header)]
    for p in sorted(placements, key=lambda p: p.table):
        lines.append(
            f"{p.table:<12}{p.rows:>12}{p.dim:>6}  {p.tier.value:<10}{p.kernel:<12}"
            f"{p.cache_rows:>12}{p.rank:>6}{p.bytes / 2**20:>10.1f}"
        )
    per_tier: dict[str, int] = {}
    for p in placements:
        per_tier[p.tier.value] = per_tier.get(p.tier.value, 0) + p.bytes
    lines.append(
        "bytes per tier: "
        + ", ".join(f"{t} {b / 2**20:.1f} MB" for t, b in sorted(per_tier.items()))
    )
    return "\n".join(lines)
