"""Configurations of the randomized parity sweep: what a case is, how one is drawn, its batches.

A :class:`SweepCase` is everything that decides a run: the module (EBC or EC, weighted, pooling,
variable batch per feature), its tables (rows, dim, features, placement, sharding, cache size,
policy, pinned hot rows), the optimizer, the training loop and the batches' seed. It round-trips
through one line of JSON (:meth:`SweepCase.to_line`), which is what a failure prints so that
``python -m tests.parity.sweep --case '<line>'`` runs it again.

:func:`draw_case` draws a case from a seeded ``random.Random`` over the axes TorchRec offers on
CPU (it never draws what TorchRec's own FUSED kernel refuses, e.g. EC tables of different dims,
or VBE with plain Adagrad). :func:`make_batch` builds a rank's batch of a step from the case
alone, and :func:`cache_rows_needed` the smallest cache each tiered shard can train with.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

FUSED = "fused"
# Where a table can live: TorchRec's FUSED kernel, or a tier (the block tier in either layout,
# chosen per case: the layout is a property of the host's block tier, not of a table).
TIERS = ("dram", "byte_scm", "block_scm")
# Table-row-wise is not drawn: TorchRec's EBC refuses it on CPU ("Sharding not supported").
SHARDINGS = ("table_wise", "column_wise", "row_wise")
OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
VBE_OPTIMIZERS = ("sgd", "rowwise_adagrad")  # fbgemm runs VBE with these only
LOOPS = (
    "plain",
    "lookahead",
    "torchrec",
)  # look-ahead 0, 2, and TorchRec's TrainPipelineSparseDist
LOOKAHEAD = 2
MAX_ROWS = 100_000


@dataclass(frozen=True)
class TableDraw:
    """One table of a case.

    Attributes:
        name / rows / dim / features: the table's config (a feature may be shared by tables).
        placement: ``fused`` or a tier name.
        sharding: one of :data:`SHARDINGS`.
        rank: the table's rank under table-wise sharding.
        cache: the cache between the smallest that trains (0) and the whole shard (1).
        policy: the cache's eviction policy.
        hot_rows: how many of the table's hottest rows (the lowest ids) are pinned.
    """

    name: str
    rows: int
    dim: int
    features: tuple[str, ...]
    placement: str = FUSED
    sharding: str = "table_wise"
    rank: int = 0
    cache: float = 1.0
    policy: str = "lru"
    hot_rows: int = 0

    @property
    def tiered(self) -> bool:
        return self.placement != FUSED


@dataclass(frozen=True)
class SweepCase:
    """One configuration of the sweep (see the module docstring)."""

    kind: str = "ebc"
    weighted: bool = False
    pooling: str = "sum"
    vbe: bool = False
    optimizer: str = "rowwise_adagrad"
    loop: str = "plain"
    world_size: int = 1
    block_layout: str = "flat"
    batch: int = 4
    max_ids: int = 3
    steps: int = 6
    seed: int = 0
    tables: tuple[TableDraw, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        tables = tuple(t if isinstance(t, TableDraw) else TableDraw(**t) for t in self.tables)
        object.__setattr__(
            self, "tables", tuple(replace(t, features=tuple(t.features)) for t in tables)
        )

    @property
    def features(self) -> list[str]:
        """Every feature once, in the order the module's tables first read them."""
        out: list[str] = []
        for table in self.tables:
            out.extend(f for f in table.features if f not in out)
        return out

    @property
    def lookahead(self) -> int:
        return LOOKAHEAD if self.loop == "lookahead" else 0

    @property
    def pattern(self) -> str:
        """Placement in module order, ``T`` tiered and ``F`` resident (e.g. ``TFT``)."""
        return "".join("T" if t.tiered else "F" for t in self.tables)

    def feature_rows(self, feature: str) -> int:
        """Ids of ``feature`` must fit every table that reads it."""
        return min(t.rows for t in self.tables if feature in t.features)

    def to_line(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_line(cls, line: str) -> SweepCase:
        data: dict[str, Any] = json.loads(line)
        return cls(**data)

    def describe(self) -> str:
        """A short summary for logs: module, pattern, loop, world size."""
        module = self.kind + ("-weighted" if self.weighted else "") + ("-vbe" if self.vbe else "")
        shardings = "/".join(sorted({t.sharding for t in self.tables}))
        return (
            f"{module} {self.pattern} {shardings} {self.optimizer} {self.loop} "
            f"w{self.world_size} seed {self.seed}"
        )


# ------------------------------------------------------------------------------- drawing


def _rows(rng: random.Random, max_rows: int) -> int:
    return max(1, round(math.exp(rng.uniform(0.0, math.log(max_rows)))))


def _hot_rows(rng: random.Random, rows: int, sharding: str, world_size: int) -> int:
    """Pinned rows of a table: none, or up to 16 of its lowest ids, leaving every shard a slot
    for the batches (a row-wise shard holds the first ``ceil(rows / world)`` rows)."""
    shard_rows = math.ceil(rows / world_size) if sharding == "row_wise" else rows
    if shard_rows < 2 or rng.random() < 0.6:
        return 0
    return rng.randint(1, min(shard_rows - 1, 16))


def draw_case(
    rng: random.Random, seed: int, world_size: int, max_rows: int = MAX_ROWS
) -> SweepCase:
    """A random case at ``world_size``: every axis of :class:`SweepCase` drawn from ``rng``."""
    kind = rng.choice(("ebc", "ec"))
    ebc = kind == "ebc"
    optimizer = rng.choice(OPTIMIZERS)
    vbe = ebc and optimizer in VBE_OPTIMIZERS and rng.random() < 0.25
    n_tables = rng.randint(1, 8)
    ec_dim = rng.choice((8, 16, 24))  # EC tables share one dim (a multiple of 8: CW splits it)
    names = [f"t{i}" for i in range(n_tables)]
    rng.shuffle(names)  # table names do not follow module order
    tables: list[TableDraw] = []
    next_feature = 0
    for name in names:
        n_features = rng.choice((1, 1, 1, 2, 3))
        features: list[str] = []
        for _ in range(n_features):
            shared = [f for t in tables for f in t.features if f not in features]
            if shared and rng.random() < 0.2:
                features.append(rng.choice(shared))  # a feature read by two tables
            else:
                features.append(f"f{next_feature}")
                next_feature += 1
        dim = ec_dim if not ebc else 4 * rng.randint(1, 8)
        placement = rng.choice((FUSED, FUSED, *TIERS))
        shardings = list(SHARDINGS)
        if vbe and world_size > 1:
            # TorchRec's row-wise VBE gathers uneven tensors, which gloo refuses.
            shardings.remove("row_wise")
        if dim % 8:
            shardings.remove("column_wise")  # column shards must be multiples of 4 wide
        sharding = rng.choice(shardings)
        rows = _rows(rng, max_rows)
        if sharding == "row_wise":
            rows = max(rows, world_size)
        tables.append(
            TableDraw(
                name=name,
                rows=rows,
                dim=dim,
                features=tuple(features),
                placement=placement,
                sharding=sharding,
                rank=rng.randrange(world_size),
                cache=rng.choice((0.0, 0.0, rng.random(), 1.0)),
                policy=rng.choice(("lru", "lfu")),
                hot_rows=_hot_rows(rng, rows, sharding, world_size),
            )
        )
    return SweepCase(
        kind=kind,
        weighted=ebc and rng.random() < 0.3,
        pooling=rng.choice(("sum", "mean")) if ebc else "sum",
        vbe=vbe,
        optimizer=optimizer,
        loop=rng.choice(LOOPS),
        world_size=world_size,
        block_layout=rng.choice(("flat", "log")),
        batch=rng.choice((1, 2, 4, 8)),
        max_ids=rng.choice((0, 1, 3, 5)),
        steps=rng.randint(3, 8),
        seed=seed,
        tables=tuple(tables),
    )


# ------------------------------------------------------------------------------- batches


def make_batch(case: SweepCase, rank: int, step: int) -> Batch:
    """Rank ``rank``'s batch of ``step``: per feature 0 .. ``max_ids`` ids a sample (some
    features empty), skewed toward low rows, the first and the last row of the feature's
    tables among them now and then; per-sample weights for a weighted EBC; with VBE, each
    feature its own batch size and inverse indices back to the batch."""
    g = torch.Generator().manual_seed(1_000_003 * case.seed + 7919 * rank + step)
    keys = case.features
    strides = [
        int(torch.randint(1, case.batch + 1, (1,), generator=g)) if case.vbe else case.batch
        for _ in keys
    ]
    lengths, values = [], []
    for key, stride in zip(keys, strides):
        rows = case.feature_rows(key)
        empty = bool(torch.rand(1, generator=g) < 0.15)
        n = torch.randint(0, case.max_ids + 1, (stride,), generator=g) * (0 if empty else 1)
        u = torch.rand(int(n.sum()), generator=g)
        ids = (u * u * u * rows).long().clamp_(max=rows - 1)
        if ids.numel() >= 2 and bool(torch.rand(1, generator=g) < 0.5):
            ids[0], ids[-1] = 0, rows - 1
        lengths.append(n)
        values.append(ids)
    all_values = torch.cat(values)
    weights = torch.rand(all_values.numel(), generator=g) if case.weighted else None
    if case.vbe:
        inverse = torch.stack(
            [torch.randint(0, s, (case.batch,), generator=g) for s in strides]
        ).to(torch.int64)
        kjt = KeyedJaggedTensor(
            keys=keys,
            values=all_values,
            lengths=torch.cat(lengths),
            weights=weights,
            stride_per_key_per_rank=[[s] for s in strides],
            inverse_indices=(keys, inverse),
        )
    else:
        kjt = KeyedJaggedTensor(
            keys=keys, values=all_values, lengths=torch.cat(lengths), weights=weights
        )
    return Batch(
        dense_features=torch.zeros(case.batch, 1),
        sparse_features=kjt,
        labels=torch.zeros(case.batch),
    )


def _feature_ids(case: SweepCase, batch: Batch) -> dict[str, torch.Tensor]:
    kjt = batch.sparse_features
    return {key: kjt[key].values() for key in kjt.keys()}  # noqa: SIM118 (a KJT is not a dict)


# ------------------------------------------------------------------------------ caches


def shard_row_ranges(case: SweepCase, table: TableDraw) -> list[tuple[int, int]]:
    """Row range ``[lo, hi)`` of each of the table's shards that has its own cache (one per
    rank under row-wise sharding; column shards all see every row)."""
    if table.sharding == "row_wise":
        per = math.ceil(table.rows / case.world_size)
        return [(r * per, min(table.rows, (r + 1) * per)) for r in range(case.world_size)]
    return [(0, table.rows)]


def cache_rows_needed(case: SweepCase, table: TableDraw) -> list[tuple[int, int]]:
    """Per row shard of a tiered ``table``: ``(local rows, smallest cache that trains)``.

    A shard sees every rank's ids in its rows (TorchRec's input distribution routes them
    there). With look-ahead ``k``, ``k + 1`` batches hold their rows at once; pinned hot rows
    hold theirs for good, and pinning needs one slot to spare."""
    window = case.lookahead + 1
    ids_per_step = []
    for step in range(case.steps):
        parts = [
            ids
            for rank in range(case.world_size)
            for key, ids in _feature_ids(case, make_batch(case, rank, step)).items()
            if key in table.features
        ]
        ids_per_step.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
    out = []
    for lo, hi in shard_row_ranges(case, table):
        hot = torch.arange(min(table.hot_rows, table.rows))
        hot = hot[(hot >= lo) & (hot < hi)]
        need = max(int(hot.numel()) + 1, 1) if hot.numel() else 1
        for first in range(case.steps):
            ids = torch.cat([hot, *ids_per_step[first : first + window]])
            ids = ids[(ids >= lo) & (ids < hi)]
            need = max(need, int(torch.unique(ids).numel()))
        out.append((hi - lo, min(need, hi - lo)))
    return out


def cache_load_factor(case: SweepCase, table: TableDraw) -> float:
    """The factor giving each shard of ``table`` at least its drawn cache size: ``cache`` of
    the way from the smallest cache that trains to the whole shard."""
    factor = 0.0
    for rows, need in cache_rows_needed(case, table):
        if rows == 0:
            continue
        target = need + table.cache * (rows - need)
        factor = max(factor, (math.ceil(target) - 0.5) / rows)
    return min(1.0, max(factor, 1e-9))
