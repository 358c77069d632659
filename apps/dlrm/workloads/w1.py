"""W1: an embedding-dominated DLRM of the Criteo Kaggle shape, built the three ways the W1
benchmark (``benchmarks/w1_bench.py``) compares, from the same weights.

26 one-hot sparse features with the Criteo Kaggle cardinalities (33.8 M rows), dim 64, Zipf(1.1)
ids (:class:`~apps.dlrm.data.SyntheticCriteoDataset`), row-wise Adagrad fused into the
kernels, and a small dense part, so that the embedding path dominates the step.

* :func:`build_fused`: TorchRec's sharder and FUSED kernel, every table in DRAM (A).
* :func:`build_tiered`: the tiered planner's plan for a DRAM budget on the ``local`` preset,
  its stores opened as the app opens them (:func:`~torchrec_mtrains.planner.store_options`).
* :mod:`apps.dlrm.workloads.mmap_baseline`: the FUSED kernel over memory-mapped files (B).
"""

from __future__ import annotations

import dataclasses
import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    OptimType,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import CacheParams, EmbeddingModuleShardingPlan, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.data import (
    CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE,
    SyntheticCriteoDataset,
    SyntheticDataConfig,
)
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.initializers import RowSeededUniform
from torchrec_mtrains.planner import (
    HostTopology,
    PlannerConfig,
    load_topology,
    parse_size,
    plan_tables,
    zipf_access,
)
from torchrec_mtrains.planner.presets import store_options
from torchrec_mtrains.tiers import OpenMode
from torchrec_mtrains.types import Tier

__all__ = [
    "BatchStream",
    "Built",
    "W1Model",
    "Workload",
    "big_tables",
    "build_fused",
    "build_tiered",
    "build_tiered_on",
    "build_uvm_cached",
    "fused_params",
    "fused_tbes",
    "probe_sizes",
    "shard",
    "table_wise_plan",
    "tiered_groups",
    "tiered_plan",
    "uvm_cached_plan",
    "w1_host",
]

LR = 0.05
STATE_WIDTH = 1  # row-wise Adagrad: one float of state per row
EBC_NAME = "ebc"
CPU = torch.device("cpu")


