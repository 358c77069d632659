"""One rank's training run: the steps of :class:`Trainer` (find where the run starts, build the
model, vetting its plan before any tier file exists, restore, train with checkpoints, evaluate,
report) and the data plumbing they use (batches in step across ranks, read ahead, cut to the
schedule). ``train.main`` sets up the process group and hands a run to it.

Training runs ``run.epochs`` passes over the training split, cut short at ``run.steps`` steps;
evaluation reads the held-out split only. Every step and every evaluated batch is a collective
(the sharded embeddings exchange ids), so all ranks run the same number of them: a rank whose
data runs out ends the epoch for all.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence, Sized
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import EmbeddingModuleShardingPlan
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.batches import (
    DataState,
    Schedule,
    in_step,
    short_of_schedule,
    source,
    training_batches,
)
from apps.dlrm.checkpoints import (
    Position,
    checkpoint_position,
    last_checkpoint,
    load_newest,
    resume_candidates,
    save_checkpoint,
    start_over,
)
from apps.dlrm.cluster import network_storage_warnings
from apps.dlrm.config import AppConfig
from apps.dlrm.data import (
    CriteoNpyDataConfig,
    CriteoTsvDataConfig,
    DataConfig,
    Split,
)
from apps.dlrm.errors import ConfigError, RunDirError
from apps.dlrm.explain import errors_explained
from apps.dlrm.model import build_model, check_batch_ids, check_cache_sizes
from apps.dlrm.plan_record import (
    drop_old_tier_files,
    plan_changes,
    plan_record,
    planned_world_size,
    save_plan,
    tier_space_problem,
    virtual_tier_files,
)
from apps.dlrm.progress import Progress
from apps.dlrm.report import (
    EvalResult,
    RunLog,
    TrainWindow,
    evaluate,
    gathered_tier_stats,
    hit_rate,
    io_totals,
    summary,
)
from apps.dlrm.run_files import PLAN_FILE, tier_dir, tier_files
from torchrec_mtrains.cache.table_cache import compile_kernels
from torchrec_mtrains.checkpoint import CheckpointManager, CheckpointOptions, Link
from torchrec_mtrains.distributed import HostBoundsCheck, TieredParameterSharding
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.malloc import reuse_freed_memory
from torchrec_mtrains.pipeline import LookaheadTrainPipeline, snapshot, tiered_groups
from torchrec_mtrains.planner.sizes import format_size
from torchrec_mtrains.types import Tier

logger: logging.Logger = logging.getLogger("apps.dlrm.train")

_T = TypeVar("_T")


FIRST_LOSSES = 20  # per-step losses metrics.json keeps, to compare runs by


def _eval_warnings(data: DataConfig, result: EvalResult, world: int) -> list[str]:
    """Why the evaluation's metrics are null, if they are, naming the options to change."""
    if result.samples and result.auc is not None and result.ne is not None:
        return []
    if result.samples:
        return [
            f"all {result.samples} held-out samples have label {int(result.positives > 0)}: "
            "eval AUC and NE are undefined (null); evaluate on more rows (run.eval_batches, "
            "the held-out data options)"
        ]
    if isinstance(data, CriteoTsvDataConfig):
        options = (
            f"data.eval_paths={list(data.eval_paths)}, data.eval_fraction={data.eval_fraction}"
        )
    elif isinstance(data, CriteoNpyDataConfig):
        options = (
            f"data.eval_stems={list(data.eval_stems)}, data.eval_fraction={data.eval_fraction}"
        )
    else:
        options = f"data.num_batches={data.num_batches}"
    ranks = f" for each of the {world} ranks" if world > 1 else ""
    return [
        f"evaluation got no held-out batch{ranks} ({options}): eval_auc, eval_ne and "
        "eval_calibration are null. Name held-out files or hold out a larger share of the rows."
    ]


