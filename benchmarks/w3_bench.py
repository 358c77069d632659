"""W3: raw 64-bit ids: virtual tables on a tier (ours) against hashing into FUSED tables (A').

Workload W3: two one-hot sparse features (a "user" and an "item" id per sample), each drawn
Zipf(``--zipf``) over ``--vocab`` distinct raw ids spread over a 2**40 id space, dim
``--dim``, row-wise Adagrad (fused), and a small dense part (the two pooled embeddings -> 16 ->
1). The label of a sample is drawn from ``sigmoid(a(user) + b(item))``, with ``a`` and ``b``
fixed functions of the raw ids, so an id that shares its row with another (a collision) costs
quality.

Variants, in this process, from the same dense initial weights:

* ``A'``: what users do today: each feature's ids hashed (``id % --hash-rows``) into a table on
  TorchRec's FUSED kernel that fits the DRAM budget;
* ``ours``: each feature a virtual table (``use_virtual_table=True``, ``num_embeddings`` 2**40)
  on ``--tier`` with ``max_live_rows = --live-rows``, its rows made on first use and evicted by
  TorchRec's ``FeatureScoreBasedEvictionPolicy`` with auto collection (``--eviction score``,
  the default: every value scores 1; a round once the table holds more than 95% of the bound
  decays the scores by ``--decay-rate``, 0.99, and keeps the ``--keep-share`` (0.75) of the
  bound scored highest: eval NE 0.8108 against 0.8205 with the count rule below and 0.8170
  for A'' at 10**9 ids, docs/benchmarks.md), or ``CountBasedEvictionPolicy`` (``--eviction
  count``: a round once the table holds more than 90% of the bound, or when a batch does not
  fit, evicting ids whose count decayed by ``--decay-rate``, 0.9, falls below
  ``--eviction-threshold``, 1), trained by the look-ahead pipeline (the next ``--lookahead``
  batches' rows made and read while one trains; 0: the plain loop).
* ``A'p``: A' trained by TorchRec's own ``TrainPipelineSparseDist`` (the pipeline TorchRec's
  users train with; ours' look-ahead pipeline is built on it) instead of the plain loop: the
  same model, the same losses (checked step by step, the benchmark stops otherwise), so that
  ``ours / A'p`` sets ours' tiers and virtual tables against a FUSED table trained the way
  ours is, and ``A'p / A'`` shows what TorchRec's pipeline machinery alone costs a step;
* ``A''``: the open-source route to raw ids until now: TorchRec's managed-collision modules
  (``ManagedCollisionEmbeddingBagCollection``, an ``MCHManagedCollisionModule`` per feature with
  its ``DistanceLFU_EvictionPolicy``) remap each feature's raw ids into a table of
  ``--live-rows`` slots, sharded by TorchRec's managed-collision sharder over ours, the table on
  ``--tier`` behind the same cache as ours; the plain loop (the remap happens in the forward, so
  no look-ahead can know a batch's rows before it runs). Its modules evict every
  ``--mc-eviction-interval`` batches (10 by default: at 1, their sort of the whole table every
  batch takes most of its time, 0.03x A' against 0.14x at 10, with about the same eval NE).

Each trains ``--warmup`` untimed then ``--steps`` timed steps on the same batches, the timed
ones in windows of ``--window-steps`` taken in turn (A', A'p, A'', ours, then ours, A'', A'p,
A', ...),
so all meet the same moments of a shared machine; samples/s over all of a variant's windows,
and ours / A' per window. Then each is evaluated on ``--eval-batches`` fresh batches (NE and AUC).
A' needs its warm-up: it runs faster in its first steps (2M samples/s in its first 500 here,
1.2M from step 1,000 on, at 4M ids).
Reported beside them: ours' live rows over the run, rows made and evicted, the bytes of a
full checkpoint of ours (``torch.distributed.checkpoint`` of ``model.state_dict()`` and the
fused optimizer's state) against live rows x (row + id) bytes, and of an incremental link of a
``CheckpointManager`` chain ``--increment-steps`` steps after a full one against the rows it
holds x (row + id) bytes (and 8 bytes per evicted id), the chain restored into a new model
whose state must equal ours'.

Before the timed runs, a check that ours computes what TorchRec's kernel computes: ours and a
FUSED model whose tables hold ``--check-rows`` rows filled by the virtual tables' initializer
train ``--check-steps`` steps on ids below ``--check-rows``: their losses must be equal, bit for
bit (the benchmark stops otherwise). Likewise A'' against the same managed-collision modules
over TorchRec's own sharder (FUSED; fbgemm has no CPU kernel for their row reset, so that side
gets the CUDA kernel's effect from ``torchrec_mtrains.benchmark.references``), in tables of a
quarter of ``--check-rows`` slots, so that their modules evict.

Both variants run with ``THP_MEM_ALLOC_ENABLE=1``, as W1's do (run as a script, the benchmark
starts itself again with it set; ``--no-thp`` runs without): PyTorch then backs large tensors
with transparent huge pages. Without them the speed of A' moved ~2x from run to run and window to
window here (0.64M to 2.3M samples/s), ours' much less.

On ``--device cuda`` (NCCL) every model computes on the GPU: A''s hashed tables in HBM, the
caches of ours and A'' in HBM with their rows on the tier in host memory or files; the checks
then hold the losses within ``1e-6`` relative (the tolerance of the CUDA parity tests), and
every timed window ends with a device synchronize.

Run it::

    python -m benchmarks.w3_bench --out results/w3.json
    python -m benchmarks.w3_bench --device cuda --steps 2000 --warmup 300 --out results/gpu/w3.json
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torchrec.datasets.utils import Batch
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.mc_embeddingbag import ManagedCollisionEmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import (
    CountBasedEvictionPolicy,
    EmbeddingBagConfig,
    FeatureScoreBasedEvictionPolicy,
    VirtualTableEvictionPolicy,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.data import ZipfRankSampler
from torchrec_mtrains.benchmark.measure import (
    add_malloc_option,
    apply_malloc_option,
    synchronize,
    thread_cpu_seconds,
)
from torchrec_mtrains.benchmark.references import reset_rows_on_cpu
from torchrec_mtrains.checkpoint import CheckpointManager, CheckpointOptions
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import process_group, with_index
from torchrec_mtrains.initializers import IdSeededUniform, splitmix64
from torchrec_mtrains.malloc import DEFAULT_TRIM_THRESHOLD
from torchrec_mtrains.pipeline import LookaheadTrainPipeline, tier_stats, tiered_groups
from torchrec_mtrains.planner.perf_model import cache_bytes, slot_map_bytes
from torchrec_mtrains.types import stored_row_bytes

THP_ENV = "THP_MEM_ALLOC_ENABLE"
"""PyTorch backs large tensors with transparent huge pages when this is ``1``, as W1 runs."""
FEATURES = ("user", "item")
VARIANTS = ("A'", "A'p", "A''", "ours")
ID_SPACE = 2**40
LEARNING_RATE = 0.05
CUDA_LOSS_RTOL = 1e-6
"""How far a loss may part from its reference's on CUDA (the CUDA parity tests' tolerance:
fbgemm's CUDA kernels need not sum in one order); on the CPU they must be equal."""


