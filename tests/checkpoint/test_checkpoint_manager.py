"""CheckpointManager in a plain TorchRec loop (no app): a chain of full and incremental links
restores bit for bit, weights and both optimizers' states, and training goes on alike, under
TorchRec's TrainPipelineSparseDist and the look-ahead pipeline; retention; broken chains are
refused by name and fallen back past; a save killed mid-write leaves the newest complete link
to resume from; a chain saved at one rank loads at two."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import multiprocessing
import os
import shutil
import signal
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.pipeline.lookahead_harness import differences, full_state
from torchrec_mtrains.checkpoint import (
    ChainError,
    CheckpointError,
    CheckpointManager,
    CheckpointOptions,
)
from torchrec_mtrains.checkpoint.storage import PrivateFileSystem
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.pipeline import LookaheadTrainPipeline

CPU = torch.device("cpu")
BATCH = 8
DENSE = 4
DIM = 8
ROWS = {"fused": 40, "tiered": 600}
LOOKAHEAD = 2


# In-process tests run on one rank (the others spawn their own), on one intra-op thread.
pytestmark = pytest.mark.usefixtures("one_rank_process_group", "one_thread")


# ------------------------------------------------------------------------ model and data


def build(
    root: Path, world_size: int = 1, tiered: bool = True
) -> tuple[DistributedModelParallel, list[KeyedOptimizer]]:
    """A DLRM over an EBC of one FUSED table and one tiered table (row-wise over the ranks),
    its tier files under ``root``, and its optimizers: the fused one and Adam on the dense
    layers (whose state appears on its first step). The same start whatever ``root``."""
    sharder = TieredEmbeddingBagCollectionSharder(
        TierStorage(root=str(root)),
        fused_params={"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
    )
    tables = [
        EmbeddingBagConfig(name=name, embedding_dim=DIM, num_embeddings=rows, feature_names=[name])
        for name, rows in ROWS.items()
    ]
    meta = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    kernel = TIERED_KERNEL if tiered else "fused"
    plan = construct_module_sharding_plan(
        meta,
        {
            "fused": table_wise(rank=0, compute_kernel="fused"),
            "tiered": row_wise(compute_kernel=kernel)
            if world_size > 1
            else table_wise(rank=0, compute_kernel=kernel),
        },
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    if tiered:
        # Room for the batches in flight of every rank, and one more.
        need = BATCH * 2 * world_size * (LOOKAHEAD + 2)
        factor = min(1.0, need / math.ceil(ROWS["tiered"] / world_size))
        plan["tiered"] = TieredParameterSharding.wrap(
            plan["tiered"], TieredTableOptions(tier="block_scm", cache_load_factor=factor)
        )
    torch.manual_seed(7)
    dlrm = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(
                tables=tables, device=torch.device("meta")
            ),
            dense_in_features=DENSE,
            dense_arch_layer_sizes=[8, DIM],
            over_arch_layer_sizes=[8, 1],
            dense_device=CPU,
        )
    )
    model = DistributedModelParallel(
        dlrm,
        device=CPU,
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adam(params, lr=0.01),
    )
    return model, [model.fused_optimizer, dense]


def make_batch(step: int, rank: int = 0) -> Batch:
    g = torch.Generator().manual_seed(1000 * rank + step)
    lengths, values = [], []
    for rows in ROWS.values():
        n = torch.randint(1, 3, (BATCH,), generator=g)
        u = torch.rand(int(n.sum()), generator=g)
        lengths.append(n)
        values.append((u * u * rows).long())  # skewed: batches share rows
    return Batch(
        dense_features=torch.randn(BATCH, DENSE, generator=g),
        sparse_features=KeyedJaggedTensor(
            keys=list(ROWS), values=torch.cat(values), lengths=torch.cat(lengths)
        ),
        labels=(torch.rand(BATCH, generator=g) < 0.3).float(),
    )


class Loop:
    """A user's training loop: TorchRec's pipeline, the look-ahead one, or plain steps."""

    def __init__(
        self, kind: str, model: DistributedModelParallel, optimizers: list[KeyedOptimizer]
    ) -> None:
        self.model, self.optimizer = model, CombinedOptimizer(list(optimizers))
        self.pipeline: Any = None
        if kind == "sparse_dist":
            self.pipeline = TrainPipelineSparseDist(model, self.optimizer, CPU)
        elif kind == "lookahead":
            self.pipeline = LookaheadTrainPipeline(model, self.optimizer, CPU, lookahead=LOOKAHEAD)

    def run(self, batches: Iterator[Batch], steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            if self.pipeline is not None:
                loss = self.pipeline.progress(batches)[0]
            else:
                self.optimizer.zero_grad()
                loss, _ = self.model(next(batches))
                loss.backward()
                self.optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    def close(self) -> None:
        if isinstance(self.pipeline, LookaheadTrainPipeline):
            self.pipeline.close()


def state_of(model: DistributedModelParallel, optimizers: Sequence[KeyedOptimizer]) -> Any:
    return full_state(model, CombinedOptimizer(list(optimizers)))


def global_state(
    model: DistributedModelParallel, optimizers: Sequence[KeyedOptimizer]
) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state as whole tensors, from one rank holding them all."""
    optimizer = CombinedOptimizer(list(optimizers))
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for key, states in optimizer.state_dict()["state"].items():
        flat.update({f"optim.{key}.{name}": value for name, value in states.items()})
    out = {}
    for key, value in flat.items():
        if isinstance(value, ShardedTensor):
            whole = torch.empty(value.size(), dtype=value.dtype)
            for shard in value.local_shards():
                index = tuple(
                    slice(o, o + n)
                    for o, n in zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)
                )
                whole[index] = shard.tensor
            value = whole
        out[key] = value.detach().clone()
    return out


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


