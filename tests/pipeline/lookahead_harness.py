"""A small DLRM with tiered tables, trained with and without the look-ahead pipeline.

Three tables: ``big`` on a tier behind a cache a few batches large (misses and evictions every
step), ``mid`` on another tier, ``small`` on TorchRec's FUSED kernel. The dense part trains with
a dense optimizer, so a pipelined run must match the plain loop in every weight and every
optimizer state. Used in process at world size 1 and in spawned gloo ranks at world size 2.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import CountBasedEvictionPolicy, EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.torchrec_releases import row_wise_plan
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.pipeline import LookaheadTrainPipeline, tiered_groups
from torchrec_mtrains.tiers._blockio import PassReader

BATCH = 16
DENSE = 4
DIM = 8
LR = 0.05
MAX_POOL = 2  # ids per sample and feature: 1 .. MAX_POOL
# name -> rows; "big" and "mid" are tiered, "small" stays on FUSED.
ROWS = {"big": 1200, "mid": 300, "small": 50}
FEATURES = ("f_big", "f_mid", "f_small")
IO_THREAD = "mtrains-tier-io"
VIRTUAL_LIVE_ROWS = 700


@dataclass(frozen=True)
class Case:
    """One configuration: tiers of the two tiered tables, look-ahead depth, dense optimizer
    (``keyed``: CombinedOptimizer of the fused optimizer and a KeyedOptimizerWrapper'd Adagrad;
    ``torch``: a plain torch SGD with momentum over the dense parameters) and sharding of
    ``big`` (``tw`` or ``rw``)."""

    big_tier: str = "block_scm"
    mid_tier: str = "byte_scm"
    depth: int = 2
    optimizer: str = "keyed"
    sharding: str = "tw"
    steps: int = 16
    seed: int = 0
    # "big" as a virtual table (ids from a 2**40 space, rows made on first use, count eviction
    # holding VIRTUAL_LIVE_ROWS)
    virtual: bool = False

    @property
    def id(self) -> str:
        return (
            f"{self.big_tier}-{self.mid_tier}-k{self.depth}-{self.optimizer}-{self.sharding}"
            f"-s{self.seed}" + ("-virtual" if self.virtual else "")
        )


# ------------------------------------------------------------------------------- data


def make_batch(seed: int, rank: int, step: int) -> Batch:
    """Rank ``rank``'s batch ``step``: ids skewed toward low rows (so batches share rows and
    the small caches both hit and evict)."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + step)
    lengths, values = [], []
    for feature in FEATURES:
        rows = ROWS[feature[2:]]
        n = torch.randint(1, MAX_POOL + 1, (BATCH,), generator=g)
        u = torch.rand(int(n.sum()), generator=g)
        lengths.append(n)
        values.append((u * u * u * rows).long().clamp_(max=rows - 1))
    return Batch(
        dense_features=torch.randn(BATCH, DENSE, generator=g),
        sparse_features=KeyedJaggedTensor(
            keys=list(FEATURES), values=torch.cat(values), lengths=torch.cat(lengths)
        ),
        labels=(torch.rand(BATCH, generator=g) < 0.3).float(),
    )


def batches(case: Case, rank: int, count: int | None = None) -> list[Batch]:
    return [make_batch(case.seed, rank, s) for s in range(case.steps if count is None else count)]


# ------------------------------------------------------------------------------ models


def cache_rows_needed(case: Case, world_size: int) -> int:
    """Rows a cache must hold: ``depth + 1`` batches of every rank (row-wise shards and
    table-wise tables see every rank's ids), plus one batch of slack."""
    per_batch = BATCH * MAX_POOL * world_size
    return per_batch * (case.depth + 2)


