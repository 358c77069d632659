"""TorchRec's managed-collision modules over this project's sharder against the same modules
over TorchRec's own (FUSED), step by step.

An :class:`MCCase` builds two ``DistributedModelParallel`` models of one managed-collision
module (``ManagedCollisionEmbeddingBagCollection`` or ``...EmbeddingCollection``: raw ids
remapped by an ``MCHManagedCollisionModule`` into a table of ``zch_size`` slots per rank),
sharded row-wise by TorchRec's managed-collision sharder:

* the model under test: over this project's sharder, the table on the case's tier and cache;
* the reference: over TorchRec's own sharder, on its FUSED kernel. fbgemm has no CPU kernel for
  the reset the module calls when it gives a slot to a new id
  (``reset_embedding_weight_momentum``), so the reference's reset is
  :func:`~torchrec_mtrains.benchmark.references.reset_rows_on_cpu`: the effect of fbgemm's CUDA
  kernel on the CPU module's rows.

The model under test starts from the reference's state dict. Both train ``steps`` steps on the
same batches (each rank its own); every step's pooled output is compared bit for bit, then the
table's rows and, under row-wise Adagrad, its momentum.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import DataType, EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHEvictionPolicy,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.distributed.parity_harness import OPTIMIZERS
from torchrec_mtrains.benchmark.references import reset_rows_on_cpu
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.initializers import IdSeededUniform
from torchrec_mtrains.types import Tier

TABLE = "t_mc"
DIM = 8
BATCH = 8  # samples a rank feeds a step
STORES = ("dram", "byte_scm", "block_scm", "flat")  # block_scm: the log layout; flat: the other
REMAP_POLICIES = ("distance_lfu", "lfu", "lru")


@dataclass(frozen=True)
class MCCase:
    """One configuration.

    Attributes:
        kind: ``ebc`` (pooled) or ``ec`` (sequence).
        store: the tier of ours' table (``flat``: block SCM in its flat layout).
        optimizer: a key of ``parity_harness.OPTIMIZERS``.
        zch_size: the table's slots on each rank.
        cache_load_factor: ours' cache, as a share of a rank's slots.
        cache_policy: ours' cache policy.
        remap_policy: the managed-collision module's eviction policy.
        eviction_interval: batches between the module's eviction rounds.
        raw_ids: how many distinct raw ids the batches draw from.
        max_len: ids a sample holds at most.
        steps: training steps.
        seed: the batches' seed.
        world_size: ranks (1 or 2).
        dtype: the table's weights, ``fp32`` or ``fp16``.
    """

    kind: str = "ebc"
    store: str = "block_scm"
    optimizer: str = "rowwise_adagrad"
    zch_size: int = 40
    cache_load_factor: float = 0.5
    cache_policy: str = "lru"
    remap_policy: str = "distance_lfu"
    eviction_interval: int = 2
    raw_ids: int = 300
    max_len: int = 2
    steps: int = 40
    seed: int = 1
    world_size: int = 1
    dtype: str = "fp32"


class MCModel(nn.Module):
    """The managed-collision module alone: called with a KJT, returns what it returns."""

    def __init__(self, case: MCCase) -> None:
        super().__init__()
        kwargs: dict[str, Any] = dict(
            name=TABLE,
            embedding_dim=DIM,
            num_embeddings=case.zch_size * case.world_size,
            feature_names=["f"],
            init_fn=IdSeededUniform(seed=3, dim=DIM, low=-0.1, high=0.1),
            data_type=DataType.FP16 if case.dtype == "fp16" else DataType.FP32,
        )
        bagged = case.kind == "ebc"
        config = EmbeddingBagConfig(**kwargs) if bagged else EmbeddingConfig(**kwargs)
        cpu = torch.device("cpu")
        remapper = MCHManagedCollisionModule(
            zch_size=case.zch_size * case.world_size,
            device=cpu,
            eviction_policy=_remap_policy(case.remap_policy),
            eviction_interval=case.eviction_interval,
            input_hash_size=2**40,
        )
        collection = ManagedCollisionCollection({TABLE: remapper}, embedding_configs=[config])
        self.mc: nn.Module
        if bagged:
            ebc = EmbeddingBagCollection(tables=[config], device=cpu)
            self.mc = ManagedCollisionEmbeddingBagCollection(
                ebc, collection, return_remapped_features=True
            )
        else:
            ec = EmbeddingCollection(tables=[config], device=cpu)
            self.mc = ManagedCollisionEmbeddingCollection(
                ec, collection, return_remapped_features=True
            )

    def forward(self, features: KeyedJaggedTensor) -> Any:
        return self.mc(features)


class MCBatchModel(MCModel):
    """Called with a batch, as TorchRec's train pipelines call a model: (loss, loss). Pooled
    (``ebc``) only: the pipeline traces this forward."""

    def forward(self, batch: Batch) -> Any:
        pooled, _ = self.mc(batch.sparse_features)
        loss = positional_loss(pooled.values())
        return loss, loss.detach()


def _remap_policy(name: str) -> MCHEvictionPolicy:
    policies: dict[str, type[MCHEvictionPolicy]] = {
        "distance_lfu": DistanceLFU_EvictionPolicy,
        "lfu": LFU_EvictionPolicy,
        "lru": LRU_EvictionPolicy,
    }
    return policies[name]()


def storage(root: Path, store: str) -> TierStorage:
    flat = {"block_scm": {"layout": "flat"}} if store == "flat" else {}
    return TierStorage(root=str(root), tier_options=flat)


def build(case: MCCase, root: Path | None, batches: bool = False) -> DistributedModelParallel:
    """The module sharded row-wise by TorchRec's managed-collision sharder over ours (its table
    on the case's tier), or over TorchRec's own sharder (FUSED) when ``root`` is None."""
    model = (MCBatchModel if batches else MCModel)(case)
    fused = {"optimizer": OPTIMIZERS[case.optimizer], "learning_rate": 0.1}
    bagged = case.kind == "ebc"
    sharder: Any
    if root is None:
        sharder = (
            ManagedCollisionEmbeddingBagCollectionSharder()
            if bagged
            else ManagedCollisionEmbeddingCollectionSharder()
        )
        sharder._e_sharder._fused_params = fused
    elif bagged:
        sharder = ManagedCollisionEmbeddingBagCollectionSharder(
            ebc_sharder=TieredEmbeddingBagCollectionSharder(
                storage(root, case.store), fused_params=fused
            )
        )
    else:
        sharder = ManagedCollisionEmbeddingCollectionSharder(
            ec_sharder=TieredEmbeddingCollectionSharder(
                storage(root, case.store), fused_params=fused
            )
        )
    kernel = "fused" if root is None else TIERED_KERNEL
    plan = construct_module_sharding_plan(
        model.mc, {TABLE: row_wise(compute_kernel=kernel)}, sharder=sharder, device_type="cpu"
    )
    if root is not None:
        plan[TABLE] = TieredParameterSharding.wrap(
            plan[TABLE],
            TieredTableOptions(
                tier=Tier.parse("block_scm" if case.store == "flat" else case.store),
                cache_load_factor=case.cache_load_factor,
                cache_policy=case.cache_policy,
            ),
        )
    dmp = DistributedModelParallel(
        model, plan=ShardingPlan({"mc": plan}), sharders=[sharder], device=torch.device("cpu")
    )
    if root is None:
        for tbe, _ in dmp.module.mc._table_to_tbe_and_index.values():
            reset_rows_on_cpu(tbe)
    return dmp


def kjt(case: MCCase, g: torch.Generator) -> KeyedJaggedTensor:
    """A batch of raw ids scattered over 2**40."""
    lengths = torch.randint(0, case.max_len + 1, (BATCH,), generator=g)
    raw = torch.randint(0, case.raw_ids, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(keys=["f"], values=raw**3 * 7919 % 2**40, lengths=lengths)


def pooled_values(out: Any) -> torch.Tensor:
    """The embeddings a step returned: a KeyedTensor's values, or an EC's per-feature values."""
    values = getattr(out, "values", None)
    if callable(values) and isinstance(values(), torch.Tensor):
        return values()
    return torch.cat([jt.values() for jt in out.values()])


def positional_loss(pooled: torch.Tensor) -> torch.Tensor:
    return (pooled * torch.arange(1, pooled.numel() + 1).reshape(pooled.shape)).sum()


def train(model: DistributedModelParallel, case: MCCase, rank: int = 0) -> list[torch.Tensor]:
    """The pooled output of each step (each rank its own batches)."""
    g = torch.Generator().manual_seed(case.seed * 1009 + rank)
    outs = []
    for _ in range(case.steps):
        out, _ = model(kjt(case, g))
        pooled = pooled_values(out)
        positional_loss(pooled).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        outs.append(pooled.detach().clone())
    return outs


def weight_key(case: MCCase) -> str:
    tables = "embedding_bags" if case.kind == "ebc" else "embeddings"
    return f"mc._embedding_module.{tables}.{TABLE}.weight"


def local_rows(value: Any) -> torch.Tensor:
    """A ShardedTensor's rows on this rank (its chunks, by their offsets), as one tensor."""
    shards = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
    return torch.cat([s.tensor for s in shards])


