"""The randomized differential parity sweep: drawn configurations trained beside TorchRec's FUSED.

Each case (:mod:`tests.parity.cases`) builds two ``DistributedModelParallel`` models of one module:
the reference, every table on TorchRec's FUSED kernel through TorchRec's stock sharders, and the
tiered one, the case's tables on their tiers through this project's sharders. Both use the same
shardings; the tiered model loads the reference's state dict, so both start from the same
weights. The reference trains in a plain loop, the tiered model in the case's loop (plain, the
look-ahead pipeline, or TorchRec's ``TrainPipelineSparseDist``), on the same batches. The loss
reads the module's output by position (a ``KeyedTensor``'s ``values()``, an EC's features in the
order it returns them), as a dense layer over the embeddings would, so an output in another
order is a mismatch. Compared bit for bit: every step's loss and output order, then every local
shard of every table's weights and optimizer state.

Run it::

    python -m tests.parity.sweep --sweep 1000 --seed 0          # 1,000 drawn cases
    python -m tests.parity.sweep --case '<one line of JSON>'      # one case again

A failure prints its case as one line that reruns it. World size 2 cases run in spawned gloo
ranks on loopback.
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
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
from torchrec.distributed.types import Awaitable, ModuleSharder, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
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
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.pipeline import LookaheadTrainPipeline

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
        return table_wise(rank=table.rank, compute_kernel=kernel)
    if table.sharding == "column_wise":
        ranks = [0, 0] if world_size == 1 else list(range(world_size))
        return column_wise(ranks=ranks, compute_kernel=kernel)
    if table.sharding == "row_wise":
        return row_wise(compute_kernel=kernel)
    raise ValueError(f"unknown sharding {table.sharding!r}")


def build(case: SweepCase, root: Path | None) -> DistributedModelParallel:
    """The reference (``root`` None: every table FUSED, TorchRec's sharders) or the tiered
    model (tier files under ``root``)."""
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
        {t.name: _generator(t, kernels[t.name], case.world_size) for t in case.tables},
        sharder=sharder,
        local_size=case.world_size,
        world_size=case.world_size,
        device_type="cpu",
    )
    if tiered:
        for t in case.tables:
            if t.tiered:
                options = TieredTableOptions(
                    tier=t.placement,
                    cache_load_factor=cache_load_factor(case, t),
                    cache_policy=t.policy,
                )
                plan[t.name] = TieredParameterSharding.wrap(plan[t.name], options)
    return DistributedModelParallel(
        SweepModel(case), device=CPU, plan=ShardingPlan({"emb": plan}), sharders=[sharder]
    )


@torch.no_grad()
def set_weights(model: DistributedModelParallel, case: SweepCase) -> None:
    """Random initial weights (the same whole tables on every rank) into the reference's
    state-dict shards, which view its kernels' weights."""
    g = torch.Generator().manual_seed(10_007 + case.seed)
    weights = {t.name: torch.randn(t.rows, t.dim, generator=g) * 0.1 for t in case.tables}
    for key, value in model.state_dict().items():
        table = key.split(".")[-2]
        for off, size, tensor in regions(value):
            tensor.copy_(weights[table][off[0] : off[0] + size[0], off[1] : off[1] + size[1]])


# ----------------------------------------------------------------------------- training


def _batches(case: SweepCase, rank: int) -> Iterator[Batch]:
    return (make_batch(case, rank, step) for step in range(case.steps))


def train(
    model: DistributedModelParallel, case: SweepCase, rank: int, loop: str
) -> list[tuple[float, tuple[str, ...]]]:
    """Trains the case's steps in ``loop``; per step the loss and the output's key order."""
    out: list[tuple[float, tuple[str, ...]]] = []
    if loop == "plain":
        for batch in _batches(case, rank):
            loss, (_, output) = model(batch)
            loss.backward()
            out.append((float(loss.detach()), output_keys(output)))
        return out
    pipeline: Any
    if loop == "lookahead":
        pipeline = LookaheadTrainPipeline(
            model, model.fused_optimizer, CPU, lookahead=case.lookahead
        )
    elif loop == "torchrec":
        pipeline = TrainPipelineSparseDist(model, model.fused_optimizer, CPU)
    else:
        raise ValueError(f"unknown loop {loop!r}")
    batches = _batches(case, rank)
    while True:
        try:
            loss, output = pipeline.progress(batches)
        except StopIteration:
            break
        out.append((float(loss), output_keys(output)))
    return out


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


def run_case(case: SweepCase, rank: int, root: Path) -> Outcome:
    started = time.perf_counter()
    line = case.to_line()
    try:
        ref = build(case, None)
        set_weights(ref, case)
        start = {k: [t.clone() for _, _, t in regions(v)] for k, v in ref.state_dict().items()}
        ref_steps = train(ref, case, rank, "plain")
    except Exception:
        return Outcome(line, rank, "refused", [traceback.format_exc(limit=4)])
    try:
        tie = build(case, root)
        _load_start(tie, ref, start)
        tie_steps = train(tie, case, rank, case.loop)
        details: list[str] = []
        for step, (a, b) in enumerate(zip(ref_steps, tie_steps)):
            if a[1] != b[1]:
                details.append(f"step {step}: output order {list(b[1])}, TorchRec {list(a[1])}")
                break
        for step, (a, b) in enumerate(zip(ref_steps, tie_steps)):
            if a[0] != b[0]:
                details.append(f"step {step}: loss {b[0]!r}, TorchRec {a[0]!r}")
                break
        if len(ref_steps) != len(tie_steps):
            details.append(f"{len(tie_steps)} steps trained, TorchRec {len(ref_steps)}")
        details += state_differences(ref, tie)
        status = "mismatch" if details else "ok"
        return Outcome(line, rank, status, details, time.perf_counter() - started)
    except Exception:
        return Outcome(line, rank, "error", [traceback.format_exc()], time.perf_counter() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)


@torch.no_grad()
def _load_start(
    tie: DistributedModelParallel,
    ref: DistributedModelParallel,
    start: dict[str, list[torch.Tensor]],
) -> None:
    """Loads the reference's initial weights (``start``: its local shards before training)
    into the tiered model through ``load_state_dict``, the public path."""
    state = ref.state_dict()
    trained = {k: [t.clone() for _, _, t in regions(v)] for k, v in state.items()}
    for key, value in state.items():
        for (_, _, tensor), initial in zip(regions(value), start[key]):
            tensor.copy_(initial)
    tie.load_state_dict(state)
    for key, value in state.items():  # the reference as it was trained
        for (_, _, tensor), done in zip(regions(value), trained[key]):
            tensor.copy_(done)


# ------------------------------------------------------------------------- running cases


def run_in_process(cases: Sequence[SweepCase], root: Path) -> list[Outcome]:
    """World-size-1 cases, one after another, in this process (it needs a process group)."""
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
                # A root of its own per rank: each rank removes its root when its case ends,
                # which may be while the other rank still reads (or spills next to) its files.
                case_root = Path(root) / f"case{i}" / f"rank{rank}"
                outcome = run_case(SweepCase.from_line(line), rank, case_root)
                outcomes.append(outcome)
                if outcome.status == "error":
                    break  # the ranks may be out of step now: the rest run in a new job
        finally:
            torch.save([o.__dict__ for o in outcomes], os.path.join(out, f"rank{rank}.pt"))


def run_spawned(cases: Sequence[SweepCase], root: Path) -> list[Outcome]:
    """Cases of one world size, in jobs of spawned gloo ranks; a case that errors ends its job
    and the cases after it run in the next. Per case, the worst rank's outcome."""
    world_size = cases[0].world_size
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
    """Every case, world size 1 in this process and the others spawned; in case order."""
    by_world: dict[int, list[tuple[int, SweepCase]]] = {}
    for i, case in enumerate(cases):
        by_world.setdefault(case.world_size, []).append((i, case))
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
        cases.append(draw_case(rng, seed * 1_000_003 + i, world))
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
    args = parser.parse_args(argv)
    if args.case:
        cases = [SweepCase.from_line(line) for line in args.case]
    else:
        worlds = [int(w) for w in args.world_sizes.split(",")]
        cases = draw_cases(args.sweep, args.seed, worlds)
    root = Path(tempfile.mkdtemp(prefix="sweep-", dir=args.dir))
    torch.set_num_threads(1)
    started = time.perf_counter()
    try:
        with process_group(backend="gloo"):
            outcomes = run(cases, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary, failures = report(outcomes)
    for failure in failures:
        print(failure)
    print(f"{summary}; {time.perf_counter() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