def build(
    case: Case, root: Path, world_size: int = 1, device: torch.device | None = None
) -> DistributedModelParallel:
    """The case's DLRM on DMP (on ``device``, CPU by default), its tiered table files under
    ``root``; the same initial weights for the same case whatever ``root``."""
    device = device or torch.device("cpu")
    storage = TierStorage(root=str(root))
    sharder = TieredEmbeddingBagCollectionSharder(
        storage, fused_params={"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LR}
    )
    tables = [
        EmbeddingBagConfig(
            name=name, embedding_dim=DIM, num_embeddings=rows, feature_names=[f"f_{name}"]
        )
        for name, rows in ROWS.items()
    ]
    if case.virtual:
        tables[0] = EmbeddingBagConfig(
            name="big",
            embedding_dim=DIM,
            num_embeddings=2**40,
            feature_names=["f_big"],
            use_virtual_table=True,
            total_num_buckets=2,
            virtual_table_eviction_policy=CountBasedEvictionPolicy(
                training_id_eviction_trigger_count=VIRTUAL_LIVE_ROWS // 2 // world_size,
                eviction_threshold=1,
                decay_rate=0.5,
            ),
        )
    last = world_size - 1
    gens = {
        "big": row_wise_plan(TIERED_KERNEL, 2 if case.virtual else None)
        if case.sharding == "rw"
        else table_wise(rank=last, compute_kernel=TIERED_KERNEL),
        "mid": table_wise(rank=last, compute_kernel=TIERED_KERNEL),
        "small": table_wise(rank=0, compute_kernel="fused"),
    }
    meta = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        meta,
        gens,
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type=device.type,
    )
    need = cache_rows_needed(case, world_size)
    for name, tier in (("big", case.big_tier), ("mid", case.mid_tier)):
        row_wise_shard = name == "big" and case.sharding == "rw"
        virtual = name == "big" and case.virtual
        rows = VIRTUAL_LIVE_ROWS if virtual else ROWS[name]
        shard_rows = math.ceil(rows / world_size) if row_wise_shard else rows
        factor = min(1.0, need / shard_rows)
        plan[name] = TieredParameterSharding.wrap(
            plan[name],
            TieredTableOptions(
                tier=tier,
                cache_load_factor=factor,
                max_live_rows=VIRTUAL_LIVE_ROWS if virtual else None,
            ),
        )
    torch.manual_seed(1234 + case.seed)
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(
                tables=tables, device=torch.device("meta")
            ),
            dense_in_features=DENSE,
            dense_arch_layer_sizes=[16, DIM],
            over_arch_layer_sizes=[16, 1],
            dense_device=device,
        )
    )
    built = DistributedModelParallel(
        model,
        device=device,
        plan=ShardingPlan({"model.sparse_arch.embedding_bag_collection": plan}),
        sharders=[sharder],
    )
    for group in groups_of(built):  # a virtual table's statistics: the same in every run
        for shard in group.shards:
            if shard.virtual is not None:
                shard.virtual.eviction.clock = lambda: 0.0
    return built


def make_optimizer(case: Case, model: DistributedModelParallel) -> torch.optim.Optimizer:
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    if case.optimizer == "keyed":
        return CombinedOptimizer(
            [
                model.fused_optimizer,
                KeyedOptimizerWrapper(dense, lambda params: torch.optim.Adagrad(params, lr=LR)),
            ]
        )
    if case.optimizer == "torch":
        return torch.optim.SGD(list(dense.values()), lr=LR, momentum=0.9)
    raise ValueError(f"unknown optimizer {case.optimizer!r}")


# ----------------------------------------------------------------------------- training


def train_plain(
    model: DistributedModelParallel, optimizer: torch.optim.Optimizer, data: Sequence[Batch]
) -> list[float]:
    """The reference loop: no pipeline, each batch's rows read when its forward needs them."""
    losses = []
    for batch in data:
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def train_pipelined(
    model: DistributedModelParallel,
    optimizer: torch.optim.Optimizer,
    data: Sequence[Batch] | Iterator[Batch],
    depth: int,
    on_step: Callable[[LookaheadTrainPipeline[Batch, Any]], None] | None = None,
    device: torch.device | None = None,
) -> tuple[list[float], LookaheadTrainPipeline[Batch, Any]]:
    """Runs the pipeline until the data ends; returns the losses and the (closed) pipeline.
    Batches stay where they are: the pipeline copies them to ``device`` (CPU by default)."""
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        model, optimizer, device or torch.device("cpu"), lookahead=depth
    )
    it = iter(data)
    losses = []
    while True:
        try:
            loss, _, _ = pipeline.progress(it)
        except StopIteration:
            break
        losses.append(float(loss))
        if on_step is not None:
            on_step(pipeline)
    return losses, pipeline


# ---------------------------------------------------------------------------- comparing


def _local(value: Any) -> list[torch.Tensor]:
    if isinstance(value, ShardedTensor):
        return [s.tensor for s in value.local_shards()]
    if isinstance(value, torch.Tensor):
        return [value]
    return []


