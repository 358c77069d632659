"""Train and evaluate a DLRM whose large tables live on storage tiers.

Run ``python -m apps.dlrm.train`` (Hydra; override anything, e.g. ``run.steps=50``). Under
torchrun / ``torchx run -s local_cwd`` each process joins the job's group (NCCL on CUDA, gloo on
CPU) from the environment; alone, it forms a one-process group. ``main(cfg)`` is the testable
entry point. Its parts: ``model`` (plan, sharded DLRM, optimizers), ``checkpoints``, ``report``
(evaluation, summary) and ``errors``.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import hydra
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

from apps.dlrm.checkpoints import (
    last_checkpoint,
    load_checkpoint,
    resume_point,
    save_checkpoint,
    tier_files,
)
from apps.dlrm.data import build_dataloader
from apps.dlrm.errors import USER_ERRORS, ConfigError, one_paragraph
from apps.dlrm.model import CONF_DIR, build_model, lookahead_depth
from apps.dlrm.progress import Progress
from apps.dlrm.report import evaluate, gathered_tier_stats, hit_rate, io_totals, summary
from torchrec_mtrains.cache.table_cache import CacheTooSmallError
from torchrec_mtrains.distributed.runtime import (
    init_process_group,
    resolve_device,
)
from torchrec_mtrains.pipeline import LookaheadTrainPipeline, snapshot, tier_stats, tiered_groups
from torchrec_mtrains.tiers.base import RowStoreError

logger: logging.Logger = logging.getLogger("apps.dlrm.train")


def compute_device(cfg: DictConfig) -> torch.device:
    """``run.device`` (auto / cpu / cuda) as this rank's device: ``cuda:<LOCAL_RANK>`` on GPUs."""
    try:
        return resolve_device(str(OmegaConf.select(cfg, "run.device", default="auto")))
    except ValueError as e:
        raise ConfigError(f"run.{e}") from None


def _agree_run_dir(cfg: DictConfig, world: int) -> DictConfig:
    """Every rank composes its own config, so a timestamped ``run.dir`` can differ between them:
    all ranks adopt rank 0's (and so its tier root, which interpolates it)."""
    if world == 1:
        return cfg
    chosen: list[object] = [str(cfg.run.dir)]
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] == str(cfg.run.dir):
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.run.dir = chosen[0]
    return cfg


def _prepare_run_dir(cfg: DictConfig) -> Path:
    run_dir = Path(str(cfg.run.dir))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"run.dir={run_dir} is not writable ({e.strerror}). The run writes its plan, "
            "metrics, checkpoints and tier files there: pass run.dir=<a writable directory>."
        ) from None
    return run_dir


def _batches(cfg: DictConfig, rank: int, world: int, start: int) -> Iterator[Batch]:
    """This rank's batches from ``start`` on; data config problems (a missing file, a bad
    value) surface here, before any table is built."""
    data = OmegaConf.to_container(cfg.data, resolve=True)
    if not isinstance(data, dict):
        raise ConfigError(f"data must be a mapping, got {data!r}")
    try:
        source = build_dataloader(data, rank, world, start_batch=start)  # type: ignore[arg-type]
    except FileNotFoundError as e:
        raise ConfigError(
            f"data file not found: {e.filename or e}. Point the data config at existing files, "
            "e.g. data=criteo_tsv data.paths=[/path/day_0.tsv], or use data=synthetic."
        ) from None
    except ValueError as e:
        raise ConfigError(f"data (kind {data.get('kind')!r}): {e}") from None
    return iter(source)


def main(cfg: DictConfig) -> dict[str, Any]:
    """Trains ``cfg.run.steps`` batches, evaluates, writes ``metrics.json``; returns the metrics.

    Raises:
        ConfigError: for a configuration the user must fix (bad value, missing file,
            unwritable ``run.dir``, a run directory that already holds a run).
    """
    threads = int(cfg.run.get("num_threads", 0))
    caller_threads = torch.get_num_threads()
    if threads > 0:
        torch.set_num_threads(threads)
    group = init_process_group(compute_device(cfg))
    try:
        cfg = _agree_run_dir(cfg, group.world_size)
        run_dir = _prepare_run_dir(cfg)
        return _train(cfg, run_dir, group.rank, group.world_size, group.device)
    finally:
        if group.created:
            dist.destroy_process_group()
        torch.set_num_threads(caller_threads)


