"""Quality-parity harness: a model with a tiered table trained side by side with TorchRec's FUSED
kernel on the same initial weights, ids and optimizer.

Each :class:`ParityCase` builds two ``DistributedModelParallel`` models over the same two tables:

* ``t_tier``: fed by two features (so one table serves several features), on the case's tier
  behind a cache of the case's size in the tiered model, on the FUSED kernel in the reference;
* ``t_fused``: one feature, on the FUSED kernel in both models (a mixed plan: a tiered table
  next to a FUSED one in the same sharded module).

The tiered model loads the reference's state dict, both train for ``STEPS`` steps on the same
per-rank batches, and :func:`run_case` returns the largest absolute difference of every local
shard of weights and optimizer state, with the tiered tables' statistics.

Used in process at world size 1 and inside spawned ranks at world size 2 (see
:func:`spawn_cases`); it only uses the public tier registry, so it runs on the real tiers.
"""

from __future__ import annotations

import math
import os
import tempfile
import traceback
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

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
from torchrec_mtrains.pipeline import tier_stats
from torchrec_mtrains.tiers import TIERS, resolve_options

STEPS = 50
BATCH = 8
MAX_LEN = 3  # ids per feature per sample: 0 .. MAX_LEN
LEARNING_RATE = 0.05
TOLERANCE = 1e-6

TIERED_TABLE = "t_tier"
FUSED_TABLE = "t_fused"
DIM = 8
# (name, rows, features); EmbeddingCollection needs one dim for all tables.
TABLES = ((TIERED_TABLE, 96, ("f0", "f1")), (FUSED_TABLE, 40, ("f2",)))
FEATURES = tuple(f for _, _, feats in TABLES for f in feats)
ROWS = {name: rows for name, rows, _ in TABLES}

OPTIMIZERS = {
    "sgd": OptimType.EXACT_SGD,
    "adagrad": OptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": OptimType.EXACT_ROWWISE_ADAGRAD,
}
KINDS = ("ebc", "ec")
SHARDINGS = ("table_wise", "column_wise", "row_wise")
CPU = torch.device("cpu")
CACHE_SIZES = ("min", "mid", "full")


@dataclass(frozen=True)
class ParityCase:
    """One configuration of the parity matrix.

    Args:
        kind: ``ebc`` (pooled, EmbeddingBagCollection) or ``ec`` (sequence, EmbeddingCollection).
        optimizer: a key of :data:`OPTIMIZERS`.
        sharding: ``table_wise``, ``column_wise`` or ``row_wise``.
        tier: tier name in the registry.
        cache: ``min`` (the largest unique-id count of one batch on a shard), ``mid`` or
            ``full`` (the whole shard).
        seed: seeds the batches.
        policy: the cache's eviction policy.
        device: where both models compute (``cpu`` or ``cuda``); the tiered table's cache
            lives there, its rows on the tier.
        other_kernel: TorchRec's kernel for ``t_fused`` in both models (``fused``, or
            ``fused_uvm_caching`` on CUDA): a tiered table beside each of TorchRec's kernels.
    """

    kind: str
    optimizer: str
    sharding: str
    tier: str
    cache: str
    seed: int = 0
    policy: str = "lru"
    device: str = "cpu"
    other_kernel: str = "fused"

    @property
    def id(self) -> str:
        name = f"{self.kind}-{self.sharding}-{self.optimizer}-{self.tier}-{self.cache}"
        extras = [self.policy if self.policy != "lru" else ""]
        extras += [self.device if self.device != "cpu" else ""]
        extras += [self.other_kernel if self.other_kernel != "fused" else ""]
        return "-".join([name, *(e for e in extras if e)])

    @property
    def placed_tier(self) -> str:
        """The placement tier of the case's store (``log_block_scm`` serves ``block_scm``)."""
        return TIERS[self.tier].serves_tier

    @property
    def torch_device(self) -> torch.device:
        if self.device == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device)


# ------------------------------------------------------------------------------ batches


