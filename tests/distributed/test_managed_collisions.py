"""TorchRec's managed-collision modules (raw ids remapped into a fixed table) with this project's
sharder underneath: ``ManagedCollision{EmbeddingBag,Embedding}CollectionSharder`` over ours,
row-wise, the remapped table on a tier.

Each id the module places in a slot makes it reset that row (fbgemm's
``reset_embedding_weight_momentum`` on the kernel's module: weights and row-wise momentum to
zero) and then write the row through the table's ``weight`` (``weight[slots] =
init_fn(weight[slots])``). Parity is against the same module sharded by TorchRec's own
sharders (FUSED). fbgemm has no CPU kernel for that reset, so on CPU the reference's reset is
the test's: fbgemm's CUDA kernel's effect on the CPU module's rows (:func:`_cpu_reset`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.mc_embedding import ManagedCollisionEmbeddingCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.modules.mc_embedding_modules import (
    ManagedCollisionEmbeddingBagCollection,
    ManagedCollisionEmbeddingCollection,
)
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.tier_rows_param import TierRowsParameter
from torchrec_mtrains.distributed.tiered_tables import TableIdError
from torchrec_mtrains.initializers import IdSeededUniform
from torchrec_mtrains.pipeline import LookaheadTrainPipeline
from torchrec_mtrains.types import Tier

pytestmark = pytest.mark.usefixtures("one_rank_process_group", "one_thread")

ZCH = 40  # slots of the remapped table (its cache holds half)
DIM = 8
# block_scm: its default layout, the log; "flat": the flat file
TIERS = ("dram", "byte_scm", "block_scm", "flat")


class _Model(nn.Module):
    def __init__(self, bagged: bool, zch_size: int = ZCH, device: str = "cpu") -> None:
        super().__init__()
        kwargs: dict[str, Any] = dict(
            name="t_mc",
            embedding_dim=DIM,
            num_embeddings=zch_size,
            feature_names=["f"],
            init_fn=IdSeededUniform(seed=3, dim=DIM, low=-0.1, high=0.1),
        )
        config = EmbeddingBagConfig(**kwargs) if bagged else EmbeddingConfig(**kwargs)
        mch = MCHManagedCollisionModule(
            zch_size=zch_size,
            device=torch.device(device),
            eviction_policy=DistanceLFU_EvictionPolicy(),
            eviction_interval=2,
            input_hash_size=2**40,
        )
        collection = ManagedCollisionCollection({"t_mc": mch}, embedding_configs=[config])
        self.mc: nn.Module
        if bagged:
            ebc = EmbeddingBagCollection(tables=[config], device=torch.device(device))
            self.mc = ManagedCollisionEmbeddingBagCollection(
                ebc, collection, return_remapped_features=True
            )
        else:
            ec = EmbeddingCollection(tables=[config], device=torch.device(device))
            self.mc = ManagedCollisionEmbeddingCollection(
                ec, collection, return_remapped_features=True
            )

    def forward(self, features: KeyedJaggedTensor) -> Any:
        return self.mc(features)


class _BatchModel(_Model):
    """Called with a batch, as TorchRec's train pipelines call a model: (loss, output)."""

    def forward(self, batch: Batch) -> Any:
        pooled, _ = self.mc(batch.sparse_features)
        loss = _loss(pooled.values())
        return loss, loss.detach()


def _loss(pooled: torch.Tensor) -> torch.Tensor:
    return (pooled * torch.arange(1, pooled.numel() + 1).reshape(pooled.shape)).sum()