@contextlib.contextmanager
def _cache_errors_explained(cfg: DictConfig) -> Iterator[None]:
    """A batch with more distinct rows of a table than its cache holds is a sizing problem.
    With look-ahead the cache holds ``lookahead + 1`` batches at once."""
    try:
        yield
    except CacheTooSmallError as e:
        lookahead = int(cfg.pipeline.get("lookahead", 0))
        also = (
            f", or lower pipeline.lookahead (now {lookahead}: the cache holds that many "
            "batches besides the running one)"
            if lookahead
            else ""
        )
        if "cache_load_factor" in cfg.planner:
            knob = f"planner.cache_load_factor (now {cfg.planner.cache_load_factor})"
        else:
            knob = f"planner.min_cache_factor (now {cfg.planner.get('min_cache_factor')})"
        raise ConfigError(
            f"{e}. Raise {knob} or lower data.batch_size (now {cfg.data.batch_size}){also}."
        ) from None


def _train(
    cfg: DictConfig, run_dir: Path, rank: int, world: int, device: torch.device
) -> dict[str, Any]:
    torch.manual_seed(int(cfg.run.seed))
    lookahead = lookahead_depth(cfg)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    last = resume_point(cfg, run_dir, rank)
    start = last[0] if last is not None else 0
    batches = _batches(cfg, rank, world, start)
    files_before = tier_files(cfg, rank)
    try:
        model, optimizer, plan_text = build_model(cfg, world, last is not None, device)
    except RowStoreError as e:
        raise ConfigError(f"tier storage (hardware.*): {e}") from None
    files_after = tier_files(cfg, rank)
    reopened = sum(1 for p, ino in files_after.items() if files_before.get(p) == ino)
    file_counts = torch.tensor([len(files_after) - reopened, reopened], device=device)
    if world > 1:
        dist.all_reduce(file_counts)
    phases["build"] = time.perf_counter() - t0
    if last is not None:
        t0 = time.perf_counter()
        load_checkpoint(model, optimizer, last[1])
        phases["restore"] = time.perf_counter() - t0
        logger.info("resumed from %s at step %d", last[1], start)
    if rank == 0:
        (run_dir / "plan.txt").write_text(plan_text + "\n")
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
        ranks = f"{world} rank{'s' if world > 1 else ''} on {device.type}"
        print(f"Sharding plan ({ranks}):\n{plan_text}", flush=True)

    steps = int(cfg.run.steps)
    model.train()
    progress = Progress(
        total=steps,
        initial=start,
        enabled=rank == 0 and bool(cfg.run.progress),
        every_s=float(cfg.run.progress_every_s),
    )
    losses: list[float] = []
    samples = 0
    groups = tiered_groups(model)
    io_before = snapshot(groups)
    timed_start = time.perf_counter()
    ckpt_every = int(cfg.run.checkpoint_every)
    log_every = max(1, int(cfg.run.log_every))
    step_fn = _plain_step(model, optimizer, batches, device)
    pipeline: LookaheadTrainPipeline[Batch, Any] | None = None
    if lookahead:
        # The pipeline reads ahead, so it gets exactly the training batches: evaluation
        # continues on `batches` where training stopped, as in the plain loop.
        pipeline = LookaheadTrainPipeline(model, optimizer, device, lookahead=lookahead)
        step_fn = _pipelined_step(pipeline, itertools.islice(batches, steps - start))
    running = pipeline if pipeline is not None else contextlib.nullcontext()
    with _cache_errors_explained(cfg), running:
        for step in range(start, steps):
            try:
                loss, batch_size = step_fn()
            except StopIteration:
                logger.warning("data ran out after %d batches", step)
                break
            losses.append(loss)
            samples += batch_size * world
            fields = None
            if rank == 0 and (step + 1) % log_every == 0:
                rate = samples / (time.perf_counter() - timed_start)
                so_far = snapshot(groups) - io_before
                fields = {
                    "samples_s": f"{rate:,.0f}",
                    "loss": f"{losses[-1]:.4f}",
                    "hit": f"{hit_rate(tier_stats(model)):.3f}",
                    "stall": f"{so_far.io.stall_seconds / (time.perf_counter() - timed_start):.1%}",
                }
            progress.update(fields)
            if ckpt_every and (step + 1) % ckpt_every == 0 and step + 1 < steps:
                save_checkpoint(model, optimizer, run_dir, step + 1)
    progress.close()
    elapsed = time.perf_counter() - timed_start
    io_train = io_totals(io_before, snapshot(groups), elapsed, world, device)
    trained_steps = len(losses)

    phases["train"] = elapsed
    t0 = time.perf_counter()
    with _cache_errors_explained(cfg):
        auc, ne = evaluate(model, batches, int(cfg.run.eval_batches), device)
    phases["eval"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt: Path | None
    if not cfg.run.final_checkpoint:
        # The tiers hold the trained rows, but only a finished checkpoint can be resumed from.
        found = last_checkpoint(run_dir)
        ckpt = found[1] if found is not None else None
    elif trained_steps == 0 and last is not None:
        ckpt = last[1]  # nothing new to save
    else:
        ckpt = save_checkpoint(model, optimizer, run_dir, start + trained_steps)
    phases["checkpoint"] = time.perf_counter() - t0
    stats = gathered_tier_stats(model, world)
    tail = losses[-max(1, len(losses) // 10) :]
    metrics: dict[str, Any] = {
        "world_size": world,
        "steps": start + trained_steps,
        "resumed_from_step": start if last is not None else None,
        "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
        "seconds": phases,
        "train_loss_last": losses[-1] if losses else None,
        "train_loss_mean_last_10pct": sum(tail) / len(tail) if tail else None,
        "eval_auc": auc,
        "eval_ne": ne,
        "cache_hit_rate": hit_rate(stats),
        "lookahead": lookahead,
        **io_train,
        "tables": stats,
        "tier_files": {"created": int(file_counts[0]), "reopened": int(file_counts[1])},
        "checkpoint": str(ckpt) if ckpt is not None else None,
        "run_dir": str(run_dir),
    }
    if rank == 0:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        print(summary(metrics, run_dir), flush=True)
    return metrics


def _plain_step(
    model: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    batches: Iterator[Batch],
    device: torch.device,
) -> Callable[[], tuple[float, int]]:
    """One step of the plain loop (no look-ahead): each batch's rows are read from the tiers
    when its forward needs them. Returns ``(loss, samples)``; raises StopIteration at the end
    of the data."""

    def step() -> tuple[float, int]:
        batch = next(batches).to(device, non_blocking=True)
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        return float(loss.detach()), int(batch.labels.numel())

    return step


def _pipelined_step(
    pipeline: LookaheadTrainPipeline[Batch, Any], batches: Iterator[Batch]
) -> Callable[[], tuple[float, int]]:
    """One step of the look-ahead pipeline: the same ``(loss, samples)`` as the plain step."""

    def step() -> tuple[float, int]:
        loss, _, labels = pipeline.progress(batches)
        return float(loss), int(labels.numel())

    return step


def _exit_with(error: BaseException) -> NoReturn:
    if os.environ.get("MTRAINS_TRACEBACK") == "1":
        raise error
    print(f"error: {one_paragraph(error)}", file=sys.stderr, flush=True)
    sys.exit(2)


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    try:
        main(cfg)
    except USER_ERRORS as e:
        # Exiting here, not in run(), keeps Hydra from adding its "Error executing job" line.
        _exit_with(e)


def _quiet_libraries() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("apps").setLevel(logging.INFO)
    # Known, harmless deprecation notes from TorchRec's DMP on this stack.
    warnings.filterwarnings("ignore", category=FutureWarning, module="torchrec")
    logging.getLogger("torch.fx._symbolic_trace").setLevel(logging.ERROR)


@record
def run() -> None:
    """Command-line entry point: Hydra composes the config, :func:`main` runs it.

    Configuration errors (ours, Hydra's and OmegaConf's) print as one ``error:`` paragraph and
    exit with status 2; ``HYDRA_FULL_ERROR=1`` shows their tracebacks instead."""
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        os.environ["MTRAINS_TRACEBACK"] = "1"
    # Let composition errors reach us instead of Hydra printing a trimmed traceback.
    os.environ["HYDRA_FULL_ERROR"] = "1"
    _quiet_libraries()
    try:
        _hydra_main()
    except USER_ERRORS as e:
        _exit_with(e)


if __name__ == "__main__":
    run()
