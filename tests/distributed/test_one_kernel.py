"""Every tiered table of a lookup runs in one tiered kernel, whatever its tier, cache size and
policy, and so do the FUSED tables beside them when TorchRec could batch them together (same
data type, pooling, optimizer): one fbgemm module and one remap per batch, nothing for TorchRec
to concatenate. Other FUSED tables keep TorchRec's kernel."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tests.distributed.test_checkpoint import assert_same, full_weights, train
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.kernel import TieredEmbeddingBag
from torchrec_mtrains.pipeline import tiered_groups

PLACEMENT = {
    "big": TieredTableOptions(tier="block_scm", cache_load_factor=0.1, cache_policy="lru"),
    "mid": TieredTableOptions(tier="byte_scm", cache_load_factor=0.25, cache_policy="lfu"),
    "low": TieredTableOptions(tier="dram", cache_load_factor=0.5, cache_policy="lru"),
}


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """One rank."""


def _model(root: Path, own_pooling: PoolingType = PoolingType.SUM) -> DistributedModelParallel:
    # Features f0 and f1 as test_checkpoint.train feeds them: f0 ids < 300, f1 ids < 40 ("own"
    # has more rows than a checkpoint chunk, so chunking its state would show).
    tables = [
        EmbeddingBagConfig(name="big", embedding_dim=8, num_embeddings=300, feature_names=["f0"]),
        EmbeddingBagConfig(name="mid", embedding_dim=16, num_embeddings=300, feature_names=["f0"]),
        EmbeddingBagConfig(name="low", embedding_dim=8, num_embeddings=40, feature_names=["f1"]),
        EmbeddingBagConfig(
            name="own",
            embedding_dim=4,
            num_embeddings=100,
            feature_names=["f1"],
            pooling=own_pooling,
        ),
    ]
    storage = TierStorage(root=str(root), checkpoint_chunk_rows=64)
    fused = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
    sharder = TieredEmbeddingBagCollectionSharder(storage, fused_params=fused)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        ebc,
        {
            **{name: table_wise(rank=0, compute_kernel=TIERED_KERNEL) for name in PLACEMENT},
            "own": table_wise(rank=0, compute_kernel="fused"),
        },
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    for name, options in PLACEMENT.items():
        plan[name] = TieredParameterSharding.wrap(plan[name], options)
    return DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def _kernels(model: DistributedModelParallel) -> list[torch.nn.Module]:
    return [
        kernel
        for module in model.modules()
        for lookup in getattr(module, "_lookups", [])
        for kernel in getattr(getattr(lookup, "module", lookup), "_emb_modules", [])
    ]


def test_tables_of_every_tier_share_one_kernel(tmp_path: Path) -> None:
    model = _model(tmp_path)
    groups = tiered_groups(model)
    assert len(groups) == 1
    shards = {shard.name: shard for shard in groups[0]}
    assert shards.keys() == PLACEMENT.keys()
    for name, options in PLACEMENT.items():
        shard = shards[name]
        assert shard.store.serves_tier == options.tier.value
        assert shard.cache.num_slots == options.cache_rows(shard.local_rows)
        assert shard.cache.policy.name == options.cache_policy
    (kernel,) = _kernels(model)  # "own" (FUSED) is computed by the tiered kernel too
    assert isinstance(kernel, TieredEmbeddingBag)
    assert kernel.emb_module.table_names == ["big", "mid", "low", "own"]
    # "own" keeps all its rows in the module, as FUSED would, with no tier or cache.
    own = kernel.split_embedding_weights()[3]
    assert (
        own.shape == (100, 4)
        and own.data_ptr() == kernel.emb_module.split_embedding_weights()[3].data_ptr()
    )
    ebc = model.module
    assert set(ebc.state_dict()) >= {f"embedding_bags.{n}.weight" for n in [*PLACEMENT, "own"]}
    assert "embedding_bags.own.weight" in dict(model.named_parameters())
    # Tiered state is split into checkpoint chunks (64 rows); the resident table's is laid out
    # as TorchRec's FUSED kernel lays it out, one shard.
    state = model.fused_optimizer.state_dict()["state"]
    assert len(state["embedding_bags.big.weight"]["big.momentum1"].local_shards()) == 5
    assert len(state["embedding_bags.own.weight"]["own.momentum1"].local_shards()) == 1


def test_fused_tables_pooled_otherwise_keep_torchrec_kernel(tmp_path: Path) -> None:
    model = _model(tmp_path, own_pooling=PoolingType.MEAN)
    kernels = _kernels(model)
    assert sum(isinstance(k, TieredEmbeddingBag) for k in kernels) == 1
    assert len(kernels) == 2  # the tiered one and TorchRec's fused one for "own"


@pytest.mark.parametrize("own_pooling", [PoolingType.SUM, PoolingType.MEAN], ids=["one", "two"])
def test_one_kernel_trains_and_reloads_exactly(tmp_path: Path, own_pooling: PoolingType) -> None:
    src = _model(tmp_path / "a", own_pooling)
    train(src, 6, seed=1)
    dst = _model(tmp_path / "b", own_pooling)
    dst.load_state_dict(src.state_dict())
    dst.fused_optimizer.load_state_dict(src.fused_optimizer.state_dict())
    assert_same(full_weights(src), full_weights(dst))
    train(src, 4, seed=2)
    train(dst, 4, seed=2)
    assert_same(full_weights(src), full_weights(dst))


def test_a_state_dict_flushes_and_a_load_purges_fbgemms_own_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On CUDA a resident FUSED_UVM_CACHING table keeps its newest rows in fbgemm's cache in
    # HBM: TorchRec's kernel flushes it before a state dict reads the rows and resets it
    # before a load writes them, and so must the tiered kernel that computes such a table.
    # (On the CPU fbgemm has no cache and both calls do nothing: this checks that they are
    # made; tests/distributed/test_cuda.py checks the rows on a GPU.)
    model = _model(tmp_path)
    (kernel,) = _kernels(model)
    calls: list[str] = []
    module = kernel.emb_module
    flush, reset = module.flush, module.reset_cache_states
    monkeypatch.setattr(module, "flush", lambda: (calls.append("flush"), flush())[1])
    monkeypatch.setattr(module, "reset_cache_states", lambda: (calls.append("reset"), reset())[1])
    state = model.state_dict()
    assert calls == ["flush"]
    calls.clear()
    model.load_state_dict(state)
    assert calls == ["reset"]