def full_state(
    model: DistributedModelParallel, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Every local weight and optimizer state, flattened and copied (fused optimizer state
    first: reading it must include updates still in the caches)."""
    out: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            for i, t in enumerate(_local(value)):
                out[f"{prefix}#{i}"] = t.detach().clone()

    walk("fused", model.fused_optimizer.state_dict()["state"])
    walk("optim", optimizer.state_dict()["state"])
    walk("model", model.state_dict())
    return out


def differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """Keys whose tensors are not bitwise equal, with their largest difference."""
    if set(a) != set(b):
        raise AssertionError(f"keys differ: {sorted(set(a) ^ set(b))}")
    return {
        k: float((a[k].float() - b[k].float()).abs().max()) if a[k].numel() else 0.0
        for k in a
        if not torch.equal(a[k], b[k])
    }


def io_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(IO_THREAD)]


def groups_of(model: DistributedModelParallel) -> list[TieredTableGroup]:
    return tiered_groups(model)


# ------------------------------------------------------------------- spawned ranks


@dataclass
class RankResult:
    case: Case
    rank: int
    diffs: dict[str, float]
    keys: int
    changed: int
    prefetched: int
    unprefetched: int
    rows_fetched: int
    stall_seconds: float
    io_threads: list[str]
    losses_equal: bool
    error: str | None = None


def run_case(case: Case, rank: int, world_size: int, root: Path) -> RankResult:
    """Trains the case plain and pipelined from the same start; compares every local state."""
    data = batches(case, rank)
    plain = build(case, root / "plain", world_size)
    plain_opt = make_optimizer(case, plain)
    start = full_state(plain, plain_opt)
    plain_losses = train_plain(plain, plain_opt, data)
    ahead = build(case, root / "ahead", world_size)
    ahead_opt = make_optimizer(case, ahead)
    ahead_losses, pipeline = train_pipelined(ahead, ahead_opt, data, case.depth)
    a, b = full_state(plain, plain_opt), full_state(ahead, ahead_opt)
    counters = [g.io_counters() for g in groups_of(ahead)]
    return RankResult(
        case=case,
        rank=rank,
        diffs=differences(a, b),
        keys=len(a),
        changed=sum(
            1 for k in a if k in start and k.startswith("model") and not torch.equal(start[k], a[k])
        ),
        prefetched=sum(c.prefetched_batches for c in counters),
        unprefetched=sum(c.unprefetched_batches for c in counters),
        rows_fetched=pipeline.totals.rows_fetched,
        stall_seconds=pipeline.totals.stall_seconds,
        io_threads=io_threads(),
        losses_equal=plain_losses == ahead_losses,
    )


def _rank_main(
    rank: int, world_size: int, port: int, cases: Sequence[Case], root: str, out: str
) -> None:
    torch.set_num_threads(1)
    with process_group(
        backend="gloo", rank=rank, world_size=world_size, port=port, timeout=timedelta(seconds=120)
    ):
        results: list[dict[str, Any]] = []
        try:
            for i, case in enumerate(cases):
                try:
                    results.append(asdict(run_case(case, rank, world_size, Path(root) / f"c{i}")))
                except Exception:
                    # Ranks run the same cases in order; after a failure they may be out of step.
                    failed = RankResult(case, rank, {}, 0, 0, 0, 0, 0, 0.0, [], False)
                    failed.error = traceback.format_exc()
                    results.append(asdict(failed))
                    break
        finally:
            torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def spawn_cases(cases: Sequence[Case], world_size: int, root: Path) -> list[list[dict[str, Any]]]:
    """Runs ``cases`` in one job of ``world_size`` spawned gloo ranks; per rank, the results."""
    out = tempfile.mkdtemp(dir=root)
    mp.spawn(
        _rank_main,
        args=(world_size, free_port(), list(cases), str(root), out),
        nprocs=world_size,
        join=True,
    )
    return [
        torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)
    ]


def on_worker_reads(
    store: Any,
    before: Callable[[Any], None],
    after: Callable[[Any, Any], None] | None = None,
) -> None:
    """Calls ``before(ids)`` as the tier worker starts reading rows ``ids`` of ``store`` and
    ``after(ids, rows)`` once they are read, at the seam the worker reads that store through:
    a block store's passes (``read_passes``, which the worker issues with other tables'), else
    ``read_rows`` and ``read_rows_into`` (rows in host memory straight into host slots).
    :func:`restore_reads` undoes it."""
    if isinstance(store, PassReader):
        real_passes = store.read_passes

        def read_passes(ids: Any, out: Any) -> Any:
            before(ids)
            result = yield from real_passes(ids, out)
            if after is not None:
                after(ids, out)
            return result

        store.read_passes = read_passes  # type: ignore[method-assign]
        return
    real_rows = store.read_rows

    def read_rows(ids: Any) -> Any:
        before(ids)
        rows = real_rows(ids)
        if after is not None:
            after(ids, rows)
        return rows

    store.read_rows = read_rows
    real_into = store.read_rows_into

    def read_rows_into(ids: Any, columns: Any, at: Any) -> None:
        before(ids)
        real_into(ids, columns, at)
        if after is not None:
            after(ids, np.concatenate([c[at] for c in columns], axis=1))

    store.read_rows_into = read_rows_into


def restore_reads(store: Any) -> None:
    """Undoes :func:`on_worker_reads`: the store's own methods read again."""
    for name in ("read_passes", "read_rows", "read_rows_into"):
        store.__dict__.pop(name, None)
