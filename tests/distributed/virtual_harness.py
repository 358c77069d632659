"""Virtual tables against TorchRec's FUSED kernel, step by step.

A :class:`VirtualCase` builds two ``DistributedModelParallel`` models over one table fed by two
features (plus a FUSED table beside it, in the same sharded module):

* the model under test: the table virtual (``use_virtual_table=True``, ``num_embeddings`` =
  2**40 unless the case says otherwise) on the case's tier, store and cache;
* the reference: the same table on TorchRec's FUSED kernel with ``REF_ROWS`` rows, filled by
  the virtual table's initializer at the ids its rows stand for.

Ids are drawn from ``REF_ROWS`` *reference rows*; reference row ``r`` stands for virtual id
:func:`virtual_id` ``(r)``. Row-wise, the two halves of the reference rows stand for ids at the
starts of the two halves of the id space, so each rank of the virtual table gets the ids its
FUSED counterpart gets and pooled sums add up in the same order. Both train ``steps`` steps
on the same batches and the outputs of every step are compared bit for bit (on CUDA within
:data:`CUDA_TOLERANCE`, as the other CUDA parity tests compare).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import (
    CountBasedEvictionPolicy,
    CountTimestampMixedEvictionPolicy,
    EmbeddingBagConfig,
    EmbeddingConfig,
    FeatureL2NormBasedEvictionPolicy,
    FeatureScoreBasedEvictionPolicy,
    TimestampBasedEvictionPolicy,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.distributed.parity_harness import OPTIMIZERS
from tests.torchrec_releases import row_wise_plan
from torchrec_mtrains.checkpoint import CheckpointManager, CheckpointOptions
from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.distributed.sharders import (
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
)
from torchrec_mtrains.distributed.virtual_rows import VirtualRows
from torchrec_mtrains.distributed.virtual_tables import bucket_rows
from torchrec_mtrains.initializers import IdSeededUniform
from torchrec_mtrains.pipeline import tier_stats
from torchrec_mtrains.tiers import TIERS, resolve_options

VIRTUAL = "t_virtual"
FUSED = "t_fused"
DIM = 8
REF_ROWS = 240
FUSED_ROWS = 30
BATCH = 8
MAX_LEN = 3
LEARNING_RATE = 0.05
CUDA_TOLERANCE = 1e-6  # parity_harness.TOLERANCE: fbgemm's CUDA kernels' order of sums
# A rank whose table refuses a batch leaves the other waiting in a collective until this.
RANK_TIMEOUT_S = 20


@dataclass(frozen=True)
class VirtualCase:
    store: str = "log_block_scm"  # a key of TIERS
    kind: str = "ebc"  # ebc | ec
    sharding: str = "tw"  # tw | rw
    optimizer: str = "rowwise_adagrad"
    weighted: bool = False
    num_embeddings: int = 2**40
    buckets: int = 4
    max_live_rows: int = 260
    cache_load_factor: float = 0.5
    policy: str = "lfu"
    steps: int = 12
    seed: int = 0
    # none | count | ttl | mixed | l2 | score, with TorchRec's trigger count (0: only when full)
    eviction: str = "none"
    trigger: int = 0
    world_size: int = 1  # where a sweep runs it (run_case takes the world it is in)
    # before this step (0: never) the virtual model is replaced by a new one loaded from its
    # state_dict() and its optimizer's (in that order, or the optimizer's first)
    reload_at: int = 0
    optimizer_first: bool = False
    # how: "state_dicts", or "chain": a checkpoint chain (a full link, then an incremental
    # one a step up to reload_at) restored by CheckpointManager
    reload_from: str = "state_dicts"
    # after every this many steps (0: never) both models evaluate a batch (eval mode, no grad)
    # between the training steps: outputs compared, and no id it looked up gets a live row
    evaluate_every: int = 0
    # where both models compute, "cpu" or "cuda" (the virtual table's cache in HBM, its rows
    # on the tier; the reference's table in HBM)
    device: str = "cpu"

    @property
    def id(self) -> str:
        values = asdict(self)
        if self.device == "cpu":  # (the ids CPU cases had before the field)
            del values["device"]
        return "-".join(str(v) for v in values.values())

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device)

    def differ(self, a: torch.Tensor, b: torch.Tensor) -> bool:
        """Whether the two models' outputs differ: at all on the CPU, beyond
        :data:`CUDA_TOLERANCE` on CUDA."""
        if self.device == "cpu" or a.shape != b.shape or not a.numel():
            return not torch.equal(a, b)
        return float((a - b).abs().max()) > CUDA_TOLERANCE


def virtual_id(case: VirtualCase, rows: torch.Tensor) -> torch.Tensor:
    """The virtual id each reference row stands for."""
    if case.sharding == "tw":
        return rows
    half_rows = REF_ROWS // 2
    rank1_first = bucket_rows(case.num_embeddings, case.buckets, 2)[0]
    return torch.where(rows < half_rows, rows, rows - half_rows + rank1_first)


def reference_row(case: VirtualCase, ids: torch.Tensor) -> torch.Tensor:
    """The reference row standing for each virtual id (the inverse of :func:`virtual_id`)."""
    if case.sharding == "tw":
        return ids
    rank1_first = bucket_rows(case.num_embeddings, case.buckets, 2)[0]
    return torch.where(ids < rank1_first, ids, ids - rank1_first + REF_ROWS // 2)


def initial_weights(case: VirtualCase, ids: torch.Tensor) -> torch.Tensor:
    """The weights the virtual table gives ``ids`` (virtual ids) when it makes their rows."""
    values = torch.empty(int(ids.numel()), DIM)
    _configs(case, virtual=True)[0].init_fn.fill_ids(values, ids)
    return values


STEP_SECONDS = 60.0  # the virtual model's clock advances a minute a step (TTLs in minutes)


def eviction_policy(case: VirtualCase) -> Any:
    trigger = case.trigger
    if case.eviction == "count":
        return CountBasedEvictionPolicy(
            training_id_eviction_trigger_count=trigger, eviction_threshold=1, decay_rate=0.6
        )
    if case.eviction == "ttl":
        return TimestampBasedEvictionPolicy(
            training_id_eviction_trigger_count=trigger, eviction_ttl_mins=2
        )
    if case.eviction == "mixed":
        return CountTimestampMixedEvictionPolicy(
            training_id_eviction_trigger_count=trigger,
            eviction_threshold=2,
            decay_rate=0.8,
            eviction_ttl_mins=1,
        )
    if case.eviction == "l2":
        return FeatureL2NormBasedEvictionPolicy(
            training_id_eviction_trigger_count=trigger, eviction_threshold=0.09
        )
    if case.eviction == "score":  # keeps a third of the bound: rounds that evict many
        return FeatureScoreBasedEvictionPolicy(
            training_id_eviction_trigger_count=trigger,
            training_id_keep_count=max(1, case.max_live_rows // 3),
            decay_rate=0.8,
            enable_auto_feature_score_collection=True,
            feature_score_default_value=1.0,
        )
    return None


def _configs(case: VirtualCase, virtual: bool) -> list[Any]:
    cls = EmbeddingBagConfig if case.kind == "ebc" else EmbeddingConfig
    extra: dict[str, Any] = {"init_fn": IdSeededUniform(seed=7, dim=DIM, low=-0.05, high=0.05)}
    if virtual:
        extra.update(
            use_virtual_table=True,
            total_num_buckets=case.buckets,
            virtual_table_eviction_policy=eviction_policy(case),
        )
    return [
        cls(
            name=VIRTUAL,
            embedding_dim=DIM,
            num_embeddings=case.num_embeddings if virtual else REF_ROWS,
            feature_names=["f0", "f1"],
            **extra,
        ),
        cls(
            name=FUSED,
            embedding_dim=DIM,
            num_embeddings=FUSED_ROWS,
            feature_names=["f2"],
            init_fn=IdSeededUniform(seed=8, dim=DIM, low=-0.05, high=0.05),
        ),
    ]


def make_module(case: VirtualCase, virtual: bool) -> nn.Module:
    meta = torch.device("meta")
    if case.kind == "ebc":
        return EmbeddingBagCollection(
            tables=_configs(case, virtual), is_weighted=case.weighted, device=meta
        )
    return EmbeddingCollection(tables=_configs(case, virtual), device=meta)


def build_model(case: VirtualCase, world_size: int, root: Path | None) -> DistributedModelParallel:
    """The virtual model (tier files under ``root``) or, without ``root``, the reference."""
    fp = {"optimizer": OPTIMIZERS[case.optimizer], "learning_rate": LEARNING_RATE}
    sharder: ModuleSharder[nn.Module]
    if root is None:
        sharder = (
            EmbeddingBagCollectionSharder(fused_params=fp)
            if case.kind == "ebc"
            else EmbeddingCollectionSharder(fused_params=fp)
        )
    else:
        placed = TIERS[case.store].serves_tier
        storage = TierStorage(root=str(root), tier_options={placed: resolve_options(case.store)})
        sharder = (
            TieredEmbeddingBagCollectionSharder(storage, fused_params=fp)
            if case.kind == "ebc"
            else TieredEmbeddingCollectionSharder(storage, fused_params=fp)
        )
    kernel = "fused" if root is None else TIERED_KERNEL
    gen = table_wise(rank=0, compute_kernel=kernel)
    if case.sharding == "rw":
        gen = row_wise_plan(kernel, case.buckets if root else None)
    module = make_module(case, virtual=root is not None)
    plan = construct_module_sharding_plan(
        module,
        {VIRTUAL: gen, FUSED: table_wise(rank=world_size - 1, compute_kernel="fused")},
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type=case.torch_device.type,
    )
    if root is not None:
        plan[VIRTUAL] = TieredParameterSharding.wrap(
            plan[VIRTUAL],
            TieredTableOptions(
                tier=TIERS[case.store].serves_tier,
                cache_load_factor=case.cache_load_factor,
                cache_policy=case.policy,
                max_live_rows=case.max_live_rows,
            ),
        )
    return DistributedModelParallel(
        module, device=case.torch_device, plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


@torch.no_grad()
def fill_reference(case: VirtualCase, ref: DistributedModelParallel) -> None:
    """The reference's virtual-table rows as the virtual table makes them."""
    init = _configs(case, virtual=True)[0].init_fn
    prefix = "embedding_bags" if case.kind == "ebc" else "embeddings"
    for shard in ref.state_dict()[f"{prefix}.{VIRTUAL}.weight"].local_shards():
        first = int(shard.metadata.shard_offsets[0])
        rows = torch.arange(first, first + shard.tensor.shape[0])
        init.fill_ids(shard.tensor, virtual_id(case, rows))