def _build(
    root: Path | None,
    bagged: bool = True,
    tier: str = "block_scm",
    optimizer: OptimType = OptimType.EXACT_ROWWISE_ADAGRAD,
    zch_size: int = ZCH,
    cache_load_factor: float = 0.5,
    batches: bool = False,
) -> DistributedModelParallel:
    """The module sharded row-wise by TorchRec's managed-collision sharder over ours (the
    remapped table on ``tier``), or over TorchRec's own sharder (FUSED) when ``root`` is None."""
    model = (_BatchModel if batches else _Model)(bagged, zch_size)
    fused = {"optimizer": optimizer, "learning_rate": 0.1}
    mc_sharder: Any
    if root is None:
        mc_sharder = (
            ManagedCollisionEmbeddingBagCollectionSharder()
            if bagged
            else ManagedCollisionEmbeddingCollectionSharder()
        )
        mc_sharder._e_sharder._fused_params = fused
    elif bagged:
        ebc_sharder = TieredEmbeddingBagCollectionSharder(_storage(root, tier), fused_params=fused)
        mc_sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharder)
    else:
        ec_sharder = TieredEmbeddingCollectionSharder(_storage(root, tier), fused_params=fused)
        mc_sharder = ManagedCollisionEmbeddingCollectionSharder(ec_sharder=ec_sharder)
    kernel = "fused" if root is None else TIERED_KERNEL
    plan = construct_module_sharding_plan(
        model.mc, {"t_mc": row_wise(compute_kernel=kernel)}, sharder=mc_sharder, device_type="cpu"
    )
    if root is not None:
        plan["t_mc"] = TieredParameterSharding.wrap(
            plan["t_mc"],
            TieredTableOptions(
                tier=Tier.parse("block_scm" if tier == "flat" else tier),
                cache_load_factor=cache_load_factor,
            ),
        )
    dmp = DistributedModelParallel(
        model, plan=ShardingPlan({"mc": plan}), sharders=[mc_sharder], device=torch.device("cpu")
    )
    if root is None:
        for tbe, _ in dmp.module.mc._table_to_tbe_and_index.values():
            _cpu_reset(tbe)
    return dmp


def _storage(root: Path, tier: str) -> TierStorage:
    flat = {"block_scm": {"layout": "flat"}} if tier == "flat" else {}
    return TierStorage(root=str(root), tier_options=flat)


def _cpu_reset(tbe: Any) -> None:
    """fbgemm's ``reset_embedding_weight_momentum`` on a CPU module, as its CUDA kernel does it:
    under ``EXACT_ROWWISE_ADAGRAD`` the rows' weights and momentum become zero; under other
    optimizers nothing happens. (fbgemm has no CPU kernel for it; the reference's reset.)"""

    def reset(
        pruned_indices: torch.Tensor,
        pruned_indices_offsets: torch.Tensor,
        logical_table_ids: torch.Tensor,
        buffer_ids: torch.Tensor,
    ) -> None:
        if tbe.optimizer != OptimType.EXACT_ROWWISE_ADAGRAD:
            return
        offsets = pruned_indices_offsets.tolist()
        for t, b in zip(logical_table_ids.tolist(), buffer_ids.tolist()):
            ids = pruned_indices[offsets[b] : offsets[b + 1]]
            weights, D = tbe.weights_host, int(tbe.D_offsets[t + 1] - tbe.D_offsets[t])
            rows = int(tbe.weights_offsets[t]) + ids.unsqueeze(1) * D + torch.arange(D)
            weights[rows.flatten()] = 0
            tbe.momentum1_host[int(tbe.momentum1_offsets[t]) + ids] = 0

    tbe.reset_embedding_weight_momentum = reset


def _batch(g: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 3, (8,), generator=g)
    raw = torch.randint(0, 300, (int(lengths.sum()),), generator=g) ** 3 * 7919 % 2**40
    return KeyedJaggedTensor(keys=["f"], values=raw, lengths=lengths)


def _pooled(out: Any) -> torch.Tensor:
    values = out.values() if hasattr(out, "values") and callable(out.values) else None
    if isinstance(values, torch.Tensor):
        return values  # a KeyedTensor
    return torch.cat([jt.values() for jt in out.values()])  # EC: per feature JaggedTensors


def _table(value: Any) -> torch.Tensor:
    """A one-rank ShardedTensor's rows (its chunks, by their offsets), as one tensor."""
    shards = sorted(value.local_shards(), key=lambda s: s.metadata.shard_offsets[0])
    return torch.cat([s.tensor for s in shards])


