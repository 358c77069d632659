"""Configurations of the randomized parity sweep: what a case is, how one is drawn, its batches.

A :class:`SweepCase` is everything that decides a run: the module (EBC or EC, weighted, pooling,
variable batch per feature), its tables (rows, dim, features, placement, sharding, cache size,
policy, pinned hot rows), the tables' data type, the optimizer, the training loop, the batches'
seed, and what is done to the model's state between training steps (:data:`OPS`: writes into
the state dict in place, learning-rate changes, checkpoints saved and loaded into the same model
or a fresh one at the same or another world size). It round-trips through one line of JSON
(:meth:`SweepCase.to_line`), which is what a failure prints so that
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
DTYPES = ("fp32", "fp16")  # what TorchRec's FUSED kernel trains on the CPU

OPS = ("train", "write", "lr", "save", "load")
"""What a case's schedule does, one op a string (``ops``):

* ``train:K``: K training steps in the case's loop (a pipeline runs them and is done);
* ``write:SEED:PART``: take ``state_dict()`` and ``fused_optimizer.state_dict()`` and write
  values drawn from SEED into them in place: ``all`` (weights and optimizer states, every
  row), ``some`` (both, a quarter of the rows), ``weights`` or ``state`` (every row of one);
* ``lr:X``: set the learning rate through ``fused_optimizer.param_groups`` (steps apply it);
* ``save:KIND``: a checkpoint of model and optimizer, ``dcp`` (``dcp.save`` of the state dicts)
  or, for the tiered model, ``full`` / ``inc`` (this package's full and incremental
  checkpoints, a chain; the reference saves with dcp);
* ``load:TARGET:WORLD:HOW``: load the last checkpoint (its chain) into the ``same`` model or a
  ``fresh`` one at world size WORLD: ``inplace`` (``dcp.load`` into the state dicts, nothing
  after) or ``load_state_dict`` (then ``load_state_dict`` of both); a chain loads with
  ``load_tier_checkpoint`` and then ``load_state_dict``, as the app does.
"""


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
    dtype: str = "fp32"
    ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        tables = tuple(t if isinstance(t, TableDraw) else TableDraw(**t) for t in self.tables)
        object.__setattr__(
            self, "tables", tuple(replace(t, features=tuple(t.features)) for t in tables)
        )
        object.__setattr__(self, "ops", tuple(self.ops))

    @property
    def schedule(self) -> tuple[str, ...]:
        """The ops the case runs (a case without ops trains ``steps`` steps)."""
        return self.ops or (f"train:{self.steps}",)

    @property
    def total_steps(self) -> int:
        return sum(int(op.split(":")[1]) for op in self.schedule if op.startswith("train:"))

    @property
    def worlds(self) -> list[int]:
        """The world sizes its models run at: the case's, then any a load moves to."""
        out = [self.world_size]
        for op in self.schedule:
            if op.startswith("load:fresh:") and int(op.split(":")[2]) not in out:
                out.append(int(op.split(":")[2]))
        return out

    @property
    def job_world(self) -> int:
        """The ranks a run of the case needs."""
        return max(self.worlds)

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
        ops = f" [{' '.join(self.ops)}]" if self.ops else ""
        return (
            f"{module} {self.pattern} {shardings} {self.dtype} {self.optimizer} {self.loop} "
            f"w{'->'.join(map(str, self.worlds))} seed {self.seed}{ops}"
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


def draw_ops(rng: random.Random, world_size: int, switch_worlds: bool) -> tuple[str, ...]:
    """A random schedule (see :data:`OPS`): training, then one to four state operations each
    followed by more training. A load follows a save; an incremental save follows a full one
    in its chain (after a load, the loaded chain); a load into a fresh model may change the
    world size (1 <-> 2) once, when ``switch_worlds``."""
    ops = [f"train:{rng.randint(1, 3)}"]
    saved: str | None = None  # the kind of the last checkpoint
    chain = False  # a full checkpoint starts the chain an incremental one extends
    world, switched = world_size, False
    for _ in range(rng.randint(1, 4)):
        choices = ["write", "lr", "save"] + (["load", "load"] if saved else [])
        op = rng.choice(choices)
        if op == "write":
            ops.append(
                f"write:{rng.randrange(10**6)}:{rng.choice(('all', 'some', 'weights', 'state'))}"
            )
        elif op == "lr":
            ops.append(f"lr:{rng.choice((0.01, 0.02, 0.1))}")
        elif op == "save":
            kind = rng.choice(("dcp", "full", "inc") if chain else ("dcp", "full"))
            chain = kind != "dcp"
            saved = kind
            ops.append(f"save:{kind}")
        else:
            target = rng.choice(("same", "fresh"))
            if target == "fresh" and switch_worlds and not switched and rng.random() < 0.5:
                world, switched = 3 - world, True
            how = rng.choice(("inplace", "load_state_dict"))
            ops.append(f"load:{target}:{world}:{how}")
        ops.append(f"train:{rng.randint(1, 3)}")
    return tuple(ops)


def draw_case(
    rng: random.Random,
    seed: int,
    world_size: int,
    max_rows: int = MAX_ROWS,
    switch_worlds: bool = True,
) -> SweepCase:
    """A random case at ``world_size``: every axis of :class:`SweepCase` drawn from ``rng``
    (a load may move to the other world size, 1 or 2, when ``switch_worlds``)."""
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
        if sharding == "row_wise":  # a row on every rank (a tiered shard of none is refused)
            rows = max(rows, 2 if switch_worlds else world_size)
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
                # (leaving a slot at both world sizes a load may move the case to)
                hot_rows=_hot_rows(rng, rows, sharding, 2 if switch_worlds else world_size),
            )
        )
    dtype = rng.choice(DTYPES)
    # TorchRec's row-wise VBE gathers uneven tensors, which gloo refuses: no move to 2 ranks.
    switch = switch_worlds and not (vbe and any(t.sharding == "row_wise" for t in tables))
    ops = draw_ops(rng, world_size, switch) if rng.random() < 0.6 else ()
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
        dtype=dtype,
        ops=ops,
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