def batch_ids(seed: int, rank: int, step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``(lengths, ids)`` per feature of rank ``rank``'s batch number ``step``; ids are skewed
    toward low rows so batches share rows (cache hits) while still evicting."""
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * rank + step)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for table, rows, features in TABLES:
        for feature in features:
            lengths = torch.randint(0, MAX_LEN + 1, (BATCH,), generator=g)
            u = torch.rand(int(lengths.sum()), generator=g)
            ids = (u * u * rows).long().clamp_(max=rows - 1)
            out[feature] = (lengths, ids)
        del table
    return out


def make_kjt(batch: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=list(FEATURES),
        values=torch.cat([batch[f][1] for f in FEATURES]),
        lengths=torch.cat([batch[f][0] for f in FEATURES]),
    )


def table_ids(seed: int, world_size: int, step: int, table: str) -> torch.Tensor:
    """Every id of ``table`` that any rank looks up at ``step``."""
    features = next(feats for name, _, feats in TABLES if name == table)
    parts = [batch_ids(seed, r, step)[f][1] for r in range(world_size) for f in features]
    return torch.cat(parts)


# ------------------------------------------------------------------------------- plans


def row_ranges(sharding: str, rows: int, world_size: int) -> list[tuple[int, int]]:
    """Row range ``[lo, hi)`` of each shard of a table (one per column shard for CW)."""
    if sharding == "row_wise":
        per = math.ceil(rows / world_size)
        return [(r * per, min(rows, (r + 1) * per)) for r in range(world_size)]
    return [(0, rows)]


def min_cache_rows(seed: int, world_size: int, sharding: str) -> list[tuple[int, int]]:
    """Per row shard of the tiered table: ``(local rows, most unique ids of one step)``.

    A shard sees the ids of every rank's batch that fall in its rows (TorchRec's input
    distribution routes them to it), so this is the smallest cache that holds one batch."""
    return [
        (hi - lo, shard_expectations(seed, world_size, lo, hi)[2])
        for lo, hi in row_ranges(sharding, ROWS[TIERED_TABLE], world_size)
    ]


def shard_expectations(seed: int, world_size: int, lo: int, hi: int) -> tuple[int, int, int]:
    """For the tiered table's rows ``[lo, hi)``: the unique ids summed over the steps (what the
    shard's cache must count as lookups), the distinct ids over all steps (rows it must read at
    least once) and the most unique ids of one step (the smallest cache that works)."""
    lookups, need, seen = 0, 0, torch.zeros(0, dtype=torch.int64)
    for step in range(STEPS):
        ids = table_ids(seed, world_size, step, TIERED_TABLE)
        unique = torch.unique(ids[(ids >= lo) & (ids < hi)])
        lookups += int(unique.numel())
        need = max(need, int(unique.numel()))
        seen = torch.unique(torch.cat([seen, unique]))
    return lookups, int(seen.numel()), need


def cache_load_factor(case: ParityCase, world_size: int) -> tuple[float, list[int]]:
    """The case's load factor and the cache rows it gives each row shard.

    ``min`` makes the tightest shard's cache exactly its largest batch (rows = ceil(f * local
    rows), so ``f = (need - 0.5) / rows`` lands on ``need``); the others get at least theirs."""
    shards = min_cache_rows(case.seed, world_size, case.sharding)
    if case.cache == "full":
        factor = 1.0
    elif case.cache == "min":
        factor = max((need - 0.5) / rows for rows, need in shards)
    elif case.cache == "mid":
        factor = max(((need + rows) / 2 - 0.5) / rows for rows, need in shards)
    else:
        raise ValueError(f"unknown cache size {case.cache!r}")
    options = TieredTableOptions(tier=case.placed_tier, cache_load_factor=factor)
    sizes = [options.cache_rows(rows) for rows, _ in shards]
    for size, (rows, need) in zip(sizes, shards):
        assert need <= size <= rows, (case, size, rows, need)
    return factor, sizes


def _generator(sharding: str, world_size: int, table: str, kernel: str) -> Any:
    if sharding == "table_wise":
        # At world size 2 the tiered table lives on rank 1, fed by rank 0's batch too.
        rank = 1 if world_size > 1 and table == TIERED_TABLE else 0
        return table_wise(rank=rank, compute_kernel=kernel)
    if sharding == "column_wise":
        ranks = [0, 0] if world_size == 1 else list(range(world_size))
        return column_wise(ranks=ranks, compute_kernel=kernel)
    if sharding == "row_wise":
        return row_wise(compute_kernel=kernel)
    raise ValueError(f"unknown sharding {sharding!r}")


def make_module(kind: str) -> nn.Module:
    if kind == "ebc":
        return EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name=name, embedding_dim=DIM, num_embeddings=rows, feature_names=list(feats)
                )
                for name, rows, feats in TABLES
            ],
            device=torch.device("meta"),
        )
    return EmbeddingCollection(
        tables=[
            EmbeddingConfig(
                name=name, embedding_dim=DIM, num_embeddings=rows, feature_names=list(feats)
            )
            for name, rows, feats in TABLES
        ],
        device=torch.device("meta"),
    )


def fused_params(optimizer: str) -> dict[str, Any]:
    return {"optimizer": OPTIMIZERS[optimizer], "learning_rate": LEARNING_RATE}


def build_model(
    case: ParityCase, world_size: int, storage: TierStorage | None
) -> DistributedModelParallel:
    """The case's model: with ``storage``, the tiered one (its tiered table on the case's tier
    with the case's cache size); without, the FUSED reference (stock sharders)."""
    fp = fused_params(case.optimizer)
    sharder: ModuleSharder[nn.Module]
    if storage is None:
        sharder = (
            EmbeddingBagCollectionSharder(fused_params=fp)
            if case.kind == "ebc"
            else EmbeddingCollectionSharder(fused_params=fp)
        )
    elif case.kind == "ebc":
        sharder = TieredEmbeddingBagCollectionSharder(storage, fused_params=fp)
    else:
        sharder = TieredEmbeddingCollectionSharder(storage, fused_params=fp)
    tiered = storage is not None
    kernels = {FUSED_TABLE: case.other_kernel, TIERED_TABLE: "fused"}
    if tiered:
        kernels[TIERED_TABLE] = TIERED_KERNEL
    gens = {
        name: _generator(case.sharding, world_size, name, kernels[name]) for name, _, _ in TABLES
    }
    plan = construct_module_sharding_plan(
        make_module(case.kind),
        gens,
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type=case.torch_device.type,
    )
    if tiered:
        factor, _ = cache_load_factor(case, world_size)
        options = TieredTableOptions(
            tier=case.placed_tier, cache_load_factor=factor, cache_policy=case.policy
        )
        plan[TIERED_TABLE] = TieredParameterSharding.wrap(plan[TIERED_TABLE], options)
    torch.manual_seed(1234)
    return DistributedModelParallel(
        make_module(case.kind),
        device=case.torch_device,
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],
    )