def _on_all_ranks(check: Callable[[], _T], world: int) -> _T:
    """``check()`` on every rank: a user error on any rank stops them all, with its message,
    rather than leaving the others waiting in their next collective."""
    if world == 1:
        return check()
    result: _T | None = None
    error: tuple[type[ConfigError], str] | None = None
    try:
        result = check()
    except ConfigError as e:
        error = (type(e), str(e))
    errors: list[object] = [None] * world
    dist.all_gather_object(errors, error)
    for found in errors:
        if found is not None:
            kind, message = cast(tuple[type[ConfigError], str], found)
            raise kind(message)
    return result  # type: ignore[return-value]


def _first_batches(
    app: AppConfig, first: Iterable[Batch], held_out: Iterable[Batch], evaluates: bool
) -> KeyedJaggedTensor | None:
    """Reads the first training batch (and the first held-out one when the run evaluates)
    and checks their ids against the tables, before any tier file exists: unreadable data or
    ids outside a table stop the run here, not after it built its tiers. Returns the training
    batch's ids (the caches are sized against them), None if the split is empty."""
    run, model, data = app.run, app.model, app.data
    with errors_explained(app):
        batch = _peek(first)
        if batch is not None:
            check_batch_ids(run, model, data, batch.sparse_features, "the first training batch")
        if evaluates:
            probe = _peek(held_out)
            if probe is not None:
                check_batch_ids(run, model, data, probe.sparse_features, "the first held-out batch")
    return batch.sparse_features if batch is not None else None


def _peek(source: Iterable[Batch]) -> Batch | None:
    """The first batch of ``source``, its reader closed again (training iterates it anew)."""
    batches = iter(source)
    try:
        return next(batches, None)
    finally:
        if isinstance(batches, Generator):
            batches.close()


def _replan(asked: bool, run_dir: Path, changed: str, world: int) -> bool:
    """Whether a resume whose plan differs from the checkpoint's rebuilds the tier files under
    the new plan: when ``asked`` (``run.replan``), or when the world size changed, which changes
    the plan by itself. The checkpoint's sharded tensors carry their global offsets, so
    loading them into the new plan's shards restores every row exactly."""
    before = planned_world_size(run_dir)
    if not (asked or before != world):
        return False
    why = f"world size {before} -> {world}" if before != world else "run.replan=true"
    logger.warning(
        "%s (%s): rebuilding every tier file from the checkpoint under the new plan",
        changed.split(". The checkpoint's", 1)[0],
        why,
    )
    return True


