"""Variable batch per feature (VBE): tiered tables train as TorchRec's FUSED kernel does, to
the last bit, when features arrive with different batch sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.distributed.parity_harness import tier_storage
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.tiers import TIERS

# fbgemm runs VBE with row-wise Adagrad and SGD (not plain Adagrad).
FUSED = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
ROWS, DIM = 100, 8
KEYS = ["f0", "f1"]


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """Every test here runs on one rank."""


def _ebc() -> EmbeddingBagCollection:
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=DIM, num_embeddings=ROWS, feature_names=[k]
            )
            for i, k in enumerate(KEYS)
        ],
        device=torch.device("meta"),
    )


def _model(
    root: Path, tier: str | None, tiered: tuple[str, ...] = ("t0", "t1")
) -> DistributedModelParallel:
    """The ``tiered`` tables on ``tier`` (one tiered kernel, which computes the FUSED others
    too), or every table FUSED when ``tier`` is None."""
    storage = TierStorage(root=str(root)) if tier is None else tier_storage(tier, root)
    sharder = TieredEmbeddingBagCollectionSharder(storage, fused_params=FUSED)
    plan = construct_module_sharding_plan(
        _ebc(),
        {
            t: table_wise(rank=0, compute_kernel=TIERED_KERNEL if tier and t in tiered else "fused")
            for t in ("t0", "t1")
        },
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    if tier is not None:
        for name in tiered:
            plan[name] = TieredParameterSharding.wrap(
                plan[name],
                TieredTableOptions(tier=TIERS[tier].serves_tier, cache_load_factor=0.3),
            )
    return DistributedModelParallel(
        _ebc(), device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def _vbe_batch(g: torch.Generator) -> KeyedJaggedTensor:
    """f0 with 2 samples and f1 with 3; inverse indices expand both to the batch of 3."""
    lengths = torch.randint(0, 4, (5,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor(
        keys=KEYS,
        values=values,
        lengths=lengths,
        stride_per_key_per_rank=[[2], [3]],
        inverse_indices=(KEYS, torch.tensor([[0, 1, 1], [0, 1, 2]])),
    )


def _local(value: object) -> torch.Tensor:
    shards = getattr(value, "local_shards", None)
    return shards()[0].tensor if callable(shards) else value  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("tier", "tiered_tables"),
    [(tier, ("t0", "t1")) for tier in sorted(TIERS)] + [("block_scm", ("t0",))],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_vbe_batches_train_as_fused_does(
    tier: str, tiered_tables: tuple[str, ...], tmp_path: Path
) -> None:
    """Also with t1 FUSED beside tiered t0: one kernel computes both, so the lookup needs no
    VBE output merging (which fbgemm does not do on CPU)."""
    fused = _model(tmp_path / "fused", None)
    tiered = _model(tmp_path / "tiered", tier, tiered_tables)
    tiered.load_state_dict(fused.state_dict())
    seeds = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(30):
        for model, g in zip((fused, tiered), seeds):
            batch = _vbe_batch(g)
            assert batch.variable_stride_per_key()
            out = model(batch)
            out = out.wait() if hasattr(out, "wait") else out
            assert out.values().shape == (3, 2 * DIM)
            out.values().square().sum().backward()
    optim = tiered.fused_optimizer.state_dict()["state"]
    for key, want in fused.fused_optimizer.state_dict()["state"].items():
        for name, value in want.items():
            assert torch.equal(_local(value), _local(optim[key][name])), (key, name)
    want_weights, got_weights = fused.state_dict(), tiered.state_dict()
    for key in ("embedding_bags.t0.weight", "embedding_bags.t1.weight"):
        assert torch.equal(_local(want_weights[key]), _local(got_weights[key])), key
