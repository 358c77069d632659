"""Checkpointing tiered tables: state_dict round trips and torch.distributed.checkpoint, exact
for weights and optimizer state on every tier, with memory bounded by chunks, not tables."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    table_wise,
)
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
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.tiers import TIERS

TIER_NAMES = sorted(TIERS)
FUSED = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """Every test here runs on one rank (the two-rank test spawns its own)."""


def _tables(rows: int = 300, dim: int = 8) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="big", embedding_dim=dim, num_embeddings=rows, feature_names=["f0"]
        ),
        EmbeddingBagConfig(name="small", embedding_dim=4, num_embeddings=40, feature_names=["f1"]),
    ]


def build(
    root: Path,
    tier: str,
    *,
    world_size: int = 1,
    tables: list[EmbeddingBagConfig] | None = None,
    chunk_rows: int = 64,
    big_plan: str = "tw",
    optimizer: OptimType = OptimType.EXACT_ROWWISE_ADAGRAD,
    hot_rows: dict[str, list[int]] | None = None,
    open_mode: str = "create",
) -> DistributedModelParallel:
    tables = tables or _tables()
    storage = tier_storage(tier, root, checkpoint_chunk_rows=chunk_rows, open_mode=open_mode)
    sharder = TieredEmbeddingBagCollectionSharder(
        storage, fused_params={"optimizer": optimizer, "learning_rate": 0.05}, hot_rows=hot_rows
    )
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    big = (
        column_wise(ranks=list(range(world_size)), compute_kernel=TIERED_KERNEL)
        if big_plan == "cw"
        else table_wise(rank=0, compute_kernel=TIERED_KERNEL)
    )
    plan = construct_module_sharding_plan(
        ebc,
        {"big": big, "small": table_wise(rank=world_size - 1, compute_kernel="fused")},
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    plan["big"] = TieredParameterSharding.wrap(
        plan["big"], TieredTableOptions(tier=TIERS[tier].serves_tier, cache_load_factor=0.5)
    )
    return DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def train(model: DistributedModelParallel, steps: int, seed: int, rows: int = 300) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        lengths = torch.randint(1, 3, (2 * 8,), generator=g)
        n0 = int(lengths[:8].sum())
        n1 = int(lengths[8:].sum())
        values = torch.cat(
            [torch.randint(0, rows, (n0,), generator=g), torch.randint(0, 40, (n1,), generator=g)]
        )
        kjt = KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths)
        out = model(kjt)
        out = out.wait() if hasattr(out, "wait") else out
        (out.values() * torch.linspace(-1, 1, out.values().shape[1])).sum().backward()


def snapshot(value: Any) -> Any:
    """A materialized copy (this rank's shards) for comparisons."""
    if isinstance(value, ShardedTensor):
        return {
            tuple(s.metadata.shard_offsets): s.tensor.detach().clone() for s in value.local_shards()
        }
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


def full_weights(model: DistributedModelParallel) -> dict[str, dict[str, torch.Tensor]]:
    """Weights and optimizer state per key, stitched into whole local tensors by offset."""
    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        out[key] = _stitch(value)
    for key, state in model.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out[f"{key}/{name}"] = _stitch(value)
    return out


def _stitch(value: Any) -> torch.Tensor:
    if not isinstance(value, ShardedTensor):
        return value.detach().clone()
    full = torch.zeros(value.size(), dtype=value.dtype)
    for s in value.local_shards():
        index = tuple(
            slice(o, o + n) for o, n in zip(s.metadata.shard_offsets, s.metadata.shard_sizes)
        )
        full[index] = s.tensor
    return full


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key}: max diff {(a[key] - b[key]).abs().max()}"


def test_a_log_tables_copy_is_exported_when_read_not_when_built(tmp_path: Path) -> None:
    """Building the kernel re-wraps the optimizer's state tensors, which reads nothing: it must
    not export the log (a whole-table read); a state dict does, once per change."""
    model = build(tmp_path, "log_block_scm")
    (group,) = list(model.module.tiered_groups())
    (shard,) = group.shards
    assert shard.store.file_layout == "log"
    assert shard.store.stats.bytes_read == 0
    train(model, 2, seed=1)
    before = shard.store.stats.bytes_read
    first = full_weights(model)
    exported = shard.store.stats.bytes_read
    assert exported > before
    assert_same(full_weights(model), first)  # unchanged since: no second export
    assert shard.store.stats.bytes_read == exported


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_state_dict_round_trip(tmp_path: Path, tier: str) -> None:
    src = build(tmp_path / "a", tier)
    train(src, 6, seed=1)
    dst = build(tmp_path / "b", tier)
    train(dst, 2, seed=2)  # different values and a warm cache, to be overwritten
    dst.load_state_dict(src.state_dict())
    dst.fused_optimizer.load_state_dict(src.fused_optimizer.state_dict())
    assert_same(full_weights(src), full_weights(dst))
    # Both continue identically: nothing stale survives in the destination's cache.
    train(src, 4, seed=3)
    train(dst, 4, seed=3)
    assert_same(full_weights(src), full_weights(dst))