def _momentum(model: DistributedModelParallel) -> torch.Tensor:
    (states,) = [v for k, v in model.fused_optimizer.state_dict()["state"].items() if "t_mc" in k]
    (key,) = [k for k in states if k.endswith("momentum1")]
    return _table(states[key])


def _train(model: DistributedModelParallel, steps: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    outs = []
    for _ in range(steps):
        out, _ = model(_batch(g))
        pooled = _pooled(out)
        loss = _loss(pooled)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        outs.append(pooled.detach().clone())
    return outs


@pytest.mark.parametrize("bagged", [True, False], ids=["ebc", "ec"])
@pytest.mark.parametrize("tier", TIERS)
def test_evictions_reset_rows_on_the_tiers_as_on_torchrecs_fused_kernel(
    tier: str, bagged: bool, tmp_path: Path
) -> None:
    reference = _build(None, bagged)
    calls: list[int] = []
    ((tbe, _),) = reference.module.mc._table_to_tbe_and_index.values()
    reset = tbe.reset_embedding_weight_momentum

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(int(kwargs["pruned_indices"].numel()))
        reset(*args, **kwargs)

    tbe.reset_embedding_weight_momentum = counted
    ours = _build(tmp_path, bagged, tier)
    for step, (a, b) in enumerate(zip(_train(reference, 40), _train(ours, 40))):
        assert torch.equal(a, b), f"step {step}"
    # Slots were handed to new ids again and again, more than the cache holds at once.
    assert len(calls) > 5 and sum(calls) > ZCH
    key = "mc._embedding_module." + ("embedding_bags" if bagged else "embeddings") + ".t_mc.weight"
    assert torch.equal(_table(reference.state_dict()[key]), _table(ours.state_dict()[key]))
    assert torch.equal(_momentum(reference), _momentum(ours))


def test_other_optimizers_reset_nothing_but_the_rows_written(tmp_path: Path) -> None:
    """Under SGD fbgemm's reset does nothing (TorchRec's FUSED kernel runs on CPU as is)."""
    reference = _build(None, optimizer=OptimType.EXACT_SGD)
    ours = _build(tmp_path, optimizer=OptimType.EXACT_SGD)
    for step, (a, b) in enumerate(zip(_train(reference, 30), _train(ours, 30))):
        assert torch.equal(a, b), f"step {step}"


def test_the_tables_weight_reads_and_sets_rows_where_they_live(tmp_path: Path) -> None:
    ours = _build(tmp_path, tier="block_scm")
    _train(ours, 10)
    weight = ours.module.mc._embedding_module.embedding_bags.get_parameter("t_mc.weight")
    assert isinstance(weight, TierRowsParameter) and weight.shape == (ZCH, DIM)
    key = "mc._embedding_module.embedding_bags.t_mc.weight"
    everything = _table(ours.state_dict()[key])
    assert torch.equal(weight[torch.arange(ZCH)], everything)
    assert torch.equal(weight[3], everything[3]) and torch.equal(weight[-1], everything[-1])
    assert torch.equal(weight[5:9], everything[5:9])
    with torch.no_grad():
        weight[torch.tensor([0, 7, ZCH - 1])] = torch.full((3, DIM), 0.5)
        weight.data[[1]] = torch.ones(1, DIM)
    after = _table(ours.state_dict()[key])
    assert torch.equal(after[[0, 7, ZCH - 1]], torch.full((3, DIM), 0.5))
    assert torch.equal(after[1], torch.ones(DIM))
    keep = torch.ones(ZCH, dtype=torch.bool)
    keep[[0, 1, 7, ZCH - 1]] = False
    assert torch.equal(after[keep], everything[keep])
    # No optimizer, parameter list or state dict holds it.
    assert not any(isinstance(p, TierRowsParameter) for p in ours.parameters())
    with pytest.raises(TableIdError, match=r"table 't_mc': row id 40 out of range \[0, 40\)"):
        weight[torch.tensor([ZCH])]
    with pytest.raises(NotImplementedError, match=r"table 't_mc': its weight lives on a tier"):
        weight.sum()
    with (
        pytest.raises(ValueError, match=r"table 't_mc': row ids to set repeat an id"),
        torch.no_grad(),
    ):
        weight[[2, 2]] = torch.zeros(2, DIM)


def test_a_reset_of_rows_some_cached_some_on_the_tier_counts_them_as_changed(
    tmp_path: Path,
) -> None:
    """Rows set through the weight are rows an incremental checkpoint must save."""
    ours = _build(tmp_path, tier="flat")
    _train(ours, 6)
    (group,) = list(ours.module.mc._embedding_module.tiered_groups())
    group.track_changes()
    group.clear_changes()
    weight = ours.module.mc._embedding_module.embedding_bags.get_parameter("t_mc.weight")
    with torch.no_grad():
        weight[[4, 30]] = torch.zeros(2, DIM)
    changed = group.changed_rows(0)
    assert changed is not None and torch.nonzero(changed).flatten().tolist() == [4, 30]


def _two_ranks(rank: int, port: int, root: str) -> None:
    """Spawned: both sides row-wise over two ranks, each rank feeding its own batches."""
    from datetime import timedelta

    from torchrec_mtrains.distributed.runtime import process_group

    torch.set_num_threads(1)
    with process_group(
        backend="gloo", rank=rank, world_size=2, port=port, timeout=timedelta(seconds=60)
    ):
        # Each rank's cache holds 30 of its 40 slots: a batch from both ranks can bring 32 ids.
        reference = _build(None, zch_size=2 * ZCH)
        ours = _build(
            Path(root) / f"rank{rank}", tier="byte_scm", zch_size=2 * ZCH, cache_load_factor=0.75
        )
        # TorchRec's sharder hands init_fn a rank's rows without their offsets, ours fills them
        # by their place in the table: the same start for the slots no id reaches.
        ours.load_state_dict(reference.state_dict())
        for step, (a, b) in enumerate(
            zip(_train(reference, 30, seed=rank + 1), _train(ours, 30, seed=rank + 1))
        ):
            assert torch.equal(a, b), f"rank {rank}, step {step}"
        key = "mc._embedding_module.embedding_bags.t_mc.weight"
        mine, theirs = ours.state_dict()[key], reference.state_dict()[key]
        assert torch.equal(_table(mine), _table(theirs))
        assert _table(mine).shape[0] == ZCH  # this rank's half of the slots


def test_row_wise_over_two_ranks(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from torchrec_mtrains.distributed.runtime import free_port

    mp.spawn(_two_ranks, args=(free_port(), str(tmp_path)), nprocs=2, join=True)  # type: ignore[attr-defined,no-untyped-call]  # untyped in torch


def test_the_look_ahead_pipeline_trains_them_as_the_plain_loop(tmp_path: Path) -> None:
    """It reads no row ahead for them (the module remaps ids in its forward), and changes
    nothing."""
    plain = _build(tmp_path / "plain", batches=True)
    piped = _build(tmp_path / "piped", batches=True)
    g = torch.Generator().manual_seed(5)
    batches = [
        Batch(dense_features=torch.zeros(8, 1), sparse_features=_batch(g), labels=torch.zeros(8))
        for _ in range(25)
    ]
    expected = []
    for batch in batches:
        loss, _ = plain(batch)
        loss.backward()
        expected.append(loss.detach())
    unused = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    got = []
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        piped, unused, torch.device("cpu"), lookahead=2
    )
    with pipeline:
        batch_iter = iter(batches)
        for _ in batches:
            got.append(pipeline.progress(batch_iter))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    key = "mc._embedding_module.embedding_bags.t_mc.weight"
    assert torch.equal(_table(plain.state_dict()[key]), _table(piped.state_dict()[key]))