@dataclass(frozen=True)
class Workload:
    """Table sizes, dim, skew and batch of a W1 run (``scale`` shrinks every table)."""

    sizes: tuple[int, ...]
    dim: int = 64
    zipf: float = 1.1
    batch_size: int = 8192
    num_dense: int = 13
    seed: int = 0

    @classmethod
    def full(cls, scale: float = 1.0, batch_size: int = 8192) -> Workload:
        sizes = tuple(max(1, round(n * scale)) for n in CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE)
        return cls(sizes=sizes, batch_size=batch_size)

    @classmethod
    def smoke(cls) -> Workload:
        """Tiny: the Kaggle shape divided by 200 (largest table 51k rows), dim 64, batch 256
        (a smaller dim would leave the 15% budget too little for the per-row index and slot
        map of the tiered tables next to their caches)."""
        sizes = tuple(max(4, n // 200) for n in CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE)
        return cls(sizes=sizes, dim=64, batch_size=256)

    @property
    def row_bytes(self) -> int:
        return (self.dim + STATE_WIDTH) * 4

    @property
    def embedding_bytes(self) -> int:
        """Weights plus row-wise optimizer state of all tables, float32."""
        return sum(self.sizes) * self.row_bytes

    def table_init(self, table: int, rows: int) -> RowSeededUniform:
        """Table ``table``'s initial rows, uniform in ``[-sqrt(1/rows), sqrt(1/rows)]`` as
        TorchRec's FUSED kernel draws them, but the same under every variant's placement."""
        bound = math.sqrt(1.0 / rows)
        return RowSeededUniform(seed=self.seed * 1000 + table, dim=self.dim, low=-bound, high=bound)

    def configs(self, sizes: Sequence[int] | None = None) -> list[EmbeddingBagConfig]:
        return [
            EmbeddingBagConfig(
                name=f"t_cat_{i}",
                embedding_dim=self.dim,
                num_embeddings=n,
                feature_names=[f"cat_{i}"],
                init_fn=self.table_init(i, n),
            )
            for i, n in enumerate(sizes or self.sizes)
        ]

    def dataset(self, sizes: Sequence[int] | None = None) -> SyntheticCriteoDataset:
        return SyntheticCriteoDataset(
            SyntheticDataConfig(
                batch_size=self.batch_size,
                num_batches=1 << 30,
                seed=self.seed,
                num_dense_features=self.num_dense,
                num_sparse_features=len(self.sizes),
                num_embeddings_per_feature=list(sizes or self.sizes),
                zipf_exponents=[self.zipf],
                pooling_factors=[1],
            )
        )


class W1Model(nn.Module):
    """The embedding bag collection plus a small dense part; returns the BCE loss.

    ``logit = over(concat(relu(dense(x)), pooled embeddings))`` with 16-wide layers: a few
    percent of the step next to 26 lookups of batch x dim."""

    def __init__(self, ebc: EmbeddingBagCollection, num_dense: int, width: int = 16) -> None:
        super().__init__()
        self.ebc = ebc
        # The pooled outputs are taken by feature in the configs' order, as TorchRec's DLRM
        # takes them: a sharded collection orders its output by its kernel groups (U's FUSED
        # tables come before its FUSED_UVM_CACHING ones).
        self.features = [f for c in ebc.embedding_bag_configs() for f in c.feature_names]
        num_tables = len(ebc.embedding_bag_configs())
        dim = ebc.embedding_bag_configs()[0].embedding_dim
        self.dense = nn.Linear(num_dense, width)
        self.over = nn.Sequential(
            nn.Linear(width + num_tables * dim, width), nn.ReLU(), nn.Linear(width, 1)
        )

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """``(loss, (loss, logits))``, detached in the second part: the shape TorchRec's train
        pipelines expect (losses to backpropagate, then the output)."""
        by_feature = self.ebc(batch.sparse_features).to_dict()
        dense = torch.relu(self.dense(batch.dense_features))
        x = torch.cat([dense, *(by_feature[f] for f in self.features)], dim=1)  # one copy
        logit = self.over(x).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logit, batch.labels)
        return loss, (loss.detach(), logit.detach())


@dataclass
class Built:
    """A sharded model ready to train, with what the run reports about it."""

    model: DistributedModelParallel
    dense_optimizer: KeyedOptimizerWrapper
    files: list[Path] = field(default_factory=list)
    plan_text: str = ""
    info: dict[str, Any] = field(default_factory=dict)
    mappings: list[mmap.mmap] = field(default_factory=list)


class BatchStream:
    """Batch ``i`` of the synthetic stream (a pure function of ``i``). Warm-up batches are made
    when needed; the timed ones are made ahead by :meth:`prepare` (compact: int32 ids), so data
    generation never runs inside a timed window."""

    def __init__(self, wl: Workload, sizes: Sequence[int] | None = None) -> None:
        self.ds = wl.dataset(sizes)
        self._lengths = torch.ones(len(wl.sizes) * wl.batch_size, dtype=torch.int32)
        self._ready: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def prepare(self, first: int, count: int) -> None:
        self._ready.clear()
        for i in range(first, first + count):
            b = self.ds.batch_at(i)
            self._ready[i] = (
                b.sparse_features.values().to(torch.int32),
                b.dense_features,
                b.labels,
            )

    def __getitem__(self, i: int) -> Batch:
        if i not in self._ready:
            return self.ds.batch_at(i)
        values, dense, labels = self._ready[i]
        kjt = KeyedJaggedTensor(
            keys=self.ds.keys, values=values.to(torch.int64), lengths=self._lengths
        )
        return Batch(dense_features=dense, sparse_features=kjt, labels=labels)


def fused_params() -> dict[str, Any]:
    """The optimizer every variant fuses into its kernels: row-wise Adagrad at :data:`LR`."""
    return {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR}


def shard(
    wl: Workload,
    sizes: Sequence[int],
    sharder: EmbeddingBagCollectionSharder,
    plan: EmbeddingModuleShardingPlan | None,
    device: torch.device = CPU,
) -> tuple[DistributedModelParallel, KeyedOptimizerWrapper]:
    """A :class:`W1Model` over tables of ``sizes``, sharded on this rank by ``sharder`` with
    ``plan`` (``None``: every table table-wise on FUSED), computing on ``device``, and its
    dense optimizer."""
    configs = wl.configs(sizes)
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    torch.manual_seed(wl.seed)  # the dense part's weights: the same in every variant
    model = W1Model(ebc, wl.num_dense)
    if plan is None:
        plan = table_wise_plan(ebc, sharder, {c.name: "fused" for c in configs}, device)
    dmp = DistributedModelParallel(
        model,
        device=device,
        plan=ShardingPlan({EBC_NAME: plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=LR),
    )
    return dmp, dense


def probe_sizes(wl: Workload) -> list[int]:
    """Tables small enough that their bytes vanish next to the process's own overhead."""
    return [min(n, 1024) for n in wl.sizes]


def table_wise_plan(
    ebc: EmbeddingBagCollection,
    sharder: EmbeddingBagCollectionSharder,
    kernels: dict[str, str],
    device: torch.device,
) -> EmbeddingModuleShardingPlan:
    """Every table table-wise on this one rank, on the compute kernel ``kernels`` names."""
    return construct_module_sharding_plan(
        ebc,
        {name: table_wise(rank=0, compute_kernel=kernel) for name, kernel in kernels.items()},
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type=device.type,
    )


def build_fused(
    wl: Workload, sizes: Sequence[int] | None = None, device: torch.device = CPU
) -> Built:
    """A (and the probe): TorchRec's own sharder and FUSED kernel, every table in the memory of
    ``device`` (DRAM on the CPU, HBM on a GPU)."""
    sharder = EmbeddingBagCollectionSharder(fused_params=fused_params())
    model, dense = shard(wl, sizes or wl.sizes, sharder, None, device)
    where = "DRAM" if device.type == "cpu" else "HBM"
    return Built(model, dense, plan_text=f"every table on TorchRec's FUSED kernel in {where}")


def big_tables(wl: Workload, min_rows: int) -> list[str]:
    """The tables of at least ``min_rows`` rows: those a device cache fronts in U and ours."""
    return [c.name for c in wl.configs() if c.num_embeddings >= min_rows]


def uvm_cached_plan(
    wl: Workload, cache_load_factor: float, min_rows: int
) -> tuple[EmbeddingBagCollectionSharder, EmbeddingModuleShardingPlan]:
    """U's sharder and plan (see :func:`build_uvm_cached`); made without a GPU."""
    big = set(big_tables(wl, min_rows))
    # fbgemm counts its cache's unique ids and misses only when asked to.
    sharder = EmbeddingBagCollectionSharder(
        fused_params={**fused_params(), "gather_uvm_cache_stats": True}
    )
    ebc = EmbeddingBagCollection(tables=wl.configs(), device=torch.device("meta"))
    kernels = {c.name: "fused_uvm_caching" if c.name in big else "fused" for c in wl.configs()}
    plan = table_wise_plan(ebc, sharder, kernels, torch.device("cuda"))
    # prefetch_pipeline: the cache is filled by TorchRec's PrefetchTrainPipelineSparseDist a
    # batch ahead, so rows a batch in flight uses must not be evicted before it trains.
    cache = CacheParams(load_factor=cache_load_factor, prefetch_pipeline=True)
    for name in big:
        plan[name] = dataclasses.replace(plan[name], cache_params=cache)
    return sharder, plan


def build_uvm_cached(
    wl: Workload, device: torch.device, cache_load_factor: float, min_rows: int
) -> Built:
    """U: TorchRec's FUSED_UVM_CACHING kernel on the tables of at least ``min_rows`` rows
    (their rows in host memory mapped for the GPU, a cache of ``cache_load_factor`` of them in
    HBM), every other table FUSED in HBM. CUDA only: fbgemm's UVM has no CPU path."""
    if device.type != "cuda":
        raise ValueError(f"FUSED_UVM_CACHING needs a CUDA device, not {device}")
    sharder, plan = uvm_cached_plan(wl, cache_load_factor, min_rows)
    model, dense = shard(wl, wl.sizes, sharder, plan, device)
    big = big_tables(wl, min_rows)
    text = (
        f"{len(big)} tables of >= {min_rows:,} rows on FUSED_UVM_CACHING (cache load factor "
        f"{cache_load_factor}), the others FUSED in HBM"
    )
    return Built(model, dense, plan_text=text, info={"cached_tables": big})


def build_tiered_on(
    wl: Workload,
    directory: Path,
    tier: Tier,
    cache_load_factor: float,
    min_rows: int,
    device: torch.device = CPU,
) -> Built:
    """Ours at U's device-cache budget: the tables of at least ``min_rows`` rows on ``tier``
    behind a cache of ``cache_load_factor`` of their rows in the memory of ``device``, every
    other table FUSED there; the stores opened with the ``local`` preset's options."""
    big = set(big_tables(wl, min_rows))
    storage = TierStorage(
        root=str(directory),
        tier_options=store_options(load_topology("local")),
        open_mode=OpenMode.OPEN_OR_CREATE,
    )
    sharder = TieredEmbeddingBagCollectionSharder(
        storage, offer_tiered_kernel=True, fused_params=fused_params()
    )
    ebc = EmbeddingBagCollection(tables=wl.configs(), device=torch.device("meta"))
    kernels = {c.name: TIERED_KERNEL if c.name in big else "fused" for c in wl.configs()}
    plan = table_wise_plan(ebc, sharder, kernels, device)
    options = TieredTableOptions(tier=tier, cache_load_factor=cache_load_factor)
    for name in big:
        plan[name] = TieredParameterSharding.wrap(plan[name], options)
    model, dense = shard(wl, wl.sizes, sharder, plan, device)
    text = (
        f"{len(big)} tables of >= {min_rows:,} rows on the {tier.value} tier behind a cache of "
        f"{cache_load_factor} of their rows, the others FUSED"
    )
    info = {"cached_tables": sorted(big), "tier": tier.value}
    files = [p for p in directory.rglob("*.rows")]
    return Built(model, dense, files=files, plan_text=text, info=info)


def fused_tbes(model: DistributedModelParallel) -> list[SplitTableBatchedEmbeddingBagsCodegen]:
    """fbgemm modules of the FUSED (non-tiered) kernels (TorchRec hides lookups from
    ``modules()``, so walk them)."""
    out = []
    for lookup in getattr(model.module, EBC_NAME)._lookups:
        inner = getattr(lookup, "module", lookup)
        for kernel in getattr(inner, "_emb_modules", []):
            tbe = getattr(kernel, "_emb_module", None)
            if isinstance(tbe, SplitTableBatchedEmbeddingBagsCodegen) and not hasattr(
                kernel, "tiers"
            ):
                out.append(tbe)
    return out


SMOKE_PASS_BYTES = 65536  # the smoke run's I/O passes: its DRAM budget is a few MiB


def w1_host(budget_bytes: int, layout: str | None = None, smoke: bool = False) -> HostTopology:
    """The host W1 plans and opens its tiers for: the ``local`` hardware preset with DRAM for
    embeddings set to the budget and without the byte tier (under a memory cap a
    memory-mapped byte tier lives in the capped page cache, i.e. it is DRAM the budget already
    counts: that is variant B), its block tier in ``layout`` (the preset's when None)."""
    overrides = ["hardware.byte_scm=null"]
    if smoke:
        overrides.append(f"hardware.block_scm.max_pass_bytes={SMOKE_PASS_BYTES}")
    if layout is not None:
        overrides.append(f"hardware.block_scm.layout={layout}")
    host = load_topology("local", overrides)
    host.dram.capacity = str(parse_size(host.dram_reserved) + budget_bytes)
    return host


def tiered_plan(
    wl: Workload,
    host: HostTopology,
    lookahead: int,
    sharder: TieredEmbeddingBagCollectionSharder,
    cache_policy: str | None = None,
) -> tuple[EmbeddingModuleShardingPlan, str, dict[str, Any]]:
    """The tiered planner's plan for ``host`` (see :func:`w1_host`), its caches running
    ``cache_policy`` (the planner's default when None)."""
    configs = wl.configs()
    access = {c.name: zipf_access(c.name, c.num_embeddings, 1.0, wl.zipf) for c in configs}
    config = PlannerConfig().for_lookahead(lookahead)
    if cache_policy is not None:
        config = dataclasses.replace(config, cache_policy=cache_policy)
    plan, summary = plan_tables(
        configs, host, 1, wl.batch_size, None, sharder, access=access, config=config
    )
    info = {
        "planner": "torchrec_mtrains.planner.plan_tables (local preset, byte tier removed)",
        "predicted_step_ms": summary.step_time_s * 1e3,
        "planned_dram_bytes": summary.bytes_per_tier().get(Tier.DRAM, 0),
        "tiers": {
            name: {
                "kernel": ps.compute_kernel,
                "tier": ps.tier_options.tier.value if hasattr(ps, "tier_options") else "dram",
                "cache_load_factor": (
                    ps.tier_options.cache_load_factor if hasattr(ps, "tier_options") else None
                ),
            }
            for name, ps in plan.items()
        },
    }
    return plan, str(summary), info


def build_tiered(
    wl: Workload,
    directory: Path,
    budget_bytes: int,
    lookahead: int,
    layout: str | None = None,
    smoke: bool = False,
    device: torch.device = CPU,
    cache_policy: str | None = None,
) -> Built:
    """Ours: the tiered plan for the budget, its stores opened as the app opens them, with the
    options of the host the planner costs (``store_options``), computing on ``device``, its
    caches running ``cache_policy`` (the planner's default when None)."""
    host = w1_host(budget_bytes, layout, smoke)
    storage = TierStorage(
        root=str(directory), tier_options=store_options(host), open_mode=OpenMode.OPEN_OR_CREATE
    )
    sharder = TieredEmbeddingBagCollectionSharder(
        storage, offer_tiered_kernel=True, fused_params=fused_params()
    )
    plan, text, info = tiered_plan(wl, host, lookahead, sharder, cache_policy)
    assert host.block_scm is not None
    info["block_layout"] = host.block_scm.layout
    info["store_options"] = {k: str(v) for k, v in storage.tier_options.items()}
    model, dense = shard(wl, wl.sizes, sharder, plan, device)
    files = [p for p in directory.rglob("*.rows")]
    return Built(model, dense, files=files, plan_text=text, info=info)


def tiered_groups(model: DistributedModelParallel) -> list[TieredTableGroup]:
    """The tiered kernels' table groups of a W1 model (none for A and B)."""
    return list(getattr(model.module, EBC_NAME).tiered_groups())