# ---------------------------------------------------------------------------------- data


def _hash(x: np.ndarray[Any, Any], salt: int) -> np.ndarray[Any, Any]:
    return splitmix64(x.astype(np.uint64) ^ np.uint64(salt))


class Stream:
    """Batches of (user, item) raw ids and labels; ``ids_below`` restricts ids (the check)."""

    def __init__(self, args: argparse.Namespace, seed: int, ids_below: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        self.args = args
        self.ids_below = ids_below
        # O(1) memory in the vocabulary: a billion distinct ids cost nothing to draw from.
        self.ranks = ZipfRankSampler(args.vocab, args.zipf)

    def raw_ids(self, n: int, salt: int) -> np.ndarray[Any, Any]:
        ranks = self.ranks.sample(self.rng, n).astype(np.uint64)
        ids = _hash(ranks, salt) & np.uint64(ID_SPACE - 1)
        if self.ids_below:
            ids %= np.uint64(self.ids_below)
        return ids.astype(np.int64)

    def batch(self) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        n = self.args.batch_size
        ids = {f: self.raw_ids(n, salt) for f, salt in zip(FEATURES, (11, 23))}
        logit = _effect(ids["user"], 5) + _effect(ids["item"], 9)
        labels = (self.rng.random(n) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return {f: torch.from_numpy(v) for f, v in ids.items()}, torch.from_numpy(labels)


def _effect(ids: np.ndarray[Any, Any], salt: int) -> np.ndarray[Any, Any]:
    """A fixed effect of each raw id on the label's logit, uniform in [-2, 2]."""
    return (_hash(ids, salt) >> np.uint64(11)).astype(np.float64) / 2**53 * 4 - 2


def kjt(ids: dict[str, torch.Tensor], modulo: int = 0) -> KeyedJaggedTensor:
    values = torch.cat([ids[f] % modulo if modulo else ids[f] for f in FEATURES])
    n = len(ids[FEATURES[0]])
    return KeyedJaggedTensor(
        keys=list(FEATURES), values=values, lengths=torch.ones(2 * n, dtype=torch.int64)
    )


# --------------------------------------------------------------------------------- models


class Model(nn.Module):
    """Embeddings -> 16 -> 1; called with a torchrec ``Batch`` as TorchRec's train pipelines
    call a model: returns the loss, and (loss, logits) as the output a pipeline hands back."""

    def __init__(self, ebc: nn.Module, dim: int) -> None:
        super().__init__()
        self.ebc = ebc
        torch.manual_seed(0)
        self.dense = nn.Sequential(nn.Linear(2 * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        pooled = self.ebc(batch.sparse_features)
        if isinstance(pooled, tuple):  # a managed-collision module's: (pooled, remapped ids)
            pooled = pooled[0]
        by_feature = pooled.to_dict()  # in FEATURES' order whatever the sharded output's
        logits = self.dense(torch.cat([by_feature[f] for f in FEATURES], dim=1)).squeeze(1)
        loss = nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach())


def as_batch(raw: tuple[dict[str, torch.Tensor], torch.Tensor], modulo: int) -> Batch:
    """A batch of the host (the look-ahead pipeline copies it to the device itself)."""
    ids, labels = raw
    return Batch(
        dense_features=torch.zeros(len(labels), 1),
        sparse_features=kjt(ids, modulo),
        labels=labels,
    )


def on_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` copied to ``device`` (itself on the CPU)."""
    return batch if device.type == "cpu" else batch.to(device, non_blocking=True)


def compute_device(args: argparse.Namespace) -> torch.device:
    """``--device``, with its index (``cuda`` is the current GPU)."""
    return with_index(torch.device(args.device))


def _init(name: str, dim: int) -> IdSeededUniform:
    return IdSeededUniform(seed=len(name) * 7919, dim=dim, low=-0.05, high=0.05)


def eviction_policy(args: argparse.Namespace) -> VirtualTableEvictionPolicy:
    """Ours' policy (``--eviction``): see the module doc."""
    if args.eviction == "count":
        return CountBasedEvictionPolicy(
            training_id_eviction_trigger_count=int(0.9 * args.live_rows),
            eviction_threshold=args.eviction_threshold,
            decay_rate=args.decay_rate,
        )
    return FeatureScoreBasedEvictionPolicy(
        training_id_eviction_trigger_count=int(0.95 * args.live_rows),
        training_id_keep_count=int(args.keep_share * args.live_rows),
        decay_rate=args.decay_rate,
        enable_auto_feature_score_collection=True,
        feature_score_default_value=1.0,
    )


def _table_configs(
    args: argparse.Namespace, rows: int, virtual: bool = False
) -> list[EmbeddingBagConfig]:
    """One table of ``rows`` rows per feature; ``virtual``: ours' virtual table, evicted by
    :func:`eviction_policy`."""
    return [
        EmbeddingBagConfig(
            name=f,
            num_embeddings=rows,
            embedding_dim=args.dim,
            feature_names=[f],
            init_fn=_init(f, args.dim),
            use_virtual_table=virtual,
            virtual_table_eviction_policy=eviction_policy(args) if virtual else None,
        )
        for f in FEATURES
    ]


def build(
    args: argparse.Namespace, variant: str, root: Path, rows: int = 0
) -> DistributedModelParallel:
    """``A'`` and ``A'p`` (hashed FUSED), ``A''`` (managed collisions over ours), ``ours``
    (virtual on a tier) or ``fused`` (``rows`` rows filled by ours' initializer: the check's
    reference)."""
    if variant == "A''":
        return build_managed_collisions(args, root)
    virtual = variant == "ours"
    table_rows = {"A'": args.hash_rows, "A'p": args.hash_rows, "fused": rows, "ours": ID_SPACE}[
        variant
    ]
    configs = _table_configs(args, table_rows, virtual)
    ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    fused = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LEARNING_RATE}
    sharder: Any = (
        TieredEmbeddingBagCollectionSharder(TierStorage(root=str(root)), fused_params=fused)
        if virtual
        else EmbeddingBagCollectionSharder(fused_params=fused)
    )
    kernel = TIERED_KERNEL if virtual else "fused"
    plan = construct_module_sharding_plan(
        ebc, {f: table_wise(rank=0, compute_kernel=kernel) for f in FEATURES}, sharder=sharder
    )
    if virtual:
        for f in FEATURES:
            plan[f] = TieredParameterSharding.wrap(
                plan[f],
                TieredTableOptions(
                    tier=args.tier,
                    cache_load_factor=args.cache_load_factor,
                    max_live_rows=args.live_rows,
                ),
            )
    return DistributedModelParallel(
        Model(ebc, args.dim),
        device=compute_device(args),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
    )


def build_managed_collisions(
    args: argparse.Namespace, root: Path | None, slots: int = 0
) -> DistributedModelParallel:
    """``A''``: each feature's raw ids remapped by TorchRec's managed-collision module into a
    table of ``slots`` (default ``--live-rows``) slots, sharded by TorchRec's managed-collision
    sharder over ours, the table on ``--tier`` behind a cache of ``--cache-load-factor`` of it,
    as ours. With ``root`` None, over TorchRec's own sharder (FUSED), the reset of new ids'
    rows given on the CPU the effect fbgemm's CUDA kernel has (the check's reference)."""
    slots = slots or args.live_rows
    configs = _table_configs(args, slots)
    device = compute_device(args)
    remappers = {
        f: MCHManagedCollisionModule(
            zch_size=slots,
            device=device,
            eviction_policy=DistanceLFU_EvictionPolicy(),
            eviction_interval=args.mc_eviction_interval,
            input_hash_size=ID_SPACE,
        )
        for f in FEATURES
    }
    mc = ManagedCollisionEmbeddingBagCollection(
        EmbeddingBagCollection(configs, device=device),
        ManagedCollisionCollection(remappers, embedding_configs=configs),
        return_remapped_features=False,
    )
    fused = {"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": LEARNING_RATE}
    ebc_sharder: Any = (
        EmbeddingBagCollectionSharder(fused_params=fused)
        if root is None
        else TieredEmbeddingBagCollectionSharder(TierStorage(root=str(root)), fused_params=fused)
    )
    sharder = ManagedCollisionEmbeddingBagCollectionSharder(ebc_sharder=ebc_sharder)
    # The managed-collision sharder shards row-wise only (one rank here: one shard a table).
    kernel = "fused" if root is None else TIERED_KERNEL
    plan = construct_module_sharding_plan(
        mc, {f: row_wise(compute_kernel=kernel) for f in FEATURES}, sharder=sharder
    )
    if root is not None:
        for f in FEATURES:
            plan[f] = TieredParameterSharding.wrap(
                plan[f],
                TieredTableOptions(tier=args.tier, cache_load_factor=args.cache_load_factor),
            )
    model = DistributedModelParallel(
        Model(mc, args.dim), device=device, plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    if root is None and device.type == "cpu":
        for tbe, _ in model.module.ebc._table_to_tbe_and_index.values():
            reset_rows_on_cpu(tbe)
    return model


def step(
    model: DistributedModelParallel, opt: torch.optim.Optimizer, batch: Any, modulo: int
) -> torch.Tensor:
    """One step of the plain loop (the fused tables update inside backward), on the model's
    device."""
    opt.zero_grad()
    loss, _ = model(on_device(as_batch(batch, modulo), model.device))
    torch.autograd.backward(loss)
    opt.step()
    return loss.detach()


def dense_optimizer(model: DistributedModelParallel) -> torch.optim.Optimizer:
    params = [p for n, p in model.named_parameters() if "dense" in n]
    return torch.optim.Adagrad(params, lr=LEARNING_RATE)


# ------------------------------------------------------------------------------- metrics


def ne_and_auc(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, float]:
    p = labels.mean().clamp(1e-6, 1 - 1e-6)
    base = -(p * p.log() + (1 - p) * (1 - p).log())
    ne = float(nn.functional.binary_cross_entropy_with_logits(logits, labels) / base)
    order = logits.argsort()
    ranks = torch.empty_like(order, dtype=torch.float64)
    ranks[order] = torch.arange(1, len(order) + 1, dtype=torch.float64)
    pos = labels.bool()
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    auc = (float(ranks[pos].sum()) - n_pos * (n_pos + 1) / 2) / max(n_pos * n_neg, 1)
    return ne, auc


def evaluate(
    model: DistributedModelParallel, batches: list[Any], modulo: int
) -> tuple[float, float]:
    logits, labels = [], []
    model.eval()  # (a managed-collision module then places no new id)
    with torch.no_grad():
        for raw in batches:
            logits.append(model(on_device(as_batch(raw, modulo), model.device))[1][1].cpu())
            labels.append(raw[1])
    model.train()
    return ne_and_auc(torch.cat(logits), torch.cat(labels))


# ---------------------------------------------------------------------------------- runs


def check(args: argparse.Namespace, root: Path) -> int:
    """Ours against FUSED on ids below ``--check-rows``; returns the steps compared."""
    ours, ref = build(args, "ours", root / "check"), build(args, "fused", root, args.check_rows)
    _same_losses(ours, ref, args, args.check_steps, "FUSED", "ours")
    return args.check_steps


def check_managed_collisions(args: argparse.Namespace, root: Path) -> tuple[int, int]:
    """A'' against the same managed-collision modules over TorchRec's own sharder (FUSED), in
    tables of a quarter of ``--check-rows`` slots fed ids below ``--check-rows`` (so the
    modules evict), over three of their eviction rounds; returns the steps and slots. Batches
    of at most 256 and a cache of half the slots: rows go to the tier and come back."""
    slots = max(1, args.check_rows // 4)
    small = argparse.Namespace(
        **{**vars(args), "batch_size": min(args.batch_size, 256), "cache_load_factor": 0.5}
    )
    ours = build_managed_collisions(small, root / "check_mc", slots)
    ref = build_managed_collisions(small, None, slots)
    steps = max(args.check_steps, 3 * args.mc_eviction_interval)
    _same_losses(ours, ref, small, steps, "TorchRec's managed collisions over FUSED", "A''")
    return steps, slots


def _same_losses(
    ours: DistributedModelParallel,
    ref: DistributedModelParallel,
    args: argparse.Namespace,
    steps: int,
    ref_name: str,
    name: str,
) -> None:
    stream = Stream(args, seed=99, ids_below=args.check_rows)
    o_opt, r_opt = dense_optimizer(ours), dense_optimizer(ref)
    for i in range(steps):
        batch = stream.batch()
        a, b = step(ref, r_opt, batch, 0), step(ours, o_opt, batch, 0)
        _same_loss(f"step {i}", (ref_name, a), (name, b), ours.device)


def _same_run(
    plain: list[torch.Tensor], pipelined: list[torch.Tensor], device: torch.device
) -> None:
    """A'p's timed losses against A''s, step by step (the same model and batches: TorchRec's
    pipeline changes when a batch's ids are distributed, never what a step computes)."""
    for i, (a, b) in enumerate(zip(plain, pipelined, strict=True)):
        _same_loss(f"timed step {i}", ("A'", a), ("A'p", b), device)


def _same_loss(
    where: str, ref: tuple[str, torch.Tensor], other: tuple[str, torch.Tensor], device: torch.device
) -> None:
    """Stops the benchmark unless the two losses are equal (on CUDA: within
    ``CUDA_LOSS_RTOL`` of the reference's)."""
    (ref_name, a_t), (name, b_t) = ref, other
    a, b = float(a_t), float(b_t)
    rtol = CUDA_LOSS_RTOL if device.type == "cuda" else 0.0
    if a != b and abs(a - b) > rtol * abs(a):
        within = f" (beyond {rtol:g} relative)" if rtol else ""
        raise SystemExit(f"check failed at {where}: {ref_name} loss {a} != {name} {b}{within}")


def dram_bytes(
    args: argparse.Namespace, mc: DistributedModelParallel, ours: DistributedModelParallel
) -> dict[str, int]:
    """Host memory each variant's embeddings take besides the tier: the hashed tables of A' (rows
    and row-wise state), against the caches of A'' and ours (rows and per-slot state), the
    caches' id -> slot maps over the stores' rows, ours' virtual tables' id -> row maps with
    their eviction statistics (as the planner counts them), and the tensors of the
    managed-collision modules of A'' (sorted raw ids, counts, the ids of the batches since the
    last eviction round). The stores, on a tier, are not counted, nor a log-structured tier's
    index (W3's default tier, byte SCM, keeps none)."""

    def tiered(model: DistributedModelParallel) -> int:
        total = 0
        for group in tiered_groups(model):
            for shard in group.shards:
                layout = shard.store.layout
                total += cache_bytes(shard.cache.num_slots, layout.row_bytes)
                total += slot_map_bytes(layout.num_rows, virtual=shard.virtual is not None)
        return total

    remappers = {
        id(t): t
        for module in mc.module.ebc._managed_collision_collection.modules()
        for t in [*module.buffers(recurse=False), *vars(module).values()]
        if isinstance(t, torch.Tensor)  # (the history of ids is a plain attribute)
    }
    remapping = sum(t.numel() * t.element_size() for t in remappers.values())
    a = len(FEATURES) * args.hash_rows * stored_row_bytes(args.dim, 1, 4)
    return {"A'": a, "A'p": a, "A''": tiered(mc) + remapping, "ours": tiered(ours)}


def distinct_ids(*batch_lists: list[Any]) -> dict[str, int]:
    """Per feature, the distinct raw ids of ``batch_lists`` (raw batches)."""
    return {
        f: int(
            np.unique(
                np.concatenate([ids[f].numpy() for part in batch_lists for ids, _ in part])
            ).size
        )
        for f in FEATURES
    }


def run_side_by_side(
    args: argparse.Namespace, root: Path, eval_batches: list[Any]
) -> dict[str, dict[str, Any]]:
    """Trains every variant on the same batches, the timed steps in alternating windows
    of ``--window-steps`` (each variant's model and batch position carried over; which goes
    first alternates from window to window), so that all see the same state of a shared and
    noisy machine; then evaluates all and measures ours' checkpoints. Also returns, under
    ``distinct_ids``, each feature's distinct raw ids over the warm-up and timed batches.

    During the windows of A', ours' look-ahead pipeline holds its next batches, whose rows its
    worker had planned and read by the end of ours' window (at most ``--lookahead`` batches'
    work spills into a window of A')."""
    stream = Stream(args, seed=1)
    warmup = [stream.batch() for _ in range(args.warmup)]
    models = {v: build(args, v, root / v) for v in VARIANTS}
    # Built: from here on every variant's steps reuse the host memory the step before freed.
    # (Under glibc's own settings, A' ran at 2.3 ms a step after the checks had trained a few
    # steps in this process and at 6.6 ms in a fresh one: docs/benchmarks.md.)
    malloc = apply_malloc_option(args.malloc_trim_threshold)
    opts = {v: dense_optimizer(m) for v, m in models.items()}
    modulo = {"A'": args.hash_rows, "A'p": args.hash_rows, "A''": 0, "ours": 0}
    for v in VARIANTS:  # the plain loop, untimed
        for raw in warmup:
            step(models[v], opts[v], raw, modulo[v])
    batches = [stream.batch() for _ in range(args.steps)]
    distinct = distinct_ids(warmup, batches)
    del warmup
    seconds = dict.fromkeys(VARIANTS, 0.0)
    windows: dict[str, list[float]] = {v: [] for v in VARIANTS}
    losses: dict[str, list[torch.Tensor]] = {v: [] for v in VARIANTS}
    live: list[tuple[int, int]] = []
    every = max(1, args.steps // 1000)  # ~1,000 points: several within each eviction round
    pipeline: LookaheadTrainPipeline[Batch, Any] | None = None
    if args.lookahead:  # ours: the rows of the next batches made and read meanwhile
        pipeline = LookaheadTrainPipeline(
            models["ours"], opts["ours"], compute_device(args), lookahead=args.lookahead
        )
    ours_batches = iter(as_batch(raw, 0) for raw in batches)
    # A'p: TorchRec's own pipeline (its first progress rewrites the model, as ours' does)
    torchrec_pipeline = TrainPipelineSparseDist(models["A'p"], opts["A'p"], compute_device(args))
    pipelined_batches = iter(as_batch(raw, args.hash_rows) for raw in batches)

    # CPU a step of the training thread and the tier worker, and ours' stall (its training
    # thread blocked on rows): what bounds each variant in the timed windows.
    cpu = {v: dict.fromkeys(("main", "tier_io"), 0.0) for v in VARIANTS}
    stall = 0.0

    def train(variant: str, first: int, end: int) -> None:
        nonlocal stall
        cpu_before = thread_cpu_seconds()
        stalled = pipeline.totals.stall_seconds if pipeline is not None else 0.0
        started = time.perf_counter()
        for i in range(first, end):
            if variant == "A'p":
                loss, _ = torchrec_pipeline.progress(pipelined_batches)
            elif variant != "ours" or pipeline is None:
                loss = step(models[variant], opts[variant], batches[i], modulo[variant])
            else:
                loss, _ = pipeline.progress(ours_batches)
            losses[variant].append(loss)
            if variant == "ours" and i % every == 0:
                rows = sum(int(s["live_rows"]) for s in tier_stats(models["ours"]).values())
                live.append((args.warmup + i, rows))
        synchronize(models[variant].device)
        took = time.perf_counter() - started
        seconds[variant] += took
        windows[variant].append((end - first) * args.batch_size / took)
        cpu_after = thread_cpu_seconds()
        for role in cpu[variant]:
            cpu[variant][role] += cpu_after[role] - cpu_before[role]
        if variant == "ours" and pipeline is not None:
            stall += pipeline.totals.stall_seconds - stalled

    # The garbage collector's full passes walk every object alive, the prepared batches too,
    # more often the longer the run: both variants train with the objects of now frozen (the
    # look-ahead pipeline would freeze them for ours alone).
    gc.collect()
    gc.freeze()
    try:
        with pipeline if pipeline is not None else contextlib.nullcontext():
            for w, first in enumerate(range(0, args.steps, args.window_steps)):
                end = min(first + args.window_steps, args.steps)
                for variant in VARIANTS if w % 2 == 0 else VARIANTS[::-1]:
                    train(variant, first, end)
    finally:
        gc.unfreeze()
        torchrec_pipeline.detach()  # the model's own forward back, for the evaluation
    _same_run(losses["A'"], losses["A'p"], compute_device(args))
    out: dict[str, dict[str, Any]] = {}
    for v in VARIANTS:
        ne, auc = evaluate(models[v], eval_batches, modulo[v])
        tail = losses[v][-max(1, len(losses[v]) // 10) :]
        out[v] = {
            "samples_per_s": args.steps * args.batch_size / seconds[v],
            "window_samples_per_s": windows[v],
            "eval_ne": ne,
            "eval_auc": auc,
            "train_loss_last_10pct": float(torch.stack(tail).mean()),
            "cpu_ms_per_step": {r: 1e3 * c / args.steps for r, c in cpu[v].items()},
            "step_ms": 1e3 * seconds[v] / args.steps,
        }
    out["ours"]["stall_share"] = stall / seconds["ours"]
    for v in ("A'p", "A''", "ours"):
        out[v]["window_ratios"] = [o / a for o, a in zip(windows[v], windows["A'"])]
    out["ours"]["window_ratios_to_pipelined"] = [
        o / a for o, a in zip(windows["ours"], windows["A'p"])
    ]
    stats = tier_stats(models["ours"])
    out["ours"]["live_rows_over_steps"] = live
    out["ours"]["tables"] = {
        name: {
            k: s[k]
            for k in ("live_rows", "rows_made", "rows_evicted", "eviction_rounds", "hit_rate")
        }
        for name, s in stats.items()
    }
    dram = dram_bytes(args, models["A''"], models["ours"])
    for v in VARIANTS:
        out[v]["dram_bytes"] = dram[v]
    out["distinct_ids"] = distinct
    out["malloc"] = malloc
    out["ours"]["checkpoint"] = checkpoint_bytes(models["ours"], args, root / "ckpt")
    out["ours"]["chain"] = chain_bytes(models["ours"], opts["ours"], args, root, stream)
    return out


def checkpoint_bytes(
    model: DistributedModelParallel, args: argparse.Namespace, path: Path
) -> dict[str, Any]:
    """A full dcp checkpoint of the embeddings (module and fused optimizer) against live rows x
    (row + id) bytes (row: weights and the row-wise Adagrad state)."""
    state = {
        "model": {k: v for k, v in model.state_dict().items() if k.startswith("ebc.")},
        "optim": model.fused_optimizer.state_dict(),
    }
    dcp_save(state, checkpoint_id=str(path))
    written = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    live = sum(int(s["live_rows"]) for s in tier_stats(model).values())
    ideal = live * (args.dim * 4 + 4 + 8)
    return {
        "bytes": written,
        "live_rows": live,
        "live_rows_x_row_and_id": ideal,
        "ratio": written / ideal,
    }


def _entries(link: Path, suffix: str) -> int:
    """Rows of a link's entries whose keys end with ``suffix``."""
    saved = FileSystemReader(str(link)).read_metadata().state_dict_metadata
    return sum(
        int(md.size[0])
        for key, md in saved.items()
        if key.endswith(suffix) and isinstance(md, TensorStorageMetadata)
    )


def _state(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if key.startswith("ebc."):
            flat[key] = value.local_shards()[0].tensor
    for key, states in model.fused_optimizer.state_dict()["state"].items():
        for name, value in states.items():
            flat[f"{key}/{name}"] = value.local_shards()[0].tensor
    return flat


def chain_bytes(
    model: DistributedModelParallel,
    opt: torch.optim.Optimizer,
    args: argparse.Namespace,
    root: Path,
    stream: Stream,
) -> dict[str, Any]:
    """A checkpoint chain of ours: a full link, ``--increment-steps`` more steps, an
    incremental link, whose bytes are set against the rows it holds x (row + id) bytes and the
    ids it deletes x 8; then the chain is restored into a new model, whose state must be ours'
    (the benchmark stops otherwise)."""
    path = root / "chain"
    options = CheckpointOptions(full_every=2, keep=None)
    manager = CheckpointManager(path, model, model.fused_optimizer, options)
    full = manager.save(0)
    for _ in range(args.increment_steps):
        step(model, opt, stream.batch(), 0)
    started = time.perf_counter()
    link = manager.save(args.increment_steps)
    seconds = time.perf_counter() - started
    rows = _entries(link.path, ".weight_id") // 2  # the module's ids, and the optimizer's
    evicted = _entries(link.path, "embedding_bags.user.evicted_id") + _entries(
        link.path, "embedding_bags.item.evicted_id"
    )
    ideal = rows * (args.dim * 4 + 4 + 8) + evicted * 8
    live = sum(int(s["live_rows"]) for s in tier_stats(model).values())
    want = _state(model)
    fresh = build(args, "ours", root / "restored")
    restored = CheckpointManager(path, fresh, fresh.fused_optimizer, options).restore()
    assert restored is not None and restored.parent == full.name
    got = _state(fresh)
    wrong = sorted(k for k in want if k not in got or not torch.equal(want[k], got[k]))
    if wrong:
        raise SystemExit(f"chain check failed: the restored model differs in {wrong[:3]}")
    return {
        "full_bytes": full.size_bytes(),
        "increment_bytes": link.size_bytes(),
        "increment_steps": args.increment_steps,
        "increment_seconds": seconds,
        "changed_rows": rows,
        "evicted_ids": evicted,
        "live_rows": live,
        "changed_rows_x_row_and_id_plus_evicted_x_8": ideal,
        "ratio": link.size_bytes() / max(ideal, 1),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, live = zip(*result["ours"]["live_rows_over_steps"])
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, live, lw=0.8, label="ours: live rows (both tables)")
    ax.axhline(
        2 * result["args"]["live_rows"],
        color="r",
        ls="--",
        label="bound (max_live_rows x 2); A'': slots of its tables",
    )
    ax.axhline(
        2 * result["args"]["hash_rows"], color="g", ls=":", label="A': rows of the hashed tables"
    )
    ax.set_xlabel("step")
    ax.set_ylabel("rows")
    ax.set_title("W3: live rows of the virtual tables over the run")
    ax.set_ylim(0, 2.25 * result["args"]["live_rows"])
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None, help="default: --out with .png")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=1000, help="untimed steps per variant")
    parser.add_argument(
        "--window-steps", type=int, default=500, help="timed steps per window (alternating)"
    )
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=4_000_000, help="distinct raw ids per feature")
    parser.add_argument("--zipf", type=float, default=1.05)
    parser.add_argument("--hash-rows", type=int, default=2**17, help="A': rows per hashed table")
    parser.add_argument(
        "--live-rows", type=int, default=2**19, help="ours: max_live_rows per table"
    )
    parser.add_argument(
        "--eviction",
        choices=("score", "count"),
        default="score",
        help="ours: TorchRec's FeatureScoreBasedEvictionPolicy (keeps the ids scored highest) "
        "or CountBasedEvictionPolicy (evicts ids whose decayed count falls below a threshold)",
    )
    parser.add_argument(
        "--keep-share",
        type=float,
        default=0.75,
        help="ours, score: training_id_keep_count as a share of --live-rows",
    )
    parser.add_argument(
        "--eviction-threshold",
        type=int,
        default=1,
        help="ours, count: eviction_threshold (a round evicts ids whose decayed count falls "
        "below it)",
    )
    parser.add_argument(
        "--decay-rate",
        type=float,
        default=None,
        help="ours: the policy's decay_rate (default: 0.99 for score, 0.9 for count)",
    )
    parser.add_argument("--tier", default="byte_scm")
    parser.add_argument(
        "--lookahead", type=int, default=2, help="ours: batches read ahead (0: the plain loop)"
    )
    parser.add_argument("--cache-load-factor", type=float, default=0.05)
    parser.add_argument(
        "--mc-eviction-interval",
        type=int,
        default=10,
        help="A'': batches between the managed-collision modules' eviction rounds",
    )
    parser.add_argument("--eval-batches", type=int, default=10)
    parser.add_argument(
        "--increment-steps", type=int, default=20, help="steps between the chain's two links"
    )
    parser.add_argument("--check-rows", type=int, default=2**12)
    parser.add_argument("--check-steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where every model computes (cuda: NCCL; caches and A''s tables in HBM)",
    )
    parser.add_argument("--dir", default=None, help="where tier files go (default: a temp dir)")
    add_malloc_option(parser, DEFAULT_TRIM_THRESHOLD)
    parser.add_argument(
        "--no-thp",
        action="store_true",
        help=f"run without {THP_ENV}=1 (4 KiB pages for tensors; the speed of A' then varies ~2x)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = _parser().parse_args(argv)
    if args.decay_rate is None:  # (recorded as applied)
        args.decay_rate = 0.99 if args.eviction == "score" else 0.9
    torch.set_num_threads(args.threads)
    root = Path(tempfile.mkdtemp(prefix="w3-", dir=args.dir))
    device = compute_device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    equal = (
        f"losses within {CUDA_LOSS_RTOL:g} relative" if device.type == "cuda" else "losses equal"
    )
    try:
        # (on CUDA, gloo beside NCCL for the checkpoints' host tensors, as the CUDA tests run)
        with process_group(
            device, backend="cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        ):
            checked = check(args, root)
            print(
                f"check: ours = FUSED over {args.check_rows:,} rows per table for {checked} steps: {equal}"
            )
            steps, slots = check_managed_collisions(args, root)
            print(
                f"check: A'' = TorchRec's managed collisions over FUSED ({slots:,} slots per "
                f"table, ids below {args.check_rows:,}) for {steps} steps: {equal}"
            )
            eval_stream = Stream(args, seed=2)
            eval_batches = [eval_stream.batch() for _ in range(args.eval_batches)]
            result: dict[str, Any] = {
                "args": vars(args) | {"out": str(args.out), "png": str(args.png)},
                "thp": os.environ.get(THP_ENV) == "1",
            }
            result.update(run_side_by_side(args, root, eval_batches))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    a, piped, mc, ours = result["A'"], result["A'p"], result["A''"], result["ours"]
    print(
        f"check: A'p = A' (TorchRec's TrainPipelineSparseDist against the plain loop) over the "
        f"{args.steps:,} timed steps: {equal}"
    )
    trim = result["malloc"]["trim_threshold"]
    print(
        f"huge pages for tensors ({THP_ENV}=1): {'on' if result['thp'] else 'off'}; freed host "
        "memory kept for the next steps (--malloc-trim-threshold): "
        + (f"up to {trim / 2**20:,.0f} MiB" if trim else "no, glibc's own settings")
    )
    print(
        "distinct raw ids over the run's batches (warm-up and timed): "
        + ", ".join(f"{f} {n:,}" for f, n in result["distinct_ids"].items())
    )
    for name, key, base in (
        ("A'p", "window_ratios", "A'"),
        ("A''", "window_ratios", "A'"),
        ("ours", "window_ratios", "A'"),
        ("ours", "window_ratios_to_pipelined", "A'p"),
    ):
        ratios = sorted(result[name][key])
        print(
            f"{name} / {base} per window of {args.window_steps} steps ({len(ratios)} each, in "
            f"turns): median {statistics.median(ratios):.2f}, min {ratios[0]:.2f}, "
            f"max {ratios[-1]:.2f}"
        )
    print(
        (
            "memory of the embeddings (tables and caches in HBM, maps on the host; the tier aside)"
            if args.device == "cuda"
            else "host memory of the embeddings (the tier aside)"
        )
        + f": A' {a['dram_bytes'] / 2**20:,.1f} MiB, "
        f"A'' {mc['dram_bytes'] / 2**20:,.1f} MiB, ours {ours['dram_bytes'] / 2**20:,.1f} MiB "
        f"(caches of {args.cache_load_factor:g} x the tables' rows, their slot state and maps; "
        "ours' id maps; the remapping tensors of A'')"
    )
    per_a, per_piped = "/ A'", "/ A'p"
    print(
        f"{'variant':8} {'samples/s':>10} {per_a:>6} {per_piped:>6} {'eval NE':>8} {'eval AUC':>9} "
        f"{'step ms':>8} {'training CPU':>13} {'worker CPU':>11}"
    )
    for name in VARIANTS:
        r = result[name]
        c = r["cpu_ms_per_step"]
        print(
            f"{name:8} {r['samples_per_s']:10,.0f} {r['samples_per_s'] / a['samples_per_s']:6.2f} "
            f"{r['samples_per_s'] / piped['samples_per_s']:6.2f} "
            f"{r['eval_ne']:8.4f} {r['eval_auc']:9.4f} {r['step_ms']:8.2f} "
            f"{c['main']:10.2f} ms {c['tier_io']:8.2f} ms"
        )
    print(
        f"ours' training thread waited for rows {ours['stall_share']:.1%} of its time; CPU a "
        "step is the threads' own (a window's, over its steps; the worker's spills into the "
        "next window of A' by at most the look-ahead's batches)"
    )
    for name, t in ours["tables"].items():
        print(
            f"ours {name}: live {t['live_rows']:,.0f} (bound {args.live_rows:,}), made "
            f"{t['rows_made']:,.0f}, evicted {t['rows_evicted']:,.0f} in {t['eviction_rounds']:.0f} "
            f"rounds, hit rate {t['hit_rate']:.3f}"
        )
    ck = ours["checkpoint"]
    print(
        f"ours full checkpoint: {ck['bytes']:,} bytes for {ck['live_rows']:,} live rows = "
        f"{ck['ratio']:.3f} x live rows x (row + id) bytes"
    )
    ch = ours["chain"]
    print(
        f"ours incremental link after {ch['increment_steps']} steps: {ch['increment_bytes']:,} "
        f"bytes ({ch['increment_bytes'] / ch['full_bytes']:.3f} x the full link's) for "
        f"{ch['changed_rows']:,} changed rows of {ch['live_rows']:,} live and "
        f"{ch['evicted_ids']:,} evicted ids = {ch['ratio']:.3f} x (changed rows x (row + id) + "
        f"evicted x 8) bytes, saved in {ch['increment_seconds']:.2f} s; the chain restored "
        "into a new model: its state equal"
    )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        png = args.png or args.out.with_suffix(".png")
        plot(result, png)
        print(f"wrote {args.out} and {png}")
    return result


if __name__ == "__main__":
    # (A bad option stops here, before the restart.)
    if not _parser().parse_args(sys.argv[1:]).no_thp and os.environ.get(THP_ENV) != "1":
        # PyTorch reads it once, at its first large allocation: only a new process takes it.
        os.execve(
            sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, THP_ENV: "1"}
        )
    main(sys.argv[1:])