@torch.no_grad()
def reset_reference_rows(
    case: VirtualCase, ref: DistributedModelParallel, ids: torch.Tensor
) -> None:
    """The reference's side of an eviction: the rows of ``ids`` back to their initial values,
    their optimizer state zero (what the virtual table does to an evicted id trained again)."""
    rows = reference_row(case, ids)
    init = _configs(case, virtual=True)[0].init_fn
    prefix = "embedding_bags" if case.kind == "ebc" else "embeddings"
    key = f"{prefix}.{VIRTUAL}.weight"
    for shard in ref.state_dict()[key].local_shards():
        first, count = int(shard.metadata.shard_offsets[0]), int(shard.tensor.shape[0])
        mine = rows[(rows >= first) & (rows < first + count)]
        values = torch.empty(int(mine.numel()), DIM)
        init.fill_ids(values, virtual_id(case, mine))
        device = shard.tensor.device
        shard.tensor[(mine - first).to(device)] = values.to(device, shard.tensor.dtype)
    for value in ref.fused_optimizer.state_dict()["state"][key].values():
        if not isinstance(value, ShardedTensor):
            continue
        for shard in value.local_shards():
            first, count = int(shard.metadata.shard_offsets[0]), int(shard.tensor.shape[0])
            mine = rows[(rows >= first) & (rows < first + count)]
            shard.tensor[(mine - first).to(shard.tensor.device)] = 0


