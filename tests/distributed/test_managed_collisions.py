"""TorchRec's managed-collision modules (raw ids remapped into a fixed table) with this project's
sharder underneath.

They shard (``ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=<ours>)``, row-wise,
the remapped table on a tier), but every id the module places in a slot makes it reset that row
through fbgemm's ``reset_embedding_weight_momentum`` on the kernel's module and then write the
row through the table's registered parameter: on CPU fbgemm has no kernel for the reset (so
TorchRec's own FUSED kernel fails there too, and no CPU reference exists), and a tiered table
has neither rows in that module nor such a parameter. The tiered kernel refuses the reset,
naming the table, rather than reset cache slots by row ids."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.initializers import IdSeededUniform

pytestmark = pytest.mark.usefixtures("one_rank_process_group", "one_thread")

FUSED_PARAMS = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}


class _Model(nn.Module):
    def __init__(self, zch_size: int) -> None:
        super().__init__()
        config = EmbeddingBagConfig(
            name="t_mc",
            embedding_dim=8,
            num_embeddings=zch_size,
            feature_names=["f"],
            init_fn=IdSeededUniform(seed=3, dim=8, low=-0.1, high=0.1),
        )
        cpu = torch.device("cpu")
        mch = MCHManagedCollisionModule(
            zch_size=zch_size,
            device=cpu,
            eviction_policy=DistanceLFU_EvictionPolicy(),
            eviction_interval=2,
            input_hash_size=2**40,
        )
        self.mc = ManagedCollisionEmbeddingBagCollection(
            EmbeddingBagCollection(tables=[config], device=cpu),
            ManagedCollisionCollection({"t_mc": mch}, embedding_configs=[config]),
            return_remapped_features=True,
        )

    def forward(self, features: KeyedJaggedTensor) -> object:
        return self.mc(features)


def _build(zch_size: int, root: Path) -> DistributedModelParallel:
    """The module sharded by TorchRec's managed-collision sharder over ours, the remapped table
    on the block tier."""
    model = _Model(zch_size)
    ebc_sharder = TieredEmbeddingBagCollectionSharder(
        TierStorage(root=str(root)), fused_params=FUSED_PARAMS
    )
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharder)
    plan = construct_module_sharding_plan(
        model.mc,
        {"t_mc": row_wise(compute_kernel=TIERED_KERNEL)},
        sharder=sharder,
        device_type="cpu",
    )
    plan["t_mc"] = TieredParameterSharding.wrap(
        plan["t_mc"], TieredTableOptions(tier="block_scm", cache_load_factor=0.25)
    )
    return DistributedModelParallel(
        model, plan=ShardingPlan({"mc": plan}), sharders=[sharder], device=torch.device("cpu")
    )


def _batch(g: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 4, (8,), generator=g)
    raw = torch.randint(0, 300, (int(lengths.sum()),), generator=g) ** 3 * 7919 % 2**40
    return KeyedJaggedTensor(keys=["f"], values=raw, lengths=lengths)


def test_an_eviction_into_a_tiered_table_is_refused_naming_it(tmp_path: Path) -> None:
    tie = _build(16, tmp_path)
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NotImplementedError, match=r"tables 't_mc': a managed-collision eviction"):
        for _ in range(30):
            out, _ = tie(_batch(g))
            out.values().sum().backward()