class Trainer:
    """One rank's run, as its steps read: :meth:`run` finds where the run starts, builds the
    model (vetting the plan before any tier file exists), loads the checkpoint, trains with
    periodic checkpoints, saves the final one, evaluates and reports. Options are read when
    it is made, before anything is built (their values were checked as the config was made).

    Args:
        app: the run's typed config.
        run_dir: ``run.dir``, made and checked writable.
        rank: this process's rank.
        world: ranks in the job.
        device: this rank's compute device.
        config_yaml: the composed config as YAML, saved as the run directory's ``config.yaml``.
    """

    def __init__(
        self,
        app: AppConfig,
        run_dir: Path,
        rank: int,
        world: int,
        device: torch.device,
        config_yaml: str,
    ) -> None:
        self.app = app
        self.run_dir = run_dir
        self.rank = rank
        self.world = world
        self.device = device
        self.config_yaml = config_yaml
        run = app.run
        torch.manual_seed(run.seed)
        self.lookahead = app.pipeline.lookahead
        self.read_ahead = app.pipeline.read_ahead
        self.schedule = Schedule.from_config(run)
        self.eval_cap = run.eval_batches
        self.keep = run.keep_checkpoints
        self.full_every = run.full_checkpoint_every
        self.tensorboard = run.tensorboard
        self.phases: dict[str, float] = {}
        self.warned: list[str] = []
        self.saves: list[dict[str, Any]] = []

    def run(self) -> dict[str, Any]:
        # The row caches' compiled kernels, before training: the first steps would wait for
        # them otherwise, and their wait would count as tier stall.
        compiled = compile_kernels()
        if compiled:
            self.phases["compile_kernels"] = compiled
            logger.info("row-cache kernels ready in %.1f s (before training)", compiled)
        t0 = time.perf_counter()
        self._find_start()
        model, optimizer, plan_text, file_counts = self._build()
        self.phases["build"] = time.perf_counter() - t0
        options = CheckpointOptions(full_every=self.full_every, keep=self.keep)
        manager = CheckpointManager(self.run_dir / "checkpoints", model, optimizer, options)
        if self.last is not None:
            self._restore(manager)
        self._announce(plan_text)
        trim = self.app.run.malloc_trim_bytes
        if trim is not None and reuse_freed_memory(trim) is not None:
            # (after the build and the restore: their transient memory went back as usual)
            logger.info(
                "host memory a step frees is kept for the next (up to %s free: "
                "run.malloc_trim_threshold)",
                format_size(trim),
            )
        return self._train_and_report(model, optimizer, manager, file_counts)

    # ------------------------------------------------------------------- where it starts

    def _find_start(self) -> None:
        """The finished checkpoints to try, newest first (none: the run starts, over in place),
        the data position after the newest, and the first batches every rank checks."""
        app, rank, world = self.app, self.rank, self.world
        self.candidates = resume_candidates(app.run.resume, app.hardware, self.run_dir, rank, world)
        self.last: Link | None = self.candidates[0] if self.candidates else None
        self.start_step = self.last.step if self.last is not None else 0
        self.position = (
            checkpoint_position(self.last.path) if self.last is not None else Position(0, 0)
        )
        self.first = source(app.data, rank, world, Split.TRAIN, self.position.batch)
        self.held_out = source(app.data, rank, world, Split.EVAL)
        self.probe = _on_all_ranks(
            lambda: _first_batches(app, self.first, self.held_out, self.eval_cap != 0), world
        )
        self.log = self._run_log()
        if self.last is None:
            _on_all_ranks(lambda: start_over(app.hardware, self.run_dir, rank), world)

    def _run_log(self) -> RunLog:
        return RunLog(
            self.run_dir,
            enabled=self.rank == 0,
            tensorboard=self.tensorboard,
            resumed_at=self.start_step if self.last is not None else None,
        )

    # ------------------------------------------------------------------------ the model

    def _build(self) -> tuple[DistributedModelParallel, CombinedOptimizer, str, torch.Tensor]:
        """The model and optimizer, and how many tier files were created and reopened (summed
        over ranks)."""
        hardware = self.app.hardware
        files_before = tier_files(hardware, self.run_dir, self.rank)
        with errors_explained(self.app):
            model, optimizer, plan_text = build_model(
                self.app, self.world, self.last is not None, self.device, before_build=self._vet
            )
        files_after = tier_files(hardware, self.run_dir, self.rank)
        self.rebuilt = sorted(set(files_after) - set(files_before))
        reopened = sum(1 for p, ino in files_after.items() if files_before.get(p) == ino)
        counts = torch.tensor([len(files_after) - reopened, reopened], device=self.device)
        if self.world > 1:
            dist.all_reduce(counts)
        return model, optimizer, plan_text, counts

    def _vet(self, plan: EmbeddingModuleShardingPlan, hot_rows: Any) -> None:
        """Before any tier file is created or opened: caches that cannot hold the first batch,
        a plan other than the checkpoint's and tier files that would not fit their disks stop
        the run; a new run records its plan (and so its tier files, which a rerun may then
        remove to start over)."""
        app, rank, world, run_dir = self.app, self.rank, self.world, self.run_dir
        record = plan_record(app.hardware, run_dir, plan, world, self.device.type)
        if world > 1:  # each rank names its own files: tier roots may differ between nodes
            mine: list[object] = [None] * world
            dist.all_gather_object(mine, record["files"].get(str(rank), []))
            record["files"] = {str(r): files for r, files in enumerate(mine)}
        if os.environ.get("LOCAL_RANK", "0") == "0":  # once per node
            used = {
                ps.tier_options.tier
                for ps in plan.values()
                if isinstance(ps, TieredParameterSharding)
            }
            storage = used & {Tier.BYTE_SCM, Tier.BLOCK_SCM}
            dirs = {
                tier.value: tier_dir(app.hardware, run_dir, tier.value, rank) for tier in storage
            }
            for warning in network_storage_warnings(dirs):
                logger.warning(warning)

        replanned = False

        def check() -> None:
            nonlocal replanned
            if self.probe is not None:
                check_cache_sizes(app.planner, app.data, plan, self.probe, hot_rows)
            changed = plan_changes(run_dir, record) if self.last is not None else None
            if changed is not None:
                replanned = _replan(app.run.replan, run_dir, changed, world)
                if not replanned:
                    raise RunDirError(changed)
            no_room = tier_space_problem(app.hardware, run_dir, plan, rank)
            if no_room is not None:
                raise ConfigError(no_room)

        _on_all_ranks(check, world)
        if self.last is not None:
            for path in virtual_tier_files(app.hardware, run_dir, plan, rank):
                path.unlink()  # the checkpoint holds its live rows and their ids
                logger.info(
                    "rank %d: %s (a virtual table) is rebuilt from the checkpoint", rank, path
                )
        if replanned:
            # Every rank's old files must be gone before any rank creates the new plan's.
            _on_all_ranks(lambda: drop_old_tier_files(run_dir, rank, world), world)
        if rank == 0 and (self.last is None or replanned or not (run_dir / PLAN_FILE).exists()):
            save_plan(run_dir, record)

    def _restore(self, manager: CheckpointManager) -> None:
        """Loads the newest checkpoint that loads (falling back past a damaged one)."""
        assert self.last is not None
        t0 = time.perf_counter()
        loaded = load_newest(manager)
        if loaded != self.last:  # fell back past a damaged checkpoint: continue from the older
            self.last = loaded
            self.start_step = loaded.step
            self.position = checkpoint_position(loaded.path)
            self.first = source(
                self.app.data, self.rank, self.world, Split.TRAIN, self.position.batch
            )
            self.log = self._run_log()
        self.phases["restore"] = time.perf_counter() - t0
        if self.rebuilt:
            logger.warning(
                "rank %d: rebuilt %d missing tier file(s) from checkpoint %s: %s",
                self.rank,
                len(self.rebuilt),
                self.last.path,
                ", ".join(self.rebuilt),
            )
        logger.info(
            "resumed from %s at step %d (epoch %d, batch %d)",
            self.last.path,
            self.start_step,
            *self.position,
        )

    def _announce(self, plan_text: str) -> None:
        if self.rank == 0:
            (self.run_dir / "plan.txt").write_text(plan_text + "\n")
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
            ranks = f"{self.world} rank{'s' if self.world > 1 else ''} on {self.device.type}"
            print(f"Sharding plan ({ranks}):\n{plan_text}", flush=True)

    # ------------------------------------------------------------------------ training

    def _train_and_report(
        self,
        model: DistributedModelParallel,
        optimizer: CombinedOptimizer,
        manager: CheckpointManager,
        file_counts: torch.Tensor,
    ) -> dict[str, Any]:
        app, rank, world, device = self.app, self.rank, self.world, self.device
        run = app.run
        schedule, position = self.schedule, self.position
        batch_size = app.data.batch_size
        model.train()
        first = self.first
        progress = Progress(
            total=schedule.total(len(first) + position.batch if isinstance(first, Sized) else None),
            initial=self.start_step,
            enabled=rank == 0 and run.progress,
            every_s=run.progress_every_s,
        )
        log_every = run.log_every
        window = TrainWindow(model, batch_size, device)
        losses: list[float] = []
        # This window's losses, still on the device: read at each report, so that a GPU step
        # never waits for its loss.
        pending: list[torch.Tensor] = []
        samples = 0  # this rank's
        groups = tiered_groups(model)
        io_before = snapshot(groups)
        timed_start = time.perf_counter()
        ckpt_every = run.checkpoint_every
        state = DataState()
        train_stream = training_batches(
            app.data, rank, world, device, schedule, position, first, state, self.read_ahead
        )
        stream: Iterator[Batch] = train_stream
        if schedule.steps is not None:
            stream = itertools.islice(stream, max(0, schedule.steps - self.start_step))
        step_fn = _plain_step(model, optimizer, stream, device)
        pipeline: LookaheadTrainPipeline[Batch, Any] | None = None
        if self.lookahead:
            pipeline = LookaheadTrainPipeline(model, optimizer, device, lookahead=self.lookahead)
            # Planning a batch ahead makes and evicts a virtual table's ids: the pipeline then
            # plans nothing past a checkpoint's step before it is saved, so that a resumed run
            # plans those batches as the uninterrupted one did.
            drained = ckpt_every if _has_virtual_tables(groups) else 0
            step_fn = _pipelined_step(pipeline, stream, self.start_step, drained)
        running = pipeline if pipeline is not None else contextlib.nullcontext()
        step, saved = self.start_step, self.last

        def checkpoint(full: bool = False) -> Link:
            """Saves at ``step``: incremental on the last saved or loaded checkpoint when due."""
            started = time.perf_counter()
            link = save_checkpoint(manager, self.run_dir, step, position, full)
            self.saves.append(
                {
                    "step": step,
                    "parent": link.parent,
                    "seconds": time.perf_counter() - started,
                    "bytes": link.size_bytes() if rank == 0 else None,
                }
            )
            return link

        def take_losses() -> None:
            if pending:
                losses.extend(torch.stack(pending).tolist())
                pending.clear()

        def report() -> dict[str, str]:
            """A collective: the window's numbers to the history, TensorBoard and progress."""
            take_losses()
            record = window.report()
            self.log.train(step, position.epoch, record)
            return {
                "samples_s": f"{record['samples_per_s']:,.0f}",
                "loss": f"{record['loss']:.4f}",
                "hit": "n/a" if record["hit_rate"] is None else f"{record['hit_rate']:.3f}",
                "stall": f"{record['stall_share']:.1%}",
            }

        try:
            with errors_explained(app, self.run_dir), running:
                while schedule.steps is None or step < schedule.steps:
                    try:
                        loss, logits, labels = step_fn()
                    except StopIteration:
                        break
                    step += 1
                    position = state.trained()
                    pending.append(loss)
                    samples += int(labels.numel())
                    window.add(loss, logits, labels)
                    progress.update(report() if step % log_every == 0 else None)
                    if ckpt_every and step % ckpt_every == 0:
                        # The last step's checkpoint is the run's final one: always full.
                        final = step == schedule.steps and run.final_checkpoint
                        saved = checkpoint(full=final)
                if window.steps:
                    progress.show(report())  # the last steps, short of a whole window
                take_losses()
            progress.close()
            elapsed = time.perf_counter() - timed_start
            io_train = io_totals(io_before, snapshot(groups), elapsed, world, device)
            all_samples = torch.tensor([samples], dtype=torch.float64, device=device)
            if world > 1:
                dist.all_reduce(all_samples)
            self.warned.extend(short_of_schedule(app.data, schedule, state, step))
            self.phases["train"] = elapsed

            # Saved before evaluation, so a failure there loses no training.
            ckpt: Path | None
            if not run.final_checkpoint:
                # The tiers hold the trained rows, but only a finished checkpoint resumes.
                found = last_checkpoint(self.run_dir)
                ckpt = found[1] if found is not None else None
            elif (
                saved is not None
                and saved.step == step
                and not (self.saves and self.saves[-1]["parent"])
            ):
                ckpt = saved.path  # nothing new to save
            else:
                # Full, so that it loads alone (an export any dcp user can read); an incremental
                # one of the same step is replaced.
                saved = checkpoint(full=True)
                ckpt = saved.path
            # Every checkpoint's time, the periodic ones included (which the training time,
            # measured around the loop, also holds).
            self.phases["checkpoint"] = sum(float(one["seconds"]) for one in self.saves)
            result = self._evaluate(model, step, batch_size)
        finally:
            train_stream.close()  # stops the data read-ahead thread
            self.log.close()
        epoch_batches = state.epoch_batches
        finished = epoch_batches is not None and position.batch >= epoch_batches
        stats = gathered_tier_stats(model, world)
        tail = losses[-max(1, len(losses) // 10) :]
        metrics: dict[str, Any] = {
            "world_size": world,
            "steps": step,
            "resumed_from_step": self.start_step if self.last is not None else None,
            "epochs_completed": position.epoch + int(finished),
            "batches_per_epoch": epoch_batches,
            "samples_per_s": float(all_samples) / elapsed if elapsed > 0 else 0.0,
            "seconds": self.phases,
            "train_loss_last": losses[-1] if losses else None,
            # This rank's first losses of this run, exact: two plans of one model (e.g. every
            # table FUSED, and tiered) train to the same ones from the same start.
            "train_losses_first": losses[:FIRST_LOSSES],
            "train_loss_mean_last_10pct": sum(tail) / len(tail) if tail else None,
            "eval_auc": result.auc if result else None,
            "eval_ne": result.ne if result else None,
            "eval_calibration": result.calibration if result else None,
            "eval_samples": result.samples if result else 0,
            "eval_batches": result.batches if result else 0,
            "cache_hit_rate": hit_rate(stats),
            "lookahead": self.lookahead,
            **io_train,
            "tables": stats,
            "tier_files": {"created": int(file_counts[0]), "reopened": int(file_counts[1])},
            "checkpoint": str(ckpt) if ckpt is not None else None,
            "checkpoints_saved": self.saves,
            "run_dir": str(self.run_dir),
            "warnings": self.warned,
        }
        return self._report(metrics)

    def _evaluate(
        self, model: DistributedModelParallel, step: int, batch_size: int
    ) -> EvalResult | None:
        t0 = time.perf_counter()
        result: EvalResult | None = None
        if self.eval_cap != 0:
            batches, _ = in_step(self.held_out, self.world, self.device, self.read_ahead)
            try:
                with errors_explained(self.app, self.run_dir):
                    result = evaluate(
                        model, itertools.islice(batches, self.eval_cap), self.device, batch_size
                    )
            finally:
                batches.close()  # stops its read-ahead thread
            self.log.eval(step, result)
            self.warned.extend(_eval_warnings(self.app.data, result, self.world))
        self.phases["eval"] = time.perf_counter() - t0
        return result

    # ------------------------------------------------------------------------ reporting

    def _report(self, metrics: dict[str, Any]) -> dict[str, Any]:
        if self.rank == 0:
            for message in self.warned:
                logger.warning("%s", message)
            (self.run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
            print(summary(metrics, self.run_dir), flush=True)
        return metrics


def _plain_step(
    model: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    batches: Iterator[Batch],
    device: torch.device,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One step of the plain loop (no look-ahead): each batch's rows are read from the tiers
    when its forward needs them. Returns ``(loss, logits, labels)``, the loss still on the
    device; raises StopIteration at the end of the data."""

    host_check = HostBoundsCheck(model)  # ids checked before the copy: no device sync

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        batch = host_check.to_device(next(batches), device)
        optimizer.zero_grad()
        loss, (_, logits, labels) = model(batch)
        loss.backward()
        optimizer.step()
        return loss.detach(), logits, labels

    return step


def _has_virtual_tables(groups: Sequence[TieredTableGroup]) -> bool:
    return any(shard.virtual is not None for group in groups for shard in group.shards)


def _pipelined_step(
    pipeline: LookaheadTrainPipeline[Batch, Any],
    batches: Iterator[Batch],
    start_step: int = 0,
    drained_every: int = 0,
) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """One step of the look-ahead pipeline: the same ``(loss, logits, labels)`` as the plain
    step. With ``drained_every``, the pipeline reads no batch past each multiple of it (of
    steps counted from 0, the run's first ``start_step``): it runs out there, and starts over
    on the batches after at the next step."""
    step_of = [start_step]

    def segment() -> Iterator[Batch]:
        if not drained_every:
            return batches
        return itertools.islice(batches, drained_every - step_of[0] % drained_every)

    current = [segment()]

    def step() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        try:
            loss, logits, labels = pipeline.progress(current[0])
        except StopIteration:
            if not drained_every:
                raise
            current[0] = segment()  # past a drained step: the batches after it
            loss, logits, labels = pipeline.progress(current[0])
        step_of[0] += 1
        return loss.detach(), logits, labels

    return step