def virtual_shards(model: nn.Module) -> list[VirtualRows]:
    """This rank's virtual table shards of ``model``."""
    out: list[VirtualRows] = []
    for module in model.modules():
        groups = getattr(module, "tiered_groups", None)
        if callable(groups) and not isinstance(module, DistributedModelParallel):
            out.extend(s.virtual for g in groups() for s in g.shards if s.virtual is not None)
    return out


def batch(case: VirtualCase, rank: int, step: int) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    """This rank's batch of ``step``: over reference rows, and over the virtual ids."""
    g = torch.Generator().manual_seed(case.seed * 100_003 + step * 101 + rank)
    lengths = torch.randint(0, MAX_LEN + 1, (3, BATCH), generator=g)
    counts = lengths.sum(dim=1).tolist()
    ref_ids = [torch.randint(0, REF_ROWS, (counts[i],), generator=g) for i in range(2)]
    ref_ids.append(torch.randint(0, FUSED_ROWS, (counts[2],), generator=g))
    weights = torch.rand(sum(counts), generator=g) if case.weighted else None
    virt_ids = [virtual_id(case, ref_ids[0]), virtual_id(case, ref_ids[1]), ref_ids[2]]

    def kjt(ids: list[torch.Tensor]) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=["f0", "f1", "f2"],
            values=torch.cat(ids),
            lengths=lengths.flatten(),
            weights=weights,
        )

    return kjt(ref_ids), kjt(virt_ids)