# ----------------------------------------------------------------------------- restoring


@pytest.mark.parametrize("kind", ["sparse_dist", "lookahead"])
def test_a_chain_restores_bit_for_bit_and_training_goes_on_alike(tmp_path: Path, kind: str) -> None:
    data = [make_batch(step) for step in range(10)]
    model, optimizers = build(tmp_path / "a")
    ckpt = tmp_path / "ckpt"
    manager = CheckpointManager(ckpt, model, optimizers, CheckpointOptions(full_every=3))
    loop, batches = Loop(kind, model, optimizers), iter(data)
    saved = []
    for step, steps in ((3, 3), (5, 2), (7, 2)):
        loop.run(batches, steps)
        saved.append(manager.save(step, extra={"next_batch": step}))
    expected = state_of(model, optimizers)
    assert [(link.name, link.parent) for link in saved] == [
        ("step_00000003", None),
        ("step_00000005", "step_00000003"),
        ("step_00000007", "step_00000005"),
    ]
    assert json.loads((ckpt / "step_00000005" / "DONE").read_text()) == {
        "step": 5,
        "next_batch": 5,
        "parent": "step_00000003",
    }
    # The increments hold the tiered table's changed rows only.
    assert saved[1].size_bytes() < saved[0].size_bytes()

    fresh, fresh_optimizers = build(tmp_path / "b")
    restorer = CheckpointManager(ckpt, fresh, fresh_optimizers, CheckpointOptions(full_every=3))
    assert restorer.latest() == saved[-1]
    link = restorer.restore()
    assert link == saved[-1] and link.extra == {"next_batch": 7}
    assert differences(expected, state_of(fresh, fresh_optimizers)) == {}

    # Both go on alike: nothing stale in the restored model's cache or optimizer.
    fresh_loop = Loop(kind, fresh, fresh_optimizers)
    try:
        assert loop.run(batches, 3) == fresh_loop.run(iter(data[link.extra["next_batch"] :]), 3)
    finally:
        loop.close()
        fresh_loop.close()
    assert differences(state_of(model, optimizers), state_of(fresh, fresh_optimizers)) == {}
    # The restored link is the one the next save builds on; this one closes the chain.
    assert restorer.save(10).full and manager.save(10).full