def momentum(model: DistributedModelParallel) -> torch.Tensor:
    (states,) = [v for k, v in model.fused_optimizer.state_dict()["state"].items() if TABLE in k]
    (key,) = [k for k in states if k.endswith("momentum1")]
    return local_rows(states[key])


def run_case(case: MCCase, rank: int, root: Path) -> dict[str, Any]:
    """Trains both models; ``mismatched_step`` is the first step whose outputs differ, ``-1``
    when only the final rows or momentum do, ``None`` when nothing does."""
    reference = build(case, None)
    ours = build(case, root)
    ours.load_state_dict(reference.state_dict())
    mismatched = None
    for step, (a, b) in enumerate(zip(train(reference, case, rank), train(ours, case, rank))):
        if not torch.equal(a, b):
            mismatched = step
            break
    if mismatched is None:
        key = weight_key(case)
        same = torch.equal(
            local_rows(reference.state_dict()[key]), local_rows(ours.state_dict()[key])
        )
        if case.optimizer == "rowwise_adagrad":
            same = same and torch.equal(momentum(reference), momentum(ours))
        mismatched = None if same else -1
    return {"case": asdict(case), "error": None, "mismatched_step": mismatched}


def _rank_main(
    rank: int, world_size: int, port: int, cases: list[MCCase], root: str, out: str
) -> None:
    torch.set_num_threads(1)
    results = []
    with process_group(
        backend="gloo",
        rank=rank,
        world_size=world_size,
        port=port,
        timeout=timedelta(seconds=60),
    ):
        for i, case in enumerate(cases):
            try:
                results.append(run_case(case, rank, Path(root) / f"c{i}r{rank}"))
            except Exception:
                results.append(
                    {"case": asdict(case), "error": traceback.format_exc(), "mismatched_step": None}
                )
                break  # the other rank may be stuck in a collective: stop this job
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def spawn_cases(cases: Sequence[MCCase], root: Path) -> list[list[dict[str, Any]]]:
    """Runs ``cases`` on two spawned gloo ranks; per rank, their results in order."""
    out = tempfile.mkdtemp(dir=root)
    tiers = tempfile.mkdtemp(dir=root)
    mp.spawn(  # type: ignore[attr-defined,no-untyped-call]  # untyped in torch
        _rank_main, args=(2, free_port(), list(cases), tiers, out), nprocs=2, join=True
    )
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