def tier_storage(store: str, root: Path, **kwargs: Any) -> TierStorage:
    """Tier files under ``root``, the tier ``store`` serves kept by ``store`` (for
    ``log_block_scm``: the block tier in its log layout)."""
    placed = TIERS[store].serves_tier
    return TierStorage(root=str(root), tier_options={placed: resolve_options(store)}, **kwargs)


def build_models(
    case: ParityCase, world_size: int, root: Path
) -> tuple[DistributedModelParallel, DistributedModelParallel, list[int]]:
    """The FUSED reference (initial weights :func:`global_weights`) and the tiered model (tier
    files under ``root``) loaded from it, and the planned cache rows of each row shard of the
    tiered table."""
    ref = build_model(case, world_size, None)
    set_weights(ref, global_weights(case.seed))
    tie = build_model(case, world_size, tier_storage(case.tier, root))
    tie.load_state_dict(ref.state_dict())
    return ref, tie, cache_load_factor(case, world_size)[1]


def global_weights(seed: int) -> dict[str, torch.Tensor]:
    """The whole tables' initial weights, the same on every rank."""
    g = torch.Generator().manual_seed(10_007 + seed)
    return {name: torch.randn(rows, DIM, generator=g) * 0.1 for name, rows, _ in TABLES}


@torch.no_grad()
def set_weights(model: DistributedModelParallel, weights: dict[str, torch.Tensor]) -> None:
    """Writes ``weights`` into the local shards of ``model`` (TorchRec's state-dict shards view
    the fused kernel's weights)."""
    for key, value in model.state_dict().items():
        table = key.split(".")[-2]
        for off, size, tensor in regions(value):
            tensor.copy_(weights[table][off[0] : off[0] + size[0], off[1] : off[1] + size[1]])
    for key, value in model.state_dict().items():
        table = key.split(".")[-2]
        for off, size, tensor in regions(value):
            want = weights[table][off[0] : off[0] + size[0], off[1] : off[1] + size[1]]
            assert torch.equal(tensor.cpu(), want), f"{key}: state-dict shards are not live views"