@pytest.mark.parametrize("tier", TIER_NAMES)
@pytest.mark.parametrize(
    "optimizer", [OptimType.EXACT_SGD, OptimType.EXACT_ADAGRAD, OptimType.EXACT_ROWWISE_ADAGRAD]
)
def test_dcp_round_trip(tmp_path: Path, tier: str, optimizer: OptimType) -> None:
    src = build(tmp_path / "a", tier, optimizer=optimizer)
    train(src, 6, seed=1)
    dcp.save(
        {"model": src.state_dict(), "optim": src.fused_optimizer.state_dict()},
        checkpoint_id=tmp_path / "ckpt",
    )
    expected = full_weights(src)

    dst = build(tmp_path / "b", tier, optimizer=optimizer)
    train(dst, 2, seed=2)
    state = {"model": dst.state_dict(), "optim": dst.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    dst.load_state_dict(state["model"])
    dst.fused_optimizer.load_state_dict(state["optim"])
    assert_same(expected, full_weights(dst))
    train(src, 3, seed=3)
    train(dst, 3, seed=3)
    assert_same(full_weights(src), full_weights(dst))


def test_tiered_state_is_chunked(tmp_path: Path) -> None:
    model = build(tmp_path, "byte_scm", chunk_rows=64)
    weight = model.state_dict()["embedding_bags.big.weight"]
    assert isinstance(weight, ShardedTensor)
    sizes = [s.metadata.shard_sizes[0] for s in weight.local_shards()]
    assert sizes == [64, 64, 64, 64, 44]
    momentum = model.fused_optimizer.state_dict()["state"]["embedding_bags.big.weight"]
    assert all(s.metadata.shard_sizes[0] <= 64 for s in momentum["big.momentum1"].local_shards())


class _PeakAnon:
    """Samples this process's anonymous resident memory (heap and torch tensors, not the
    page cache of mapped tier files) in a background thread and keeps the peak."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("RssAnon not in /proc/self/status")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(0.0005)

    def __enter__(self) -> _PeakAnon:
        self.base = self.read()
        self.peak = self.base
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def _dcp_round_trip(
    src: DistributedModelParallel, dst: DistributedModelParallel, path: Path
) -> tuple[_PeakAnon, _PeakAnon]:
    """Saves ``src`` with DCP and loads it into ``dst``; returns the memory each side took."""
    state = {"model": src.state_dict(), "optim": src.fused_optimizer.state_dict()}
    with _PeakAnon() as save_mem:
        dcp.save(state, checkpoint_id=path)
    del state
    state = {"model": dst.state_dict(), "optim": dst.fused_optimizer.state_dict()}
    with _PeakAnon() as load_mem:
        dcp.load(state, checkpoint_id=path)
        dst.load_state_dict(state["model"])
        dst.fused_optimizer.load_state_dict(state["optim"])
    return save_mem, load_mem


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc RssAnon")
def test_checkpoint_memory_is_bounded_by_chunks(tmp_path: Path) -> None:
    # The table is large enough that a bound in chunks (with room for dcp's and the
    # allocator's own, which vary from run to run: 4-7.5 chunks measured) stays far below it.
    rows, dim, chunk = 600_000, 64, 8_192
    tables = _tables(rows=rows, dim=dim)
    table_bytes = rows * (dim + 1) * 4  # 156 MB of weights + row-wise state
    chunk_bytes = chunk * (dim + 1) * 4  # 2.1 MB
    model = build(tmp_path / "a", "block_scm", tables=tables, chunk_rows=chunk)
    train(model, 3, seed=1, rows=rows)
    other = build(tmp_path / "b", "block_scm", tables=tables, chunk_rows=chunk)
    save_mem, load_mem = _dcp_round_trip(model, other, tmp_path / "ckpt")
    bound = 10 * chunk_bytes
    print(
        f"checkpoint peak extra anon memory: save {save_mem.extra / 2**20:.1f} MB, "
        f"load {load_mem.extra / 2**20:.1f} MB; chunk {chunk_bytes / 2**20:.1f} MB, "
        f"table {table_bytes / 2**20:.1f} MB"
    )
    assert save_mem.extra < bound < table_bytes / 4, (save_mem.extra, bound, table_bytes)
    assert load_mem.extra < bound, (load_mem.extra, bound, table_bytes)
    assert_same(full_weights(model), full_weights(other))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc RssAnon")
def test_dram_tables_beside_tiered_ones_checkpoint_in_chunks(tmp_path: Path) -> None:
    # TorchRec's own (DRAM) table in a tiered module: its weight views the kernel's flat buffer,
    # which a checkpoint writer would clone whole; in row chunks it copies a chunk at a time.
    # (A save's peak varies from run to run, 2.5-7 chunks measured alone, more in a process
    # that ran other tests: the table is large enough for a bound of 10 to sit far below it.)
    rows, dim, chunk = 400_000, 64, 8_192
    tables = [
        EmbeddingBagConfig(name="big", embedding_dim=8, num_embeddings=300, feature_names=["f0"]),
        EmbeddingBagConfig(
            name="small", embedding_dim=dim, num_embeddings=rows, feature_names=["f1"]
        ),
    ]
    table_bytes = rows * dim * 4  # 102 MB
    chunk_bytes = chunk * dim * 4
    model = build(tmp_path / "a", "block_scm", tables=tables, chunk_rows=chunk)
    weight = model.state_dict()["embedding_bags.small.weight"]
    assert isinstance(weight, ShardedTensor)
    assert max(s.metadata.shard_sizes[0] for s in weight.local_shards()) == chunk
    train(model, 3, seed=1)
    other = build(tmp_path / "b", "block_scm", tables=tables, chunk_rows=chunk)
    save_mem, load_mem = _dcp_round_trip(model, other, tmp_path / "ckpt")
    bound = 10 * chunk_bytes
    assert save_mem.extra < bound < table_bytes / 4, (save_mem.extra, bound, table_bytes)
    assert load_mem.extra < bound, (load_mem.extra, bound, table_bytes)
    assert_same(full_weights(model), full_weights(other))
    # A plain state_dict copy between two such models still loads (chunk by chunk).
    third = build(tmp_path / "c", "block_scm", tables=tables, chunk_rows=chunk)
    third.load_state_dict(model.state_dict())
    third.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())
    assert_same(full_weights(model), full_weights(third))


def _ws2_worker(rank: int, port: int, root: str) -> None:
    with process_group(backend="gloo", rank=rank, world_size=2, port=port):
        for tier in TIER_NAMES:
            for big_plan in ("tw", "cw"):
                _ws2_case(Path(root) / f"{tier}-{big_plan}", tier, big_plan, rank)


def _ws2_case(base: Path, tier: str, big_plan: str, rank: int) -> None:
    src = build(base / "a", tier, world_size=2, big_plan=big_plan)
    train(src, 5, seed=10 + rank)
    dcp.save(
        {"model": src.state_dict(), "optim": src.fused_optimizer.state_dict()},
        checkpoint_id=base / "ckpt",
    )
    dst = build(base / "b", tier, world_size=2, big_plan=big_plan)
    train(dst, 2, seed=20 + rank)
    state = {"model": dst.state_dict(), "optim": dst.fused_optimizer.state_dict()}
    dcp.load(state, checkpoint_id=base / "ckpt")
    dst.load_state_dict(state["model"])
    dst.fused_optimizer.load_state_dict(state["optim"])
    assert_same(full_weights(src), full_weights(dst))
    # state_dict / load_state_dict between same-sharded models, then identical training
    third = build(base / "c", tier, world_size=2, big_plan=big_plan)
    third.load_state_dict(src.state_dict())
    third.fused_optimizer.load_state_dict(src.fused_optimizer.state_dict())
    train(src, 3, seed=30 + rank)
    train(third, 3, seed=30 + rank)
    assert_same(full_weights(src), full_weights(third))


@pytest.mark.slow
def test_world_size_two(tmp_path: Path) -> None:
    """DCP and state_dict round trips at world size 2, table-wise and column-wise, all tiers."""
    mp.spawn(_ws2_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
