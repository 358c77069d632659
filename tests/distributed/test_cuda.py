"""The CUDA path: the cache lives in HBM (fbgemm's fused module on the GPU), rows on a tier.

Skipped without a GPU; CI has none."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

FUSED = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
TABLES = [EmbeddingBagConfig(name="t", embedding_dim=16, num_embeddings=500, feature_names=["f"])]


def _model(tiered: bool, root: Path) -> DistributedModelParallel:
    device = torch.device("cuda")
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    sharder: EmbeddingBagCollectionSharder
    if tiered:
        sharder = TieredEmbeddingBagCollectionSharder(
            TierStorage(root=str(root)), fused_params=FUSED
        )
        kernel = TIERED_KERNEL
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params=FUSED)
        kernel = "fused"
    plan = construct_module_sharding_plan(
        ebc,
        {"t": table_wise(rank=0, compute_kernel=kernel)},
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type="cuda",
    )
    if tiered:
        plan["t"] = TieredParameterSharding.wrap(
            plan["t"], TieredTableOptions(tier="block_scm", cache_load_factor=0.3)
        )
    return DistributedModelParallel(
        ebc, device=device, plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def test_hbm_cache_matches_fused(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        ref = _model(False, tmp_path)
        tie = _model(True, tmp_path)
        tie.load_state_dict(ref.state_dict())
        g = torch.Generator().manual_seed(0)
        for _ in range(50):
            lengths = torch.randint(1, 3, (32,), generator=g)
            values = torch.randint(0, 500, (int(lengths.sum()),), generator=g)
            kjt = KeyedJaggedTensor(keys=["f"], values=values, lengths=lengths).to("cuda")
            for m in (ref, tie):
                out = m(kjt)
                out = out.wait() if hasattr(out, "wait") else out
                out.values().sum().backward()
        a = ref.state_dict()["embedding_bags.t.weight"]
        b = tie.state_dict()["embedding_bags.t.weight"]
        wa = torch.cat([s.tensor.cpu() for s in a.local_shards()])
        wb = torch.cat([s.tensor.cpu() for s in b.local_shards()])
        assert (wa - wb).abs().max().item() <= 1e-6
        stats = tie.module.tier_stats()["t"]
        assert stats["misses"] > 0 and stats["evictions"] > 0
    finally:
        dist.destroy_process_group()
