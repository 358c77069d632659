"""The tiered planner: capacities per rank, the no-fit error, greedy cache sizing, the uniform
fallback, the printout, and a planned model trained through DistributedModelParallel."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from planner_helpers import small_host, tables
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.data import CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TierStorage,
)
from torchrec_mtrains.planner import (
    PlacementError,
    PlannerConfig,
    TableAccess,
    load_topology,
    parse_size,
    plan_tables,
    zipf_access,
)
from torchrec_mtrains.planner.planners import with_budgets
from torchrec_mtrains.profiler import TableInfo, profile_batches
from torchrec_mtrains.types import Tier

FUSED = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}


def _sharder(root: Path | None = None) -> TieredEmbeddingBagCollectionSharder:
    storage = TierStorage(root=str(root)) if root is not None else None
    return TieredEmbeddingBagCollectionSharder(
        storage, offer_tiered_kernel=True, fused_params=dict(FUSED)
    )


def test_capacities_honored_on_every_rank() -> None:
    # 6 tables of 2-8 MiB (dim 16 + 1 state, fp32 = 68 B/row), 29 MB in all, on 2 ranks with
    # 11.5 MiB of DRAM each: they cannot all stay in DRAM, and no rank may exceed any tier.
    host = small_host(dram="24MiB", byte_scm="64MiB", block_scm="256MiB")
    rows = [120_000, 100_000, 80_000, 60_000, 40_000, 30_000]
    plan, summary = plan_tables(tables(rows), host, 2, 256, None, _sharder())
    capacity = {t: host.rank_capacity(t, 2) for t in host.tiers()}
    for rank in summary.ranks:
        for tier, used in rank.used.items():
            assert used <= capacity[tier], (rank.rank, tier, used, capacity[tier])
    tiers = {line.tier for line in summary.tables}
    assert tiers - {Tier.DRAM}, "expected some tables on a storage tier"
    # Demand reported per table adds up to what the ranks use.
    for tier in capacity:
        by_table = sum(line.bytes.get(tier, 0) for line in summary.tables)
        assert by_table == sum(r.used.get(tier, 0) for r in summary.ranks)
    for name, sharding in plan.items():
        if sharding.compute_kernel == TIERED_KERNEL:
            assert isinstance(sharding, TieredParameterSharding)
            assert sharding.tier_options.tier in (Tier.BYTE_SCM, Tier.BLOCK_SCM)
            assert 0.0 < sharding.tier_options.cache_load_factor <= 1.0, name


def test_error_when_nothing_fits_lists_demand_per_tier_and_rank() -> None:
    host = small_host(dram="16MiB", byte_scm="16MiB", block_scm="32MiB")
    # 4 tables of ~32 MiB each: 128 MiB against 2 x (8 + 8 + 16) MiB.
    with pytest.raises(PlacementError) as info:
        plan_tables(tables([500_000] * 4), host, 2, 128, None, _sharder())
    message = str(info.value)
    for tier in ("dram", "byte_scm", "block_scm"):
        assert tier in message
    assert "rank" in message and "demand" in message and "capacity" in message
    assert "OVER by" in message
    report = info.value.report
    assert report.over(), "the report must name the tier/rank pairs over capacity"
    for tier, rank in report.over():
        assert report.demand[rank][tier] > report.capacity[tier]


def _linear_access(name: str, rows: int, slope: float) -> TableAccess:
    """One id per sample, all distinct; hit rate rises linearly with slope ``slope / rows``."""
    return TableAccess(
        name=name,
        num_rows=rows,
        accesses_per_sample=1.0,
        source="measured",
        unique_fn=lambda samples: samples,
        hit_fn=lambda cache, samples: min(1.0, slope * cache / rows),
    )


def test_greedy_cache_sizing_prefers_the_steeper_hit_rate_curve() -> None:
    # Two tables alike in size and traffic on the block tier; DRAM holds only caches, ~380k rows
    # of them. One table's hit rate rises twice as fast with cache size (until 500k rows): every
    # byte saves more there, so it gets all the cache and the other keeps its minimum.
    host = small_host(dram="48MiB", byte_scm=None, block_scm="1GiB", ranks_per_host=1)
    rows = 1_000_000
    access = {
        "t_cat_0": _linear_access("t_cat_0", rows, 1.0),
        "t_cat_1": _linear_access("t_cat_1", rows, 2.0),
    }
    _, summary = plan_tables(tables([rows, rows]), host, 1, 512, None, _sharder(), access=access)
    lines = {line.table: line for line in summary.tables}
    flat, steep = lines["t_cat_0"], lines["t_cat_1"]
    assert steep.tier is Tier.BLOCK_SCM and flat.tier is Tier.BLOCK_SCM
    assert flat.cache_rows == 1024  # the minimum: 2x the 512 distinct ids of a step
    assert steep.cache_rows > 100 * flat.cache_rows
    assert steep.hit_rate is not None and flat.hit_rate is not None
    assert steep.hit_rate > flat.hit_rate


def test_greedy_cache_sizing_follows_the_margin_of_concave_curves() -> None:
    # A Zipf curve is steep only at first: once its head is cached, bytes go to the table whose
    # curve is steeper at the margin (here the uniform one), and both end with sizable caches.
    host = small_host(dram="48MiB", byte_scm=None, block_scm="1GiB", ranks_per_host=1)
    access = {
        "t_cat_0": zipf_access("t_cat_0", 1_000_000, 1.0, 1.1),
        "t_cat_1": zipf_access("t_cat_1", 1_000_000, 1.0, 0.0),
    }
    _, summary = plan_tables(tables([1_000_000] * 2), host, 1, 512, None, _sharder(), access=access)
    skewed, uniform = summary.tables
    assert skewed.cache_rows > 10 * 1024 and uniform.cache_rows > 10 * 1024
    assert skewed.hit_rate is not None and uniform.hit_rate is not None
    assert skewed.hit_rate > uniform.hit_rate


def test_without_a_profile_the_uniform_fallback_is_stated() -> None:
    host = small_host()
    _, summary = plan_tables(tables([50_000, 1_000]), host, 1, 128, None, _sharder())
    text = str(summary)
    assert "no access profile given" in text and "assumed uniform" in text
    assert all(line.source == "assumed uniform" for line in summary.tables)


def test_a_partial_profile_names_the_tables_assumed_uniform() -> None:
    host = small_host()
    rng = np.random.default_rng(0)
    batches = [{"t_cat_0": rng.integers(0, 500, 64)} for _ in range(8)]
    profile = profile_batches(
        batches, {"t_cat_0": TableInfo(500, 16)}, sampling_rate=1.0, batch_size=64
    )
    _, summary = plan_tables(tables([500, 1_000]), host, 1, 64, profile, _sharder())
    sources = {line.table: line.source for line in summary.tables}
    assert sources == {"t_cat_0": "measured", "t_cat_1": "assumed uniform"}
    assert any("t_cat_1" in note for note in summary.notes)


def test_printout_has_the_columns() -> None:
    host = small_host(dram="8MiB")  # 3.5 MiB per rank: the 13.6 MB table cannot stay in DRAM
    _, summary = plan_tables(tables([200_000, 2_000]), host, 2, 128, None, _sharder())
    text = summary.format()
    header = next(line for line in text.splitlines() if line.startswith("table"))
    for column in ("table", "rows", "dim", "tier", "kernel", "cache rows", "hit rate", "ranks"):
        assert column in header
    used = [t for t, n in summary.bytes_per_tier().items() if n > 0]
    assert Tier.DRAM in used and set(used) - {Tier.DRAM}  # a table went to a storage tier
    for tier in used:  # bytes per tier
        assert tier.value in header
    assert "bytes per tier:" in text and "predicted step time" in text
    assert "t_cat_0" in text and "t_cat_1" in text


def test_sharder_must_offer_the_tiered_kernel() -> None:
    plain = TieredEmbeddingBagCollectionSharder(fused_params=dict(FUSED))
    with pytest.raises(ValueError, match="offer_tiered_kernel"):
        plan_tables(tables([1_000]), small_host(), 1, 64, None, plain)


def test_planner_config_rejects_unknown_keys() -> None:
    with pytest.raises(ValueError, match="unknown planner keys"):
        PlannerConfig.from_mapping({"name": "tiered", "cache_polcy": "lru"})


@pytest.mark.usefixtures("process_group")
def test_plan_shards_a_model_that_trains(tmp_path: Path) -> None:
    # DRAM for about one table: the big one must go to a storage tier behind a cache.
    host = small_host(dram="12MiB", byte_scm="64MiB", block_scm="64MiB", ranks_per_host=1)
    configs = tables([600_000, 500], dim=8)  # 21.6 MB of weights + state
    sharder = _sharder(tmp_path)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan, _ = plan_tables(ebc, host, 1, 32, None, sharder)
    assert isinstance(plan["t_cat_0"], TieredParameterSharding)
    model = DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )
    g = torch.Generator().manual_seed(0)
    lengths = torch.ones(2 * 32, dtype=torch.int64)
    values = torch.cat(
        [torch.randint(0, 600_000, (32,), generator=g), torch.randint(0, 500, (32,), generator=g)]
    )
    kjt = KeyedJaggedTensor(keys=["cat_0", "cat_1"], values=values, lengths=lengths)
    before = None
    for _ in range(3):
        out = model(kjt)
        out = out.wait() if hasattr(out, "wait") else out
        loss = out.values().pow(2).sum()
        loss.backward()
        before = float(loss) if before is None else before
    assert torch.isfinite(loss)
    assert float(loss) < before  # the fused optimizer updated the rows
    stats = [m.tier_stats() for m in model.modules() if hasattr(m, "_tier_storage")]
    assert any("t_cat_0" in s for s in stats)


def test_more_dram_never_predicts_a_slower_step() -> None:
    # The Criteo Kaggle shape (dim 64, Zipf 1.1, batch 8192) on the local preset without a byte
    # tier. With DRAM for some big tables whole, the first plan that fits keeps them whole and
    # leaves the other big tables tiny caches; demoting one more and growing every cache from
    # the bytes it frees is faster, and the planner must find that.
    sizes = list(CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE)
    configs = tables(sizes, dim=64)
    access = {c.name: zipf_access(c.name, c.num_embeddings, 1.0, 1.1) for c in configs}
    table_bytes = sum(sizes) * (64 + 1) * 4
    steps = []
    for fraction in [0.2 + 0.02 * i for i in range(16)]:
        host = copy.deepcopy(load_topology("local"))
        host.byte_scm = None
        host.dram.capacity = str(parse_size(host.dram_reserved) + int(fraction * table_bytes))
        config = PlannerConfig(overlap_tier_io=True, min_cache_factor=3.5)  # look-ahead 2
        _, summary = plan_tables(
            configs, host, 1, 8192, None, _sharder(), access=access, config=config
        )
        steps.append(summary.step_time_s)
    # (a hill climb: ties may differ in the last digits)
    assert all(later <= earlier * 1.01 for earlier, later in itertools.pairwise(steps)), steps


@pytest.mark.parametrize("zero", ["0", "0MB", 0])
def test_a_zero_budget_is_refused_not_read_as_no_budget(zero: str | int) -> None:
    host = load_topology("local")
    with pytest.raises(ValueError, match=r"planner\.dram_budget=.*leaves no DRAM"):
        with_budgets(host, zero, "")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"planner\.byte_scm_budget=.*positive size"):
        with_budgets(host, "", zero)  # type: ignore[arg-type]
    assert with_budgets(host, "", "") == host  # empty: the hardware's own capacities
    budgeted = with_budgets(host, "64MB", "")
    assert budgeted.host_capacity(Tier.DRAM) == 64 * 10**6


@pytest.mark.parametrize(("key", "value"), [("dram_budget", "lots"), ("byte_scm_budget", "64XB")])
def test_an_unparsable_budget_is_refused_as_the_config_is_made(key: str, value: str) -> None:
    with pytest.raises(ValueError, match=rf"^planner\.{key}='{value}' is not a size"):
        PlannerConfig(**{key: value})
    assert getattr(PlannerConfig(**{key: "2GiB"}), key) == "2GiB"
    assert getattr(PlannerConfig(**{key: ""}), key) == ""  # "": the topology's capacity


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_table_on_uvm_caching_gets_the_planners_cache_policy(policy: str) -> None:
    """fbgemm's cache runs the policy the tiered caches run (its default, LRU, stood in)."""
    tables = [
        EmbeddingBagConfig(
            num_embeddings=n, embedding_dim=128, name=f"t{i}", feature_names=[f"f{i}"]
        )
        for i, n in enumerate([10**6, 5 * 10**7, 2 * 10**8, 10**9])
    ]
    plan, _ = plan_tables(
        tables,
        load_topology("gpu_pmem_nvme"),
        world_size=8,
        batch_size=4096,
        profile=None,
        config=PlannerConfig(cache_policy=policy),
    )
    cached = [p for p in plan.values() if p.compute_kernel == "fused_uvm_caching"]
    assert cached and all(p.cache_params.algorithm.name == policy.upper() for p in cached)