def outputs(case: VirtualCase, out: Any) -> torch.Tensor:
    if case.kind == "ebc":
        return out.values()
    return torch.cat([out[f].values() for f in ("f0", "f1", "f2")])


def train_steps(
    model: DistributedModelParallel, case: VirtualCase, steps: range
) -> list[torch.Tensor]:
    """Trains the virtual model on rank 0's batches of ``steps``, a minute of its tables'
    clock each (TTLs are in minutes); returns each step's outputs."""
    clock = [0.0]
    for shard in virtual_shards(model):
        shard.eviction.clock = lambda: clock[0]
    out = []
    for step in steps:
        clock[0] = STEP_SECONDS * step
        _, virt = batch(case, 0, step)
        values = outputs(case, model(virt.to(case.torch_device)))
        values.square().sum().backward()
        out.append(values.detach())
    return out


@dataclass
class VirtualResult:
    case: VirtualCase
    rank: int
    mismatched_step: int | None
    largest_diff: float
    stats: dict[str, dict[str, float]]
    error: str | None = None
    # live ids no training batch brought (an evaluation made rows it should not have)
    untrained_live: int = 0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["case"] = asdict(self.case)
        return d


def run_case(
    case: VirtualCase, rank: int, world_size: int, root: Path, reset_reference: bool = True
) -> VirtualResult:
    ref = build_model(case, world_size, None)
    fill_reference(case, ref)
    tie = build_model(case, world_size, root)
    clock = [0.0]
    shards = _watch(tie, clock)
    chain = case.reload_from == "chain" and case.reload_at > 0
    manager = _chain_manager(tie, root) if chain else None
    mismatched, largest = None, 0.0
    for step in range(case.steps):
        clock[0] = step * STEP_SECONDS
        if manager is not None and case.reload_at - 3 <= step <= case.reload_at:
            manager.save(step)  # the first is full, the others build on it
        if step and step == case.reload_at:
            if manager is not None:
                tie, shards = _restored(case, world_size, root / f"reload{step}", clock, step)
            else:
                tie, shards = _reloaded(case, tie, world_size, root / f"reload{step}", clock, step)
        ref_batch, virt_batch = _on_device(case, batch(case, rank, step))
        b = outputs(case, tie(virt_batch))
        for shard in shards if reset_reference else ():
            assert shard.history is not None
            for record in shard.history:
                if record.batch + shard.batches_before == step + 1:
                    reset_reference_rows(case, ref, torch.from_numpy(record.ids))
        a = outputs(case, ref(ref_batch))
        if case.differ(a, b):
            largest = max(largest, float((a - b).detach().abs().max()))
            mismatched = step if mismatched is None else mismatched
        a.square().sum().backward()
        b.square().sum().backward()
        if case.evaluate_every and (step + 1) % case.evaluate_every == 0:
            a, b = _evaluated(case, rank, step, ref, tie, shards)
            if case.differ(a, b):
                largest = max(largest, float((a - b).abs().max()))
                mismatched = step if mismatched is None else mismatched
    stats = dict(tier_stats(tie).items())
    untrained = _untrained_live(case, world_size, shards)
    return VirtualResult(case, rank, mismatched, largest, stats, untrained_live=untrained)


