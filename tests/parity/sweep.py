"""The randomized differential parity sweep: drawn configurations trained beside TorchRec's FUSED.

Each case (:mod:`tests.parity.cases`) builds two ``DistributedModelParallel`` models of one module:
the reference, every table on TorchRec's FUSED kernel through TorchRec's stock sharders, and the
tiered one, the case's tables on their tiers through this project's sharders. Both use the same
shardings and start from the same weights (the tiered model loads the reference's initial state
dict). Each goes through the case's schedule alone: training steps (the reference in a plain
loop, the tiered model in the case's loop: plain, the look-ahead pipeline, or TorchRec's
``TrainPipelineSparseDist``) and what users do to state between them (writes into the state
dicts in place, learning-rate changes, checkpoints saved and loaded into the same or a fresh
model, at the same or another world size; see :data:`tests.parity.cases.OPS`). The reference
does the same with TorchRec's own means (dcp). The loss reads the module's output by position
(a ``KeyedTensor``'s ``values()``, an EC's features in the order it returns them), as a dense
layer over the embeddings would, so an output in another order is a mismatch. Compared bit for
bit: every step's loss and output order, then every local shard of every table's weights and
optimizer state at the end.

Run it::

    python -m tests.parity.sweep --sweep 1000 --seed 0          # 1,000 drawn cases
    python -m tests.parity.sweep --case '<one line of JSON>'      # one case again
    python -m tests.parity.sweep --virtual --sweep 1000           # the virtual-table axis
    python -m tests.parity.sweep --mc --sweep 300                 # the managed-collision axis

A failure prints its case as one line that reruns it. Cases that need two ranks (world size 2,
or a load at world size 2) run in spawned gloo ranks on loopback; a model at world size 1 in
such a job lives on rank 0 alone (in a one-rank subgroup).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch import nn
from torchrec.datasets.utils import Batch
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import Awaitable, ModuleSharder, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import (
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    PoolingType,
)
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from tests.distributed.parity_harness import OPTIMIZERS, assembled_pairs, regions
from tests.parity.cases import (
    SweepCase,
    TableDraw,
    cache_load_factor,
    draw_case,
    make_batch,
)
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.incremental import (
    changed_state_dict,
    clear_changes,
    deferred_views,
    full_state_dict,
    load_tier_checkpoint,
    track_changes,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.pipeline import LookaheadTrainPipeline, tiered_groups

CPU = torch.device("cpu")
LEARNING_RATE = 0.05
RERUN = "python -m tests.parity.sweep --case"

# ------------------------------------------------------------------------------- models


def _module(case: SweepCase) -> nn.Module:
    meta = torch.device("meta")
    common = [
        {
            "name": t.name,
            "num_embeddings": t.rows,
            "embedding_dim": t.dim,
            "feature_names": list(t.features),
            "data_type": DataType.FP16 if case.dtype == "fp16" else DataType.FP32,
        }
        for t in case.tables
    ]
    if case.kind == "ec":
        return EmbeddingCollection(tables=[EmbeddingConfig(**c) for c in common], device=meta)
    pooling = PoolingType.MEAN if case.pooling == "mean" else PoolingType.SUM
    return EmbeddingBagCollection(
        tables=[EmbeddingBagConfig(**c, pooling=pooling) for c in common],
        is_weighted=case.weighted,
        device=meta,
    )


@torch.fx.wrap
def waited(out: Any) -> Any:
    """A sharded module's output (TorchRec hands out a lazy awaitable of it); a leaf for FX."""
    return out.wait() if isinstance(out, Awaitable) else out


@torch.fx.wrap
def positional_loss(out: Any) -> torch.Tensor:
    """A loss over a module's output by position, as a dense layer over the embeddings would
    read it: a ``KeyedTensor``'s ``values()`` columns, or an EC's features in the order it
    returns them. A leaf for FX, so TorchRec's pipelines can trace the model around it."""
    values = [out[k].values() for k in out] if isinstance(out, dict) else [out.values()]
    loss = torch.zeros(())
    for i, v in enumerate(values):
        position = torch.arange(v.shape[-1], dtype=v.dtype) + 1.0 + i * 0.37
        loss = loss + (v * torch.cos(position).to(v.device) + 0.5 * v * v).sum()
    return loss