def unsharded_outputs(kind: str, seed: int, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """Per feature, what the unsharded module computes on the CPU from :func:`global_weights`.
    Pass the batch as built on the CPU: torchrec 1.6.1's ``KeyedJaggedTensor.to`` copies the
    cached per-feature dict of a batch that was already split, so a CUDA batch moved to the CPU
    still hands EBC its CUDA ids."""
    module = make_module(kind).to_empty(device=torch.device("cpu"))
    weights = global_weights(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            param.copy_(weights[name.split(".")[-2]])
    return per_feature(kind, module(kjt.to("cpu")))


# ------------------------------------------------------------------------------ training


_COEF = torch.linspace(-1.0, 1.0, DIM)


def per_feature(kind: str, out: Any) -> dict[str, torch.Tensor]:
    """A model's output as one tensor per feature: pooled ``(batch, dim)`` for EBC, the
    sequence's ``(ids, dim)`` values for EC."""
    if hasattr(out, "wait"):
        out = out.wait()
    if kind == "ebc":
        return dict(out.to_dict())
    return {feature: out[feature].values() for feature in FEATURES}


def loss_of(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """A loss whose gradient depends on the current weights, so a wrong row moves later steps."""
    total = torch.zeros((), device=outputs[FEATURES[0]].device)
    for feature in FEATURES:
        v = outputs[feature]
        total = total + (v * _COEF.to(v.device) + 0.5 * v * v).sum()
    return total


def train(
    model: DistributedModelParallel,
    kind: str,
    seed: int,
    rank: int,
    device: torch.device = CPU,
) -> float:
    """Trains ``STEPS`` steps; returns how far the first step's output was from the unsharded
    module's (max abs difference), a check of the whole sharded path independent of FUSED."""
    first = 0.0
    for step in range(STEPS):
        host_kjt = make_kjt(batch_ids(seed, rank, step))
        outputs = per_feature(kind, model(host_kjt.to(device)))
        if step == 0:
            expected = unsharded_outputs(kind, seed, host_kjt)
            with torch.no_grad():
                first = max(float((outputs[f].cpu() - expected[f]).abs().max()) for f in FEATURES)
        loss_of(outputs).backward()
    return first


# ----------------------------------------------------------------------------- comparing


def regions(value: Any) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """``(offsets, sizes, tensor)`` of each local shard of ``value`` (a plain tensor: one)."""
    if isinstance(value, ShardedTensor):
        return [
            (list(s.metadata.shard_offsets), list(s.metadata.shard_sizes), s.tensor)
            for s in value.local_shards()
        ]
    assert isinstance(value, torch.Tensor), type(value)
    return [([0] * value.dim(), list(value.shape), value)]


def assembled_pairs(ref: Any, tie: Any) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Per local shard of ``ref``: it (as float64 on the CPU) and what ``tie``'s local shards,
    which may be split into other chunks, hold over the same region. Raises when ``tie`` holds
    other elements or lacks part of a shard."""
    ref_regions, tie_regions = regions(ref), regions(tie)
    ref_elems = sum(math.prod(sizes) for _, sizes, _ in ref_regions)
    tie_elems = sum(math.prod(sizes) for _, sizes, _ in tie_regions)
    if ref_elems != tie_elems:
        raise AssertionError(f"local elements differ: reference {ref_elems}, tiered {tie_elems}")
    for off, size, tensor in ref_regions:
        got = torch.full(size, float("nan"), dtype=torch.float64)
        for t_off, t_size, t_tensor in tie_regions:
            lo = [max(a, b) for a, b in zip(off, t_off)]
            hi = [min(a + n, b + m) for a, n, b, m in zip(off, size, t_off, t_size)]
            if any(h <= low for low, h in zip(lo, hi)):
                continue
            dst = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, off))
            src = tuple(slice(low - o, h - o) for low, h, o in zip(lo, hi, t_off))
            got[dst] = t_tensor[src].to(CPU, torch.float64)
        if bool(torch.isnan(got).any()):
            raise AssertionError(f"tiered model lacks part of the local shard at {off}")
        yield tensor.to(CPU, torch.float64), got


def local_diff(ref: Any, tie: Any) -> float:
    """Largest |ref - tie| over this rank's shards of ``ref`` (see :func:`assembled_pairs`)."""
    worst = 0.0
    for want, got in assembled_pairs(ref, tie):
        if want.numel():
            worst = max(worst, float((want - got).abs().max()))
    return worst


def compare_optimizer(
    ref: DistributedModelParallel, tie: DistributedModelParallel
) -> dict[str, float]:
    """Max abs difference per optimizer state on this rank."""
    diffs: dict[str, float] = {}
    oa = ref.fused_optimizer.state_dict()["state"]
    ob = tie.fused_optimizer.state_dict()["state"]
    if set(oa) != set(ob):
        raise AssertionError(f"optimizer state keys differ: {sorted(oa)} vs {sorted(ob)}")
    for param in oa:
        if set(oa[param]) != set(ob[param]):
            raise AssertionError(f"{param}: states {sorted(oa[param])} vs {sorted(ob[param])}")
        for key in oa[param]:
            diffs[f"optim:{key}"] = local_diff(oa[param][key], ob[param][key])
    return diffs


def compare_weights(
    ref: DistributedModelParallel, tie: DistributedModelParallel
) -> dict[str, float]:
    """Max abs difference per table's weights on this rank."""
    a, b = ref.state_dict(), tie.state_dict()
    if set(a) != set(b):
        raise AssertionError(f"state dict keys differ: {sorted(a)} vs {sorted(b)}")
    return {key: local_diff(a[key], b[key]) for key in a}


def compare(ref: DistributedModelParallel, tie: DistributedModelParallel) -> dict[str, float]:
    """Max abs difference per weight and per optimizer state on this rank.

    The optimizer state is read first, as a checkpoint of the optimizer alone would: it must
    include the updates still held in the cache (``model.state_dict()`` flushes the cache)."""
    return {**compare_optimizer(ref, tie), **compare_weights(ref, tie)}


def tiered_shards_here(
    case: ParityCase, world_size: int, model: nn.Module, planned: list[int]
) -> dict[str, dict[str, int]]:
    """Per tiered table shard on this rank (keyed as in its statistics): its rows, cache slots,
    the slots the case planned for it and the lookups and distinct rows the batches imply."""
    ranges = row_ranges(case.sharding, ROWS[TIERED_TABLE], world_size)
    out: dict[str, dict[str, int]] = {}
    for module in model.modules():
        groups = getattr(module, "tiered_groups", None)
        if not callable(groups):
            continue
        for group in groups():
            for key, shard in zip(list(group.stats()), group.shards):
                lo, hi = shard.row_offset, shard.row_offset + shard.local_rows
                lookups, distinct, need = shard_expectations(case.seed, world_size, lo, hi)
                out[key] = {
                    "rows": shard.local_rows,
                    "slots": shard.cache.num_slots,
                    "planned_slots": planned[ranges.index((lo, hi))],
                    "lookups": lookups,
                    "distinct": distinct,
                    "need": need,
                }
    return out


def kernel_names(model: nn.Module) -> list[str]:
    """Class names of the embedding kernels on this rank (tiered and TorchRec's)."""
    names = []
    for module in model.modules():
        for lookup in getattr(module, "_lookups", []):
            for kernel in getattr(lookup, "_emb_modules", []):
                names.append(type(kernel).__name__)
    return sorted(names)


@dataclass
class CaseResult:
    case: ParityCase
    rank: int
    diffs: dict[str, float]
    stats: dict[str, dict[str, float]]
    shards: dict[str, dict[str, int]]
    kernels: list[str]
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_case(case: ParityCase, rank: int, world_size: int, root: Path) -> CaseResult:
    ref, tie, planned = build_models(case, world_size, root)
    device = case.torch_device
    diffs = {
        "first_output_reference_vs_unsharded": train(ref, case.kind, case.seed, rank, device),
        "first_output_tiered_vs_unsharded": train(tie, case.kind, case.seed, rank, device),
    }
    diffs.update(compare(ref, tie))
    return CaseResult(
        case=case,
        rank=rank,
        diffs=diffs,
        stats=tier_stats(tie),
        shards=tiered_shards_here(case, world_size, tie, planned),
        kernels=kernel_names(tie),
    )


# --------------------------------------------------------------------- process groups


def _rank_main(
    rank: int, world_size: int, port: int, cases: Sequence[ParityCase], root: str, out: str
) -> None:
    torch.set_num_threads(1)
    with process_group(
        backend="gloo", rank=rank, world_size=world_size, port=port, timeout=timedelta(seconds=120)
    ):
        results: list[dict[str, Any]] = []
        try:
            for i, case in enumerate(cases):
                case_root = Path(root) / f"case{i}"
                try:
                    results.append(run_case(case, rank, world_size, case_root).as_dict())
                except Exception:
                    # Ranks run the same cases in the same order; after a failure the process group
                    # may be out of step, so the remaining cases are reported as not run.
                    results.append(
                        CaseResult(case, rank, {}, {}, {}, [], traceback.format_exc()).as_dict()
                    )
                    break
        finally:
            torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def spawn_cases(
    cases: Iterable[ParityCase], world_size: int, root: Path
) -> list[dict[str, dict[str, Any]]]:
    """Runs ``cases`` in one spawned job of ``world_size`` gloo ranks; returns per rank the
    results (:meth:`CaseResult.as_dict`) by case id. Cases that did not run (after a failure
    on the rank) are absent."""
    cases = list(cases)
    out = tempfile.mkdtemp(dir=root)
    mp.spawn(
        _rank_main,
        args=(world_size, free_port(), cases, str(root), out),
        nprocs=world_size,
        join=True,
    )
    per_rank = []
    for rank in range(world_size):
        results = torch.load(os.path.join(out, f"rank{rank}.pt"), weights_only=False)
        per_rank.append({ParityCase(**r["case"]).id: r for r in results})
    return per_rank
