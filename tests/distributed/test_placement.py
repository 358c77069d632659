"""Tier-backed tensors say where they live: on the host, whatever device holds the cache.

A plan for CUDA places every shard on ``cuda:<rank>``; a tiered table's checkpoint views and
optimizer-state views are CPU tensors viewing its tier, and ShardedTensor refuses a shard whose
tensor and placement disagree (the error DMP raised on an H100). These tests build tiered
models from CUDA plans on the CPU, which hits the same check, and move checkpoints between a
CUDA-planned and a CPU-planned model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    table_wise,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)

FUSED = {"optimizer": OptimType.EXACT_ADAGRAD, "learning_rate": 0.05}
TABLES = (("t_tw", 120, "f0"), ("t_cw", 80, "f1"))
DIM = 8


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """Every test here runs on one rank."""


def _module(kind: str) -> nn.Module:
    meta = torch.device("meta")
    if kind == "ebc":
        return EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f])
                for n, r, f in TABLES
            ],
            device=meta,
        )
    return EmbeddingCollection(
        tables=[
            EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f])
            for n, r, f in TABLES
        ],
        device=meta,
    )


def _model(kind: str, plan_device: str, root: Path, tier: str) -> DistributedModelParallel:
    """Both tables tiered, one table-wise and one column-wise (two shards on rank 0), planned
    for ``plan_device``; the model computes on the CPU."""
    storage = TierStorage(root=str(root))
    sharder: ModuleSharder[nn.Module] = (
        TieredEmbeddingBagCollectionSharder(storage, fused_params=FUSED)
        if kind == "ebc"
        else TieredEmbeddingCollectionSharder(storage, fused_params=FUSED)
    )
    plan = construct_module_sharding_plan(
        _module(kind),
        {
            "t_tw": table_wise(rank=0, compute_kernel=TIERED_KERNEL),
            "t_cw": column_wise(ranks=[0, 0], compute_kernel=TIERED_KERNEL),
        },
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type=plan_device,
    )
    options = TieredTableOptions(tier=tier, cache_load_factor=0.5)
    for name in plan:
        plan[name] = TieredParameterSharding.wrap(plan[name], options)
    torch.manual_seed(0)
    return DistributedModelParallel(
        _module(kind), device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def _train(model: DistributedModelParallel, kind: str, steps: int = 5) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        lengths = torch.randint(0, 3, (2 * 6,), generator=g)
        values = torch.randint(0, 80, (int(lengths.sum()),), generator=g)
        kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)
        out = model(kjt)
        out = out.wait() if hasattr(out, "wait") else out
        if kind == "ebc":
            out.values().square().sum().backward()
        else:
            sum(v.values().square().sum() for v in out.values()).backward()


def _sharded(state: dict[str, Any]) -> Iterator[tuple[str, ShardedTensor]]:
    for key, value in state.items():
        if isinstance(value, ShardedTensor):
            yield key, value
        elif isinstance(value, dict):
            for sub, inner in _sharded(value):
                yield f"{key}.{sub}", inner


def _everything(model: DistributedModelParallel) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


@pytest.mark.parametrize("kind", ["ebc", "ec"])
def test_tier_views_are_placed_on_the_host_under_a_cuda_plan(kind: str, tmp_path: Path) -> None:
    model = _model(kind, "cuda", tmp_path, "block_scm")  # raised ValueError before the rule
    _train(model, kind)
    found = dict(_sharded(_everything(model)))
    # Two tables' weights, and each table's Adagrad state.
    assert len([k for k in found if k.startswith("model.")]) == 2
    assert len([k for k in found if k.startswith("optim.")]) == 2
    for key, tensor in found.items():
        placements = {str(s.placement) for s in tensor.metadata().shards_metadata}
        assert placements == {"rank:0/cpu"}, (key, placements)
        for shard in tensor.local_shards():
            assert shard.tensor.device.type == "cpu", key


def _flat(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """Every tiered weight and state as whole local tensors, by key."""
    out = {}
    for key, tensor in _sharded(_everything(model)):
        shards = sorted(tensor.local_shards(), key=lambda s: tuple(s.metadata.shard_offsets))
        out[key] = torch.cat([s.tensor.reshape(s.tensor.shape[0], -1) for s in shards]).clone()
    return out


@pytest.mark.parametrize(("source", "target"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_compute_devices(source: str, target: str, tmp_path: Path) -> None:
    trained = _model("ebc", source, tmp_path / "a", "byte_scm")
    _train(trained, "ebc")
    dcp.save(_everything(trained), checkpoint_id=tmp_path / "ckpt")
    restored = _model("ebc", target, tmp_path / "b", "block_scm")
    state = _everything(restored)
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    restored.load_state_dict(state["model"])
    restored.fused_optimizer.load_state_dict(state["optim"])
    want, got = _flat(trained), _flat(restored)
    assert set(want) == set(got)
    for key in want:
        assert torch.equal(want[key], got[key]), key
