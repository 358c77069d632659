"""TorchRec's own sharding test harness with this package's sharder.

``torchrec.distributed.test_utils.test_sharding.sharding_single_rank_test_single_process``
builds TorchRec's ``TestSparseNN`` (an EBC and a weighted EBC over several tables), plans it
with TorchRec's planner, shards it with the sharders it is given, copies an unsharded model's
weights into the sharded one through ``copy_state_dict`` (an in-place write of the sharded
model's state dict), trains one step of each and compares their predictions. Here the sharder
puts two of the tables (one of each EBC) on a tier behind a cache; the reference is TorchRec's
unsharded model. Every sharding type the tiered kernel runs, at world size 1 and 2, on every
tier and block layout.
"""

from __future__ import annotations

import os
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_mtrains.distributed import (
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group

SHARDINGS = (ShardingType.TABLE_WISE, ShardingType.COLUMN_WISE, ShardingType.ROW_WISE)
# (tier, block layout): every store a tiered table can live in
STORES = (("dram", "flat"), ("byte_scm", "flat"), ("block_scm", "flat"), ("block_scm", "log"))
TIERED = ("table_1", "weighted_table_0")


def _import_harness() -> Any:
    """TorchRec's harness module. Its wheel leaves out ``torchrec.distributed.tests``, whose
    ``TestEmbeddingCollectionSharder`` the harness imports for 2D-parallel runs only (not run
    here): a stand-in that refuses to be built takes its place."""
    name = "torchrec.distributed.tests.test_sequence_model"
    if name not in sys.modules:
        try:
            __import__(name)
        except ModuleNotFoundError:
            stand_in = types.ModuleType(name)

            class TestEmbeddingCollectionSharder:
                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    raise NotImplementedError("2D parallel runs are not part of this test")

            stand_in.TestEmbeddingCollectionSharder = TestEmbeddingCollectionSharder  # type: ignore[attr-defined]
            sys.modules.setdefault("torchrec.distributed.tests", types.ModuleType("x"))
            sys.modules[name] = stand_in
    from torchrec.distributed.test_utils import test_sharding

    return test_sharding


class _TierSomeTables(TieredEmbeddingBagCollectionSharder):
    """The tiered sharder, told which tables go on a tier whatever TorchRec's planner chose
    for them (it plans them on FUSED: it cannot estimate the tiered kernel), and offering one
    sharding type (row-wise too, which TorchRec's sharder leaves out on the CPU)."""

    def __init__(
        self,
        storage: TierStorage,
        tiered: dict[str, TieredTableOptions],
        sharding_type: ShardingType,
        **kwargs: Any,
    ) -> None:
        super().__init__(storage, **kwargs)
        self._tiered = tiered
        self._type = sharding_type

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return [self._type.value]

    def shard(
        self,
        module: EmbeddingBagCollection,
        params: dict[str, ParameterSharding],
        env: ShardingEnv,
        device: torch.device | None = None,
        module_fqn: str | None = None,
    ) -> nn.Module:
        params = {
            name: TieredParameterSharding.wrap(p, self._tiered[name]) if name in self._tiered else p
            for name, p in params.items()
        }
        return super().shard(module, params, env, device, module_fqn)


def _tables(prefix: str, count: int) -> list[EmbeddingBagConfig]:
    """TorchRec's naming (``table_0``, ``weighted_table_0``, ... read by ``feature_0``, ...):
    rows enough for a cache of 30% to hold a batch."""
    return [
        EmbeddingBagConfig(
            num_embeddings=(i + 1) * 300,
            embedding_dim=16,
            name=f"{prefix}table_{i}",
            feature_names=[f"{prefix}feature_{i}"],
        )
        for i in range(count)
    ]


def run_harness(rank: int, world_size: int, root: Path) -> list[str]:
    """Every sharding type and store through TorchRec's harness on this rank (in a process
    group of ``world_size``); the failures, each named."""
    test_sharding = _import_harness()
    from torchrec.distributed.test_utils.test_model import TestSparseNN

    failures = []
    tables, weighted = _tables("", 3), _tables("weighted_", 2)
    for sharding in SHARDINGS:
        for tier, layout in STORES:
            name = f"{sharding.value} {tier} {layout}"
            storage = TierStorage(
                root=str(root / name.replace(" ", "_") / f"rank{rank}"),
                tier_options={"block_scm": {"layout": layout}},
            )
            options = TieredTableOptions(tier=tier, cache_load_factor=0.3)
            sharder = _TierSomeTables(
                storage,
                dict.fromkeys(TIERED, options),
                sharding,
                fused_params={"optimizer": OptimType.EXACT_SGD, "learning_rate": 0.1},
            )
            constraints = {
                t.name: ParameterConstraints(
                    sharding_types=[sharding.value],
                    compute_kernels=[EmbeddingComputeKernel.FUSED.value],
                )
                for t in tables + weighted
            }
            try:
                test_sharding.sharding_single_rank_test_single_process(
                    pg=dist.group.WORLD,
                    device=torch.device("cpu"),
                    rank=rank,
                    world_size=world_size,
                    model_class=TestSparseNN,
                    embedding_groups={},
                    tables=tables,
                    weighted_tables=weighted,
                    sharders=[sharder],
                    optim=EmbOptimType.EXACT_SGD,
                    constraints=constraints,
                    local_size=world_size,
                )
            except Exception:
                failures.append(f"{name}: {traceback.format_exc(limit=-3)}")
    return failures


def _rank_main(rank: int, world_size: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    with process_group(backend="gloo", rank=rank, world_size=world_size, port=port):
        failures = run_harness(rank, world_size, Path(root))
    torch.save(failures, os.path.join(root, f"failures{rank}.pt"))


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_torchrecs_sharding_harness_passes_with_tiered_tables(
    tmp_path: Path, world_size: int
) -> None:
    mp.spawn(
        _rank_main, args=(world_size, free_port(), str(tmp_path)), nprocs=world_size, join=True
    )
    failures = [
        f for rank in range(world_size) for f in torch.load(tmp_path / f"failures{rank}.pt")
    ]
    assert not failures, "\n".join(failures)
    # The tables were on their tiers (the harness would pass on FUSED alone too).
    tier_files = {p.name.split(".")[0] for p in tmp_path.rglob("*.rows")}
    assert tier_files == set(TIERED)