def test_without_tiered_tables_every_link_holds_the_tables_whole(tmp_path: Path) -> None:
    model, optimizers = build(tmp_path / "a", tiered=False)
    manager = CheckpointManager(tmp_path / "ckpt", model, optimizers)
    loop, batches = Loop("plain", model, optimizers), iter([make_batch(s) for s in range(4)])
    loop.run(batches, 2)
    manager.save(2)
    loop.run(batches, 2)
    assert manager.save(4).parent == "step_00000002"
    fresh, fresh_optimizers = build(tmp_path / "b", tiered=False)
    CheckpointManager(tmp_path / "ckpt", fresh, fresh_optimizers).restore()
    assert differences(state_of(model, optimizers), state_of(fresh, fresh_optimizers)) == {}


def test_retention_keeps_what_the_kept_links_build_on(tmp_path: Path) -> None:
    model, optimizers = build(tmp_path / "a")
    options = CheckpointOptions(full_every=3, keep=2)
    manager = CheckpointManager(tmp_path / "ckpt", model, optimizers, options)
    loop, batches = Loop("plain", model, optimizers), iter([make_batch(s) for s in range(7)])
    kept = []
    for step in range(1, 8):
        loop.run(batches, 1)
        manager.save(step)
        kept.append(names(tmp_path / "ckpt"))
    # 1 full, 2 and 3 on it; 4 full, 5 and 6 on it; 7 full. The newest two stay, with the
    # links they build on.
    assert kept[2] == ["step_00000001", "step_00000002", "step_00000003"]
    assert kept[3] == ["step_00000001", "step_00000002", "step_00000003", "step_00000004"]
    assert kept[4] == ["step_00000004", "step_00000005"]
    assert kept[6] == ["step_00000004", "step_00000005", "step_00000006", "step_00000007"]