@torch.no_grad()
def _evaluated(
    case: VirtualCase,
    rank: int,
    step: int,
    ref: DistributedModelParallel,
    tie: DistributedModelParallel,
    shards: Sequence[VirtualRows],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' outputs of an evaluated batch after ``step`` (ids of the reference rows,
    many not trained yet). A round its new ids needed resets the reference as in training."""
    ref_batch, virt_batch = _on_device(case, batch(case, rank, 100_000 + step))
    tie.eval()
    b = outputs(case, tie(virt_batch))
    tie.train()
    for shard in shards:
        assert shard.history is not None
        for record in shard.history:
            if record.batch + shard.batches_before == step + 1:  # again: idempotent
                reset_reference_rows(case, ref, torch.from_numpy(record.ids))
    ref.eval()
    a = outputs(case, ref(ref_batch))
    ref.train()
    return a, b


def _on_device(
    case: VirtualCase, batches: tuple[KeyedJaggedTensor, KeyedJaggedTensor]
) -> tuple[KeyedJaggedTensor, KeyedJaggedTensor]:
    device = case.torch_device
    return batches[0].to(device), batches[1].to(device)


def _untrained_live(case: VirtualCase, world_size: int, shards: Sequence[VirtualRows]) -> int:
    """How many of this rank's live ids no rank's training batch brought."""
    batches = [batch(case, r, step)[1] for r in range(world_size) for step in range(case.steps)]
    trained = torch.cat([torch.cat([b["f0"].values(), b["f1"].values()]) for b in batches])
    untrained = 0
    for shard in shards:
        ids, _ = shard.live()
        untrained += int((~np.isin(ids + shard.space.id_offset, trained.numpy())).sum())
    return untrained


def _watch(model: DistributedModelParallel, clock: list[float]) -> list[VirtualRows]:
    """The model's virtual shards, recording evictions, on the test's clock."""
    shards = virtual_shards(model)
    for shard in shards:
        shard.record_evictions()
        shard.eviction.clock = lambda: clock[0]
    return shards


def _reloaded(
    case: VirtualCase,
    model: DistributedModelParallel,
    world_size: int,
    root: Path,
    clock: list[float],
    step: int,
) -> tuple[DistributedModelParallel, list[VirtualRows]]:
    """A new virtual model loaded from ``model``'s state (module and optimizer), watched as
    ``model`` was; evictions it records count from ``step``."""
    state, optim = model.state_dict(), model.fused_optimizer.state_dict()
    fresh = build_model(case, world_size, root)
    shards = _watch(fresh, clock)
    if case.optimizer_first:
        fresh.fused_optimizer.load_state_dict(optim)
        fresh.load_state_dict(state)
    else:
        fresh.load_state_dict(state)
        fresh.fused_optimizer.load_state_dict(optim)
    for shard in shards:
        shard.batches_before = step  # its group counts batches from 1 again
    return fresh, shards


def _chain_manager(model: DistributedModelParallel, root: Path) -> CheckpointManager:
    options = CheckpointOptions(full_every=4, keep=None)
    return CheckpointManager(root / "chain", model, model.fused_optimizer, options)


def _restored(
    case: VirtualCase, world_size: int, root: Path, clock: list[float], step: int
) -> tuple[DistributedModelParallel, list[VirtualRows]]:
    """A new virtual model restored from the chain saved up to ``step`` (see
    :func:`_chain_manager`), watched as :func:`_reloaded`'s."""
    fresh = build_model(case, world_size, root)
    shards = _watch(fresh, clock)
    link = _chain_manager(fresh, root.parent).restore()
    assert link is not None and link.step == step and link.parent is not None, link
    for shard in shards:
        shard.batches_before = step
    return fresh, shards


def _rank_main(
    rank: int, world_size: int, port: int, cases: Sequence[VirtualCase], root: str, out: str
) -> None:
    torch.set_num_threads(1)
    with process_group(
        backend="gloo",
        rank=rank,
        world_size=world_size,
        port=port,
        timeout=timedelta(seconds=RANK_TIMEOUT_S),
    ):
        results: list[dict[str, Any]] = []
        try:
            for i, case in enumerate(cases):
                try:
                    results.append(run_case(case, rank, world_size, Path(root) / f"c{i}").as_dict())
                except Exception:
                    results.append(
                        VirtualResult(case, rank, None, 0.0, {}, traceback.format_exc()).as_dict()
                    )
                    break
        finally:
            torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def spawn_cases(
    cases: Sequence[VirtualCase], world_size: int, root: Path
) -> list[list[dict[str, Any]]]:
    """Runs ``cases`` on ``world_size`` spawned gloo ranks; per rank, their results in order."""
    out = tempfile.mkdtemp(dir=root)
    tiers = tempfile.mkdtemp(dir=root)  # this job's own: a sweep spawns many jobs in one root
    mp.spawn(
        _rank_main,
        args=(world_size, free_port(), list(cases), tiers, out),
        nprocs=world_size,
        join=True,
    )
    return [
        torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)
    ]