def output_keys(out: Any) -> tuple[str, ...]:
    """The order of a module's output: a ``KeyedTensor``'s keys or an EC's features."""
    return tuple(out.keys())


class SweepModel(nn.Module):
    """The case's module and :func:`positional_loss` over its output: ``(loss, (loss,
    output))``, the shape TorchRec's train pipelines expect."""

    def __init__(self, case: SweepCase) -> None:
        super().__init__()
        self.emb = _module(case)

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, Any]]:
        out = waited(self.emb(batch.sparse_features))
        loss = positional_loss(out)
        return loss, (loss.detach(), out)


def _generator(table: TableDraw, kernel: str, world_size: int) -> Any:
    if table.sharding == "table_wise":
        return table_wise(rank=table.rank % world_size, compute_kernel=kernel)
    if table.sharding == "column_wise":
        ranks = [0, 0] if world_size == 1 else list(range(world_size))
        return column_wise(ranks=ranks, compute_kernel=kernel)
    if table.sharding == "row_wise":
        return row_wise(compute_kernel=kernel)
    raise ValueError(f"unknown sharding {table.sharding!r}")


def build(
    case: SweepCase,
    root: Path | None,
    world_size: int | None = None,
    pg: dist.ProcessGroup | None = None,
) -> DistributedModelParallel:
    """The reference (``root`` None: every table FUSED, TorchRec's sharders) or the tiered
    model (tier files under ``root``), at ``world_size`` (the case's by default) over ``pg``
    (the default group when ``None``)."""
    world = world_size or case.world_size
    fused = {"optimizer": OPTIMIZERS[case.optimizer], "learning_rate": LEARNING_RATE}
    sharder: ModuleSharder[nn.Module]
    tiered = root is not None
    if not tiered:
        sharder = (
            EmbeddingBagCollectionSharder(fused_params=fused)
            if case.kind == "ebc"
            else EmbeddingCollectionSharder(fused_params=fused)
        )
    else:
        # Named either way: the block tier's default layout is the log.
        block = {"block_scm": {"layout": case.block_layout}}
        storage = TierStorage(root=str(root), tier_options=block)
        hot = {t.name: list(range(t.hot_rows)) for t in case.tables if t.tiered and t.hot_rows}
        cls = (
            TieredEmbeddingBagCollectionSharder
            if case.kind == "ebc"
            else TieredEmbeddingCollectionSharder
        )
        sharder = cls(storage, fused_params=fused, hot_rows=hot)
    kernels = {t.name: TIERED_KERNEL if tiered and t.tiered else "fused" for t in case.tables}
    plan = construct_module_sharding_plan(
        _module(case),
        {t.name: _generator(t, kernels[t.name], world) for t in case.tables},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    if tiered:
        for t in case.tables:
            if t.tiered:
                options = TieredTableOptions(
                    tier=t.placement,
                    cache_load_factor=cache_load_factor(case, t, world),
                    cache_policy=t.policy,
                )
                plan[t.name] = TieredParameterSharding.wrap(plan[t.name], options)
    return DistributedModelParallel(
        SweepModel(case),
        env=ShardingEnv.from_process_group(pg or dist.GroupMember.WORLD),
        device=CPU,
        plan=ShardingPlan({"emb": plan}),
        sharders=[sharder],
    )


def _table_values(case: SweepCase, seed: int, part: str) -> dict[str, torch.Tensor]:
    """Whole tables of values drawn from ``seed`` (the same on every rank): a table's weights
    (``part`` ``weights``), or its optimizer state (non-negative, as accumulated squares are)."""
    out = {}
    for i, t in enumerate(case.tables):
        g = torch.Generator().manual_seed(seed * 1009 + i * 31 + (part == "state"))
        values = torch.randn(t.rows, t.dim, generator=g) * 0.1
        out[t.name] = values.abs() if part == "state" else values
    return out


def _write(value: Any, table: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Writes ``table`` (a whole table, or for a 1-D row-wise state its first column) into the
    local shards of ``value`` in place, only at ``rows`` (a mask over the table) when given."""
    for off, size, tensor in regions(value):
        # A row-wise state of a column-wise table lists the rows once per column shard.
        index = torch.arange(off[0], off[0] + size[0]) % table.shape[0]
        cols = slice(0, 1) if tensor.dim() == 1 else slice(off[1], off[1] + size[1])
        src = table[index, cols].reshape(tensor.shape).to(tensor.dtype)
        if rows is None:
            tensor.copy_(src)
        else:
            keep = rows[index]
            tensor[keep] = src[keep]


@torch.no_grad()
def set_weights(model: DistributedModelParallel, case: SweepCase) -> None:
    """Random initial weights (the same whole tables on every rank) into the reference's
    state-dict shards, which view its kernels' weights."""
    g = torch.Generator().manual_seed(10_007 + case.seed)
    weights = {t.name: torch.randn(t.rows, t.dim, generator=g) * 0.1 for t in case.tables}
    for key, value in model.state_dict().items():
        _write(value, weights[key.split(".")[-2]], None)


@torch.no_grad()
def write_state(
    model: DistributedModelParallel,
    case: SweepCase,
    seed: int,
    part: str,
    state: dict[str, Any] | None = None,
) -> None:
    """The ``write`` op: values drawn from ``seed`` written in place into the tensors
    ``state_dict()`` (or ``state``, one it handed out earlier) and
    ``fused_optimizer.state_dict()`` hand out (see ``OPS``)."""
    rows_of: dict[str, torch.Tensor | None] = {}
    for i, t in enumerate(case.tables):
        g = torch.Generator().manual_seed(seed * 7 + i)
        rows_of[t.name] = torch.rand(t.rows, generator=g) < 0.25 if part == "some" else None
    if part in ("all", "some", "weights"):
        values = _table_values(case, seed, "weights")
        for key, value in (state if state is not None else model.state_dict()).items():
            table = key.split(".")[-2]
            _write(value, values[table], rows_of[table])
    if part in ("all", "some", "state"):
        values = _table_values(case, seed, "state")
        for param, states in model.fused_optimizer.state_dict()["state"].items():
            table = param.split(".")[-2]
            for value in states.values():
                _write(value, values[table], rows_of[table])


# ----------------------------------------------------------------------------- training


def train(
    model: DistributedModelParallel, case: SweepCase, rank: int, loop: str, steps: range
) -> list[tuple[float, tuple[str, ...]]]:
    """Trains ``steps`` (global step numbers: their batches) in ``loop``; per step the loss and
    the output's key order. Each step goes ``zero_grad()``, forward, backward, ``step()``, as
    TorchRec's pipelines do: a learning rate set through the fused optimizer's
    ``param_groups`` takes effect at the next of either call (its backward updates)."""
    out: list[tuple[float, tuple[str, ...]]] = []
    batches = (make_batch(case, rank, step) for step in steps)
    if loop == "plain":
        for batch in batches:
            model.fused_optimizer.zero_grad()
            loss, (_, output) = model(batch)
            loss.backward()
            model.fused_optimizer.step()
            out.append((float(loss.detach()), output_keys(output)))
        return out
    if loop == "lookahead":
        with LookaheadTrainPipeline(
            model, model.fused_optimizer, CPU, lookahead=case.lookahead
        ) as pipeline:
            return _run_pipeline(pipeline, batches)
    if loop == "torchrec":
        return _run_pipeline(TrainPipelineSparseDist(model, model.fused_optimizer, CPU), batches)
    raise ValueError(f"unknown loop {loop!r}")


def _run_pipeline(pipeline: Any, batches: Iterator[Batch]) -> list[tuple[float, tuple[str, ...]]]:
    out = []
    while True:
        try:
            loss, output = pipeline.progress(batches)
        except StopIteration:
            return out
        out.append((float(loss), output_keys(output)))


class _Schedule:
    """One model (the reference or the tiered one) going through a case's schedule on one rank.

    Args:
        case: the case.
        rank: this process's rank in the job.
        tiered: the tiered model (else the reference).
        root: where this rank's tier files go (tiered only), one folder per model built.
        shared: a folder every rank sees, for the checkpoints.
        groups: per world size of the case, its process group (``None``: this rank is outside
            it).
    """

    def __init__(
        self,
        case: SweepCase,
        rank: int,
        tiered: bool,
        root: Path,
        shared: Path,
        groups: dict[int, dist.ProcessGroup | None],
    ) -> None:
        self.case, self.rank, self.tiered = case, rank, tiered
        self.root, self.shared, self.groups = root, shared, groups
        self.world = case.world_size
        self.model: DistributedModelParallel | None = None
        self.builds = 0
        self.saves = 0
        self.chain: list[Path] = []  # the last checkpoint, with its chain's earlier links
        self.plain = True  # whether it is a dcp checkpoint (else this package's chain)
        self.kind = "dcp"  # the kind the schedule saved it as
        self.steps: list[tuple[float, tuple[str, ...]]] = []

    @property
    def pg(self) -> dist.ProcessGroup | None:
        return self.groups[self.world]

    def build(self, world: int) -> DistributedModelParallel | None:
        """A new model at ``world`` (``None`` on a rank outside it)."""
        self.world = world
        if self.pg is None:
            return None
        self.builds += 1
        root = self.root / f"m{self.builds}" if self.tiered else None
        model = build(self.case, root, world, self.pg)
        if self.tiered:
            track_changes(tiered_groups(model))  # for incremental checkpoints
        return model

    def start(self, initial: dict[str, Any]) -> None:
        """The first model, from the reference's initial state dict (``initial``)."""
        self.model = self.build(self.world)
        if self.model is not None:
            self.model.load_state_dict(initial)

    def run(self) -> None:
        step = 0
        for op in self.case.schedule:
            name, *args = op.split(":")
            if name == "train":
                steps = range(step, step + int(args[0]))
                step = steps.stop
                if self.model is not None:
                    loop = self.case.loop if self.tiered else "plain"
                    self.steps += train(self.model, self.case, self.rank, loop, steps)
            elif name == "save":
                self.save(args[0])
            elif name == "load":
                self.load(args[0], int(args[1]), args[2])
            elif self.model is None:
                continue  # outside this phase's world
            elif name == "write":
                write_state(self.model, self.case, int(args[0]), args[1])
            elif name == "lr":
                for group in self.model.fused_optimizer.param_groups:
                    group["lr"] = float(args[0])
            else:
                raise ValueError(f"unknown op {op!r}")

    def _state(self) -> dict[str, Any]:
        """The model's and the fused optimizer's state dicts, the latter left out on a rank
        whose optimizer holds no state tensor (no table there, or SGD): dcp would find nothing
        to load it from in a checkpoint written by other ranks."""
        assert self.model is not None
        state = {"model": self.model.state_dict()}
        optim = self.model.fused_optimizer.state_dict()
        if any(states for states in optim["state"].values()):
            state["optim"] = optim
        return state

    def save(self, kind: str) -> None:
        """A checkpoint: dcp for the reference and for ``dcp``, else this package's full or
        incremental one. Every rank keeps the chain, also one outside this phase's world."""
        self.saves += 1
        path = self.shared / ("tiered" if self.tiered else "reference") / f"c{self.saves}"
        plain = not self.tiered or kind == "dcp"
        self.chain = [*self.chain, path] if kind == "inc" and not plain else [path]
        self.plain, self.kind = plain, kind
        if self.model is None:
            return
        if plain:
            dcp.save(self._state(), checkpoint_id=path, process_group=self.pg)
            return
        groups = tiered_groups(self.model)
        with deferred_views(groups):
            state = self._state()
            saved = (
                changed_state_dict(state, groups, self.pg)
                if kind == "inc"
                else full_state_dict(state, groups)
            )
            dcp.save(saved.state, checkpoint_id=path, planner=saved.planner, process_group=self.pg)
        clear_changes(groups)

    def _load_state_dicts(self, state: dict[str, Any]) -> None:
        assert self.model is not None
        self.model.load_state_dict(state["model"])
        if "optim" in state:
            self.model.fused_optimizer.load_state_dict(state["optim"])

    def load(self, target: str, world: int, how: str) -> None:
        """Loads the last checkpoint (its chain) into the model, or a fresh one at ``world``."""
        if target == "fresh":
            # Every rank of the job meets here: one that sat out a smaller world must not read
            # the checkpoint before the ranks that write it are done.
            dist.barrier()
            self.model = self.build(world)
        if self.model is None:
            return
        if self.plain:
            state = self._state()
            dcp.load(state, checkpoint_id=self.chain[0], process_group=self.pg)
            # (The reference loads as the tiered model does: a chain ends with load_state_dict.)
            if how == "load_state_dict" or self.kind != "dcp":
                self._load_state_dicts(state)
        else:
            groups = tiered_groups(self.model)
            with deferred_views(groups):
                state = self._state()
                for i, path in enumerate(self.chain):
                    load_tier_checkpoint(
                        state, path, groups, incremental=i > 0, process_group=self.pg
                    )
                self._load_state_dicts(state)
        if self.tiered:
            clear_changes(tiered_groups(self.model))  # the chain's last link holds it all


# ---------------------------------------------------------------------------- comparing


def same_local_values(ref: Any, tie: Any) -> bool:
    """Whether every local shard of ``ref`` equals, bit for bit, what ``tie``'s local shards
    (perhaps split into other chunks) hold over the same region."""
    try:
        return all(torch.equal(want, got) for want, got in assembled_pairs(ref, tie))
    except AssertionError:  # tie holds other elements than ref
        return False


def state_differences(ref: DistributedModelParallel, tie: DistributedModelParallel) -> list[str]:
    """Names of the weights and optimizer states that differ. The optimizer state is read
    first, as a checkpoint of it alone would: it must hold the updates still in the caches."""
    diffs: list[str] = []
    ref_optim = ref.fused_optimizer.state_dict()["state"]
    tie_optim = tie.fused_optimizer.state_dict()["state"]
    if set(ref_optim) != set(tie_optim):
        return [f"optimizer params {sorted(set(ref_optim) ^ set(tie_optim))}"]
    for param, states in ref_optim.items():
        for key, value in states.items():
            if key not in tie_optim[param] or not same_local_values(value, tie_optim[param][key]):
                diffs.append(f"optimizer {param}/{key}")
    ref_sd, tie_sd = ref.state_dict(), tie.state_dict()
    if set(ref_sd) != set(tie_sd):
        return [*diffs, f"state dict keys {sorted(set(ref_sd) ^ set(tie_sd))}"]
    diffs += [key for key in ref_sd if not same_local_values(ref_sd[key], tie_sd[key])]
    return diffs


@dataclass
class Outcome:
    """What one rank saw of one case: ``ok``, ``mismatch`` (with what differs) or ``error``
    (the tiered model failed where TorchRec's did not) or ``refused`` (TorchRec's own FUSED
    model failed: a configuration TorchRec does not offer, not counted as tried)."""

    case: str
    rank: int
    status: str
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0


def case_groups(case: SweepCase) -> dict[int, dist.ProcessGroup | None]:
    """Per world size of ``case``, the process group its models use on this rank (``None``:
    this rank is outside it). Every rank of the job calls this for every case, in order: a
    world smaller than the job's gets a subgroup of the first ranks, which all ranks form."""
    world = dist.get_world_size()
    out: dict[int, dist.ProcessGroup | None] = {}
    for size in sorted(case.worlds):
        if size == world:
            out[size] = dist.GroupMember.WORLD
        else:
            group = dist.new_group(list(range(size)), backend="gloo")
            out[size] = group if dist.get_rank() < size else None
    return out


def run_case(
    case: SweepCase,
    rank: int,
    root: Path,
    shared: Path | None = None,
    groups: dict[int, dist.ProcessGroup | None] | None = None,
) -> Outcome:
    """Runs ``case`` on this rank: the reference's schedule, then the tiered model's, then
    the comparison. ``root``: this rank's tier files; ``shared``: the checkpoints (every rank
    sees it; default: under ``root``); ``groups``: see :func:`case_groups`."""
    started = time.perf_counter()
    line = case.to_line()
    groups = groups or {case.world_size: dist.GroupMember.WORLD}
    shared = shared or root / "checkpoints"
    ref = _Schedule(case, rank, False, root / "reference", shared, groups)
    tie = _Schedule(case, rank, True, root / "tiered", shared, groups)
    try:
        initial = _initial_state(case, groups[case.world_size])
        ref.start(initial)
        ref.run()
    except Exception:
        return Outcome(line, rank, "refused", [traceback.format_exc(limit=4)])
    try:
        tie.start(initial)
        tie.run()
        details = _step_differences(ref.steps, tie.steps)
        if ref.model is not None and tie.model is not None:
            details += state_differences(ref.model, tie.model)
        status = "mismatch" if details else "ok"
        return Outcome(line, rank, status, details, time.perf_counter() - started)
    except Exception:
        return Outcome(line, rank, "error", [traceback.format_exc()], time.perf_counter() - started)
    finally:
        for model in (ref.model, tie.model):
            if model is not None:
                _close_tiers(model)
        shutil.rmtree(root, ignore_errors=True)


def _initial_state(case: SweepCase, pg: dist.ProcessGroup | None) -> dict[str, Any]:
    """The reference's initial state dict (random weights, see :func:`set_weights`), which
    both models load first; empty on a rank outside the case's first world."""
    if pg is None:
        return {}
    model = build(case, None, case.world_size, pg)
    set_weights(model, case)
    return model.state_dict()


def _step_differences(
    ref: Sequence[tuple[float, tuple[str, ...]]], tie: Sequence[tuple[float, tuple[str, ...]]]
) -> list[str]:
    details: list[str] = []
    for step, (a, b) in enumerate(zip(ref, tie)):
        if a[1] != b[1]:
            details.append(f"step {step}: output order {list(b[1])}, TorchRec {list(a[1])}")
            break
    for step, (a, b) in enumerate(zip(ref, tie)):
        if a[0] != b[0]:
            details.append(f"step {step}: loss {b[0]!r}, TorchRec {a[0]!r}")
            break
    if len(ref) != len(tie):
        details.append(f"{len(tie)} steps trained, TorchRec {len(ref)}")
    return details


def _close_tiers(model: DistributedModelParallel) -> None:
    """Stops the tiers' I/O threads and closes their files before the folder goes."""
    for group in tiered_groups(model):
        group.close()


# ------------------------------------------------------------------------- running cases


def run_in_process(cases: Sequence[SweepCase], root: Path) -> list[Outcome]:
    """Cases of one rank (no world size above 1), one after another, in this process (it
    needs a process group)."""
    return [run_case(case, 0, root / f"case{i}") for i, case in enumerate(cases)]


def _rank_main(
    rank: int, world_size: int, port: int, lines: list[str], root: str, out: str
) -> None:
    torch.set_num_threads(1)
    outcomes: list[Outcome] = []
    with process_group(
        backend="gloo", rank=rank, world_size=world_size, port=port, timeout=timedelta(seconds=120)
    ):
        try:
            for i, line in enumerate(lines):
                case = SweepCase.from_line(line)
                # A root of its own per rank: each rank removes its root when its case ends,
                # which may be while the other rank still reads (or spills next to) its files.
                case_root = Path(root) / f"case{i}" / f"rank{rank}"
                shared = Path(root) / f"case{i}" / "shared"
                outcome = run_case(case, rank, case_root, shared, case_groups(case))
                outcomes.append(outcome)
                if outcome.status == "error":
                    break  # the ranks may be out of step now: the rest run in a new job
                dist.barrier()  # every rank is done with the case's checkpoints
                if rank == 0:
                    shutil.rmtree(shared, ignore_errors=True)
        finally:
            torch.save([o.__dict__ for o in outcomes], os.path.join(out, f"rank{rank}.pt"))


def run_spawned(cases: Sequence[SweepCase], root: Path) -> list[Outcome]:
    """Cases needing the same number of ranks (:attr:`SweepCase.job_world`), in jobs of
    spawned gloo ranks; a case that errors ends its job and the cases after it run in the next.
    Per case, the worst rank's outcome."""
    world_size = cases[0].job_world
    results: list[Outcome] = []
    remaining = list(cases)
    while remaining:
        out = tempfile.mkdtemp(dir=root)
        lines = [c.to_line() for c in remaining]
        try:
            mp.spawn(
                _rank_main,
                args=(world_size, free_port(), lines, str(root), out),
                nprocs=world_size,
                join=True,
            )
        except Exception as e:  # a rank died: the case it ran is reported as an error
            died = f"{type(e).__name__}: {e}"
        else:
            died = "a rank died"
        per_rank = []
        for rank in range(world_size):
            path = os.path.join(out, f"rank{rank}.pt")
            saved = torch.load(path, weights_only=False) if os.path.exists(path) else []
            per_rank.append([Outcome(**o) for o in saved])
        done = min(len(r) for r in per_rank)
        for i in range(done):
            results.append(_worst([r[i] for r in per_rank]))
        ended_by_error = done > 0 and any(r[done - 1].status == "error" for r in per_rank)
        if done < len(remaining) and not ended_by_error:
            results.append(
                Outcome(lines[done], -1, "error", [f"a rank died running this case: {died}"])
            )
            done += 1
        remaining = remaining[done:]
    return results


def _worst(outcomes: Sequence[Outcome]) -> Outcome:
    order = {"error": 0, "mismatch": 1, "refused": 2, "ok": 3}
    return min(outcomes, key=lambda o: order[o.status])


def run(cases: Sequence[SweepCase], root: Path) -> list[Outcome]:
    """Every case, those of one rank in this process and the others spawned; in case order."""
    by_world: dict[int, list[tuple[int, SweepCase]]] = {}
    for i, case in enumerate(cases):
        by_world.setdefault(case.job_world, []).append((i, case))
    results: dict[int, Outcome] = {}
    for world, indexed in by_world.items():
        batch = [c for _, c in indexed]
        outcomes = run_in_process(batch, root) if world == 1 else run_spawned(batch, root)
        for (i, _), outcome in zip(indexed, outcomes):
            results[i] = outcome
    return [results[i] for i in range(len(cases))]


def draw_cases(count: int, seed: int, world_sizes: Sequence[int] = (1, 2)) -> list[SweepCase]:
    """``count`` cases drawn from ``seed``; every third at world size 2 when it is offered."""
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        world = world_sizes[-1] if len(world_sizes) > 1 and i % 3 == 2 else world_sizes[0]
        cases.append(draw_case(rng, seed * 1_000_003 + i, world, switch_worlds=2 in world_sizes))
    return cases


def report(outcomes: Sequence[Outcome]) -> tuple[str, list[str]]:
    """The summary line and one block per failed case (with the line that reruns it)."""
    counts = {
        s: sum(o.status == s for o in outcomes) for s in ("ok", "mismatch", "error", "refused")
    }
    tried = len(outcomes) - counts["refused"]
    summary = (
        f"sweep: {tried} configurations compared with TorchRec's FUSED kernel: {counts['ok']} "
        f"bit for bit, {counts['mismatch']} mismatched, {counts['error']} failed"
        f" ({counts['refused']} drawn configurations refused by TorchRec itself)"
    )
    failures = []
    for o in outcomes:
        if o.status in ("mismatch", "error"):
            case = SweepCase.from_line(o.case)
            lines = [f"{o.status.upper()} {case.describe()}", *o.details[:6]]
            failures.append("\n  ".join([*lines, f"rerun: {RERUN} '{o.case}'"]))
    return summary, failures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=int, default=50, help="cases to draw")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated, e.g. 1 or 1,2")
    parser.add_argument("--case", action="append", help="run this case line (repeatable)")
    parser.add_argument("--dir", default=None, help="where tier files go (default: a temp dir)")
    parser.add_argument(
        "--virtual",
        action="store_true",
        help="draw virtual-table cases (tests.parity.virtual_sweep)",
    )
    parser.add_argument(
        "--mc",
        action="store_true",
        help="draw managed-collision cases (tests.parity.mc_sweep)",
    )
    args = parser.parse_args(argv)
    if args.virtual:
        return _main_virtual(args.sweep, args.seed, args.dir)
    if args.mc:
        return _main_mc(args.sweep, args.seed, args.dir)
    if args.case:
        cases = [SweepCase.from_line(line) for line in args.case]
    else:
        worlds = [int(w) for w in args.world_sizes.split(",")]
        cases = draw_cases(args.sweep, args.seed, worlds)
    return _run_and_report(lambda root: report(run(cases, root)), args.dir)


def _main_virtual(count: int, seed: int, directory: str | None) -> int:
    from tests.parity.virtual_sweep import draw_virtual_cases, run_virtual, virtual_report

    cases = draw_virtual_cases(count, seed)
    return _run_and_report(lambda root: virtual_report(run_virtual(cases, root)), directory)


def _main_mc(count: int, seed: int, directory: str | None) -> int:
    from tests.parity.mc_sweep import draw_mc_cases, mc_report, run_mc

    cases = draw_mc_cases(count, seed)
    return _run_and_report(lambda root: mc_report(run_mc(cases, root)), directory)


def _run_and_report(
    run_cases: Callable[[Path], tuple[str, list[str]]], directory: str | None
) -> int:
    """Runs a sweep (its tier files in a temporary directory under ``directory``) in a gloo
    group, prints its failures and summary; 1 when any case failed."""
    root = Path(tempfile.mkdtemp(prefix="sweep-", dir=directory))
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        with process_group(backend="gloo"):
            summary, failures = run_cases(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for failure in failures:
        print(failure)
    print(f"{summary}; {time.perf_counter() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