def shard_row_ranges(table: TableDraw, world_size: int) -> list[tuple[int, int]]:
    """Row range ``[lo, hi)`` of each of the table's shards that has its own cache (one per
    rank under row-wise sharding; column shards all see every row)."""
    if table.sharding == "row_wise":
        per = math.ceil(table.rows / world_size)
        return [(r * per, min(table.rows, (r + 1) * per)) for r in range(world_size)]
    return [(0, table.rows)]


def cache_rows_needed(case: SweepCase, table: TableDraw, world_size: int) -> list[tuple[int, int]]:
    """Per row shard of a tiered ``table`` at ``world_size``: ``(local rows, smallest cache
    that trains)`` over every step of the case.

    A shard sees every rank's ids in its rows (TorchRec's input distribution routes them
    there). With look-ahead ``k``, ``k + 1`` batches hold their rows at once; pinned hot rows
    hold theirs for good, and pinning needs one slot to spare."""
    window = case.lookahead + 1
    steps = case.total_steps
    ids_per_step = []
    for step in range(steps):
        parts = [
            ids
            for rank in range(world_size)
            for key, ids in _feature_ids(case, make_batch(case, rank, step)).items()
            if key in table.features
        ]
        ids_per_step.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64))
    out = []
    for lo, hi in shard_row_ranges(table, world_size):
        hot = torch.arange(min(table.hot_rows, table.rows))
        hot = hot[(hot >= lo) & (hot < hi)]
        need = max(int(hot.numel()) + 1, 1) if hot.numel() else 1
        for first in range(steps):
            ids = torch.cat([hot, *ids_per_step[first : first + window]])
            ids = ids[(ids >= lo) & (ids < hi)]
            need = max(need, int(torch.unique(ids).numel()))
        out.append((hi - lo, min(need, hi - lo)))
    return out


def cache_load_factor(case: SweepCase, table: TableDraw, world_size: int) -> float:
    """The factor giving each shard of ``table`` at ``world_size`` at least its drawn cache
    size: ``cache`` of the way from the smallest cache that trains to the whole shard."""
    factor = 0.0
    for rows, need in cache_rows_needed(case, table, world_size):
        if rows == 0:
            continue
        target = need + table.cache * (rows - need)
        factor = max(factor, (math.ceil(target) - 0.5) / rows)
    return min(1.0, max(factor, 1e-9))
