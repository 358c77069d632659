"""The tiered sharders are drop-in: TorchRec's stock planner plans a model without tiered tables
exactly as with TorchRec's own sharders, and is told to use the tiered planner when the sharder
offers the tiered kernel."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.types import ModuleSharder, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
)

FUSED = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
ROWS = (4000, 1000, 300, 50_000)


def _module(kind: str) -> nn.Module:
    config: type[EmbeddingBagConfig] | type[EmbeddingConfig] = (
        EmbeddingBagConfig if kind == "ebc" else EmbeddingConfig
    )
    tables = [
        config(name=f"t{i}", embedding_dim=16, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(ROWS)
    ]
    if kind == "ebc":
        return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    return EmbeddingCollection(tables=tables, device=torch.device("meta"))


def _sharders(
    kind: str, **kwargs: Any
) -> tuple[ModuleSharder[nn.Module], ModuleSharder[nn.Module]]:
    if kind == "ebc":
        return (
            EmbeddingBagCollectionSharder(fused_params=dict(FUSED)),
            TieredEmbeddingBagCollectionSharder(fused_params=dict(FUSED), **kwargs),
        )
    return (
        EmbeddingCollectionSharder(fused_params=dict(FUSED)),
        TieredEmbeddingCollectionSharder(fused_params=dict(FUSED), **kwargs),
    )


def _stock_plan(module: nn.Module, sharder: ModuleSharder[nn.Module], world: int) -> str:
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=world, compute_device="cpu"))
    return str(planner.plan(module, [sharder]))


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("world", [1, 2])
def test_stock_planner_plans_as_with_torchrecs_sharder(kind: str, world: int) -> None:
    theirs, ours = _sharders(kind)
    assert ours.sharding_types("cpu") == theirs.sharding_types("cpu")
    for sharding_type in theirs.sharding_types("cpu"):
        assert ours.compute_kernels(sharding_type, "cpu") == theirs.compute_kernels(
            sharding_type, "cpu"
        )
    expected = _stock_plan(_module(kind), theirs, world)
    assert _stock_plan(_module(kind), ours, world) == expected
    if kind == "ebc":  # the plan that used to change: row-wise for every table on CPU
        assert "row_wise" not in expected


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_stock_planner_with_the_tiered_kernel_offered_names_the_tiered_planner(kind: str) -> None:
    _, ours = _sharders(kind, offer_tiered_kernel=True)
    with pytest.raises(ValueError, match=r"offer_tiered_kernel=True.*TieredShardingPlanner"):
        _stock_plan(_module(kind), ours, 2)


def test_the_tiered_planner_is_offered_the_tiered_kernel_and_row_wise() -> None:
    _, ours = _sharders("ebc", offer_tiered_kernel=True)
    tiered = getattr(ours, "planner_compute_kernels")  # noqa: B009
    types = getattr(ours, "planner_sharding_types")  # noqa: B009
    assert TIERED_KERNEL in tiered(ShardingType.TABLE_WISE.value, "cpu")
    assert TIERED_KERNEL not in tiered(ShardingType.DATA_PARALLEL.value, "cpu")
    assert ShardingType.ROW_WISE.value in types("cpu")
    _, plain = _sharders("ebc")
    assert TIERED_KERNEL not in getattr(plain, "planner_compute_kernels")("table_wise", "cpu")  # noqa: B009