def test_a_missing_link_is_refused_by_name_and_fallen_back_past(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt = tmp_path / "ckpt"
    model, optimizers = build(tmp_path / "a")
    manager = CheckpointManager(ckpt, model, optimizers, CheckpointOptions(keep=None))
    loop, batches = Loop("plain", model, optimizers), iter([make_batch(s) for s in range(3)])
    loop.run(batches, 1)
    links = [manager.save(1)]
    at_first = state_of(model, optimizers)
    for step in (2, 3):
        loop.run(batches, 1)
        links.append(manager.save(step))
    shutil.rmtree(ckpt / "step_00000002")

    fresh, fresh_optimizers = build(tmp_path / "b")
    restorer = CheckpointManager(ckpt, fresh, fresh_optimizers)
    with pytest.raises(
        ChainError,
        match=r"step_00000003 holds the rows changed since .*step_00000002, which is missing",
    ) as info:
        restorer.restore(links[2])
    assert info.value.missing == ckpt / "step_00000002"
    assert restorer.latest() == links[0]
    with caplog.at_level(logging.WARNING, logger="torchrec_mtrains.checkpoint"):
        assert restorer.restore() == links[0]
    assert f"checkpoint {ckpt / 'step_00000003'} is damaged" in caplog.text
    assert names(ckpt) == ["damaged_step_00000003", "step_00000001"]  # set aside, kept
    assert differences(at_first, state_of(fresh, fresh_optimizers)) == {}


def test_a_save_refuses_bad_extra_and_a_step_behind_the_chain(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    model, optimizers = build(tmp_path / "a")
    manager = CheckpointManager(ckpt, model, optimizers)
    with pytest.raises(ValueError, match="extra: parent, step are the chain's own"):
        manager.save(1, extra={"step": 1, "parent": "x"})
    with pytest.raises(ValueError, match="extra: its values must be JSON"):
        manager.save(1, extra={"rng": torch.zeros(1)})
    with pytest.raises(ValueError, match="step=-1"):
        manager.save(-1)
    assert not ckpt.exists()  # nothing written
    manager.save(5)
    with pytest.raises(CheckpointError, match=r"step_00000003 would be older than .*step_00000005"):
        manager.save(3)
    assert names(ckpt) == ["step_00000005"]


# -------------------------------------------------------------------- killed mid-save


def _save_and_die(root: str, port: int) -> None:
    """Saves links 1 (full) and 2 (incremental), records the state at 2, then is killed by
    SIGKILL while dcp writes link 3."""
    torch.set_num_threads(1)
    with process_group(backend="gloo", rank=0, world_size=1, port=port):
        model, optimizers = build(Path(root) / "tiers")
        manager = CheckpointManager(Path(root) / "ckpt", model, optimizers)
        loop, batches = (
            Loop("lookahead", model, optimizers),
            iter([make_batch(s) for s in range(12)]),
        )
        for step in (1, 2):
            loop.run(batches, 4)
            manager.save(step)
        torch.save(global_state(model, optimizers), Path(root) / "at_2.pt")
        loop.run(batches, 2)
        create_stream = PrivateFileSystem.create_stream
        written: list[str] = []

        @contextlib.contextmanager
        def killed(self: Any, path: Any, mode: str) -> Generator[Any, None, None]:
            with create_stream(self, path, mode) as stream:
                if "w" in mode and "step_00000003" in str(path):
                    written.append(str(path))
                    if len(written) == 2:  # one file written, dcp midway
                        os.kill(os.getpid(), signal.SIGKILL)
                yield stream

        PrivateFileSystem.create_stream = killed  # type: ignore[method-assign]
        manager.save(3)


@pytest.mark.slow
def test_a_save_killed_midway_leaves_the_newest_complete_link(tmp_path: Path) -> None:
    child = multiprocessing.get_context("spawn").Process(
        target=_save_and_die, args=(str(tmp_path), free_port())
    )
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    ckpt = tmp_path / "ckpt"
    assert names(ckpt) == ["step_00000001", "step_00000002", "step_00000003"]
    assert not (ckpt / "step_00000003" / "DONE").exists()

    model, optimizers = build(tmp_path / "b")
    manager = CheckpointManager(ckpt, model, optimizers)
    link = manager.restore()
    assert link is not None and link.name == "step_00000002" and link.parent == "step_00000001"
    assert names(ckpt) == ["step_00000001", "step_00000002"]  # the unfinished one is gone
    expected = torch.load(tmp_path / "at_2.pt")
    restored = global_state(model, optimizers)
    assert expected.keys() == restored.keys()
    assert [k for k in expected if not torch.equal(expected[k], restored[k])] == []


# ------------------------------------------------------------------ another world size


def _restore_at_two(rank: int, port: int, root: str) -> None:
    torch.set_num_threads(1)
    with process_group(backend="gloo", rank=rank, world_size=2, port=port):
        model, optimizers = build(Path(root) / f"tiers{rank}", world_size=2)
        manager = CheckpointManager(Path(root) / "ckpt", model, optimizers)
        link = manager.restore()
        assert link is not None and link.name == "step_00000004", link
        expected = torch.load(Path(root) / "expected.pt")
        restored = 0
        for key, value in {
            **{f"model.{k}": v for k, v in model.state_dict().items()},
            **{
                f"optim.{key}.{name}": v
                for key, states in CombinedOptimizer(optimizers).state_dict()["state"].items()
                for name, v in states.items()
            },
        }.items():
            shards = (
                [
                    (s.metadata.shard_offsets, s.metadata.shard_sizes, s.tensor)
                    for s in value.local_shards()
                ]
                if isinstance(value, ShardedTensor)
                else [([0] * value.dim(), list(value.shape), value)]
            )
            for offsets, sizes, tensor in shards:
                index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
                assert torch.equal(expected[key][index], tensor), (rank, key, offsets)
                restored += 1
        assert restored > 0
        # The chain goes on at two ranks, on the link it restored.
        Loop("plain", model, optimizers).run(iter([make_batch(5, rank)]), 1)
        assert manager.save(5).parent == "step_00000004"


@pytest.mark.slow
def test_a_chain_saved_at_one_rank_loads_at_two(tmp_path: Path) -> None:
    model, optimizers = build(tmp_path / "a")
    manager = CheckpointManager(tmp_path / "ckpt", model, optimizers)
    loop, batches = Loop("plain", model, optimizers), iter([make_batch(s) for s in range(6)])
    for step in (2, 4):
        loop.run(batches, 3)
        manager.save(step)
    torch.save(global_state(model, optimizers), tmp_path / "expected.pt")
    mp.spawn(_restore_at_two, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
