"""Train and evaluate a DLRM whose large tables live on storage tiers.

Run ``python -m apps.dlrm.train`` (Hydra; override anything, e.g. ``run.steps=50``). Under
torchrun / ``torchx run -s local_cwd`` each process joins the gloo group from the environment;
alone, it forms a one-process group. ``main(cfg)`` is the testable entry point.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import math
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
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException
from torch.distributed.elastic.multiprocessing.errors import record
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from apps.dlrm.data import build_dataloader
from apps.dlrm.placement import format_placements, parse_bytes, size_rule_plan
from torchrec_mtrains.cache.table_cache import CacheTooSmallError
from torchrec_mtrains.distributed import (
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import (
    init_process_group,
    local_world_size,
    resolve_device,
)
from torchrec_mtrains.pipeline import LookaheadTrainPipeline, TierSnapshot, snapshot, tiered_groups
from torchrec_mtrains.planner import plan_from_config
from torchrec_mtrains.profiler import AccessProfile
from torchrec_mtrains.tiers.base import OpenMode, RowStoreError
from torchrec_mtrains.types import Tier

logger: logging.Logger = logging.getLogger("apps.dlrm.train")
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
EBC_PATH = "model.sparse_arch.embedding_bag_collection"
TIER_FILE_GLOB = "*.rows"


class ConfigError(ValueError):
    """A configuration or input problem the user can fix; printed as one paragraph."""


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


def _size_option(cfg: DictConfig, key: str) -> int:
    value = OmegaConf.select(cfg, key)
    try:
        size = parse_bytes(value, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if size < 0:
        raise ConfigError(f"{key}={value!r} is negative; give a size such as 64MB or 0")
    return size


def build_storage(cfg: DictConfig, resume: bool) -> TierStorage:
    """Where the tier files go: ``hardware.tier_root`` unless ``hardware.dirs`` names a tier."""
    hw = cfg.hardware
    try:
        return TierStorage(
            root=str(hw.tier_root),
            dirs={str(k): str(v) for k, v in hw.dirs.items()},
            tier_options={"block_scm": {"block_size": int(hw.block_size)}},
            open_mode=OpenMode.OPEN if resume else OpenMode.CREATE,
        )
    except ValueError as e:
        raise ConfigError(f"hardware: {e}") from None


def _check_model_config(cfg: DictConfig) -> list[int]:
    sizes = [int(n) for n in cfg.model.num_embeddings_per_feature]
    features = int(cfg.data.get("num_sparse_features", 26))
    if len(sizes) != features:
        raise ConfigError(
            f"model.num_embeddings_per_feature has {len(sizes)} entries but the data has "
            f"{features} sparse features: give one size per feature"
        )
    if any(n < 1 for n in sizes):
        raise ConfigError(f"model.num_embeddings_per_feature={sizes}: every table needs >= 1 row")
    dim = int(cfg.model.embedding_dim)
    dense = list(cfg.model.dense_arch_layer_sizes)
    if not dense or int(dense[-1]) != dim:
        raise ConfigError(
            f"model.dense_arch_layer_sizes={dense} must end in model.embedding_dim={dim}: the "
            "dense output is combined with the embeddings"
        )
    over = list(cfg.model.over_arch_layer_sizes)
    if not over or int(over[-1]) != 1:
        raise ConfigError(f"model.over_arch_layer_sizes={over} must end in 1 (the click logit)")
    return sizes


def build_model(
    cfg: DictConfig, world_size: int, resume: bool, device: torch.device
) -> tuple[DistributedModelParallel, CombinedOptimizer, str]:
    """The sharded DLRM on ``device`` (tiered tables' rows on their tiers, their caches and
    every other table on ``device``), its combined optimizer and the plan printout."""
    sizes = _check_model_config(cfg)
    dim = int(cfg.model.embedding_dim)
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(sizes)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    dense_in = int(cfg.data.get("num_dense_features", 13))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=dense_in,
            dense_arch_layer_sizes=list(cfg.model.dense_arch_layer_sizes),
            over_arch_layer_sizes=list(cfg.model.over_arch_layer_sizes),
            dense_device=device,
        )
    )
    lr = float(cfg.run.learning_rate)
    tiered_planner = str(cfg.planner.get("name", "")) == "tiered"
    sharder = TieredEmbeddingBagCollectionSharder(
        build_storage(cfg, resume),
        offer_tiered_kernel=tiered_planner,
        fused_params={"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr},
    )
    try:
        if tiered_planner:
            plan, plan_text = _tiered_plan(cfg, ebc, sharder, world_size, device)
        else:
            planner = cfg.planner
            plan, placements = size_rule_plan(
                ebc,
                sharder,
                world_size,
                dram_budget=_size_option(cfg, "planner.dram_budget"),
                block_scm_min_bytes=_size_option(cfg, "planner.block_scm_min_bytes"),
                cache_load_factor=float(planner.cache_load_factor),
                cache_policy=str(planner.cache_policy),
                device_type=device.type,
            )
            plan_text = format_placements(placements)
    except ConfigError:
        raise
    except PlannerError as e:  # nothing fits: name the tiers that overflow and the knobs
        over = [" ".join(line.split()) for line in str(e).splitlines() if "OVER" in line]
        raise ConfigError(
            f"planner: the tables fit no placement on {world_size} rank(s): "
            f"{'; '.join(over) or str(e).splitlines()[0]} (tier, rank, demand, capacity). "
            f"Raise planner.dram_budget (now {cfg.planner.get('dram_budget') or 'the hardware'}) "
            "or planner.byte_scm_budget, pick a hardware preset with more memory, add ranks, "
            "or shrink model.num_embeddings_per_feature."
        ) from None
    except ValueError as e:  # the options' own checks
        raise ConfigError(f"planner: {e}") from None
    dmp = DistributedModelParallel(
        model,
        device=device,
        plan=ShardingPlan({EBC_PATH: plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=lr),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    return dmp, optimizer, plan_text


def _tiered_plan(
    cfg: DictConfig,
    ebc: EmbeddingBagCollection,
    sharder: TieredEmbeddingBagCollectionSharder,
    world_size: int,
    device: torch.device,
) -> tuple[Any, str]:
    """The profile-driven planner's plan, and the profile's hot rows pinned in the caches of
    the tables it put on a tier (up to an eighth of each cache)."""
    # The look-ahead pipeline keeps lookahead + 1 batches resident at once and overlaps tier
    # I/O with compute: the planner must size caches and estimate step time for that.
    lookahead = _lookahead(cfg)
    planned = cfg.copy()
    with open_dict(planned):
        planned.planner.min_cache_factor = max(
            float(cfg.planner.get("min_cache_factor", 2.0)), 1.5 * (lookahead + 1)
        )
        planned.planner.overlap_tier_io = lookahead > 0
    table_plan = plan_from_config(
        planned,
        ebc,
        sharder,
        world_size,
        local_world_size=min(world_size, local_world_size()),
        compute_device=device.type,
    )
    profile_path = str(cfg.planner.get("profile") or "")
    if profile_path and bool(cfg.planner.get("pin_hot_rows", True)):
        profile = AccessProfile.from_json(profile_path)
        rows = {c.name: c.num_embeddings for c in ebc.embedding_bag_configs()}
        hot: dict[str, list[int]] = {}
        for name, ps in table_plan.plan.items():
            if not isinstance(ps, TieredParameterSharding) or name not in profile:
                continue
            shards = max(1, len(ps.ranks or [0]))
            room = ps.tier_options.cache_rows(rows[name] // shards) // 8
            hot[name] = list(profile[name].hot_rows[:room])
        sharder.hot_rows = hot
    return table_plan.plan, str(table_plan.summary)


def tier_stats(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """Per-table cache and tier counters of every tiered sharded module on this rank."""
    out: dict[str, dict[str, float]] = {}
    for module in model.modules():
        stats = getattr(module, "tier_stats", None)
        if callable(stats) and hasattr(module, "_tier_storage"):
            out.update(stats())
    return out


def gathered_tier_stats(model: torch.nn.Module, world: int) -> dict[str, dict[str, float]]:
    """:func:`tier_stats` of every rank merged (tables are sharded over ranks)."""
    stats = tier_stats(model)
    if world == 1:
        return stats
    parts: list[Any] = [None] * world
    dist.all_gather_object(parts, stats)
    merged: dict[str, dict[str, float]] = {}
    for part in parts:
        merged.update(part)
    return merged


def tier_files(cfg: DictConfig, rank: int) -> dict[str, tuple[int, int]]:
    """This rank's tier files, path -> (device, inode), to tell reopened files from new ones."""
    roots = [Path(str(cfg.hardware.tier_root)) / t.value for t in Tier]
    roots += [Path(str(d)) for d in cfg.hardware.dirs.values()]
    out: dict[str, tuple[int, int]] = {}
    for root in roots:
        for path in (root / f"rank{rank}").glob(TIER_FILE_GLOB):
            st = path.stat()
            out[str(path)] = (st.st_dev, st.st_ino)
    return out


def _hit_rate(stats: dict[str, dict[str, float]]) -> float:
    lookups = sum(s["lookups"] for s in stats.values())
    return sum(s["hits"] for s in stats.values()) / lookups if lookups else 0.0


def _checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def _last_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    done = sorted((run_dir / "checkpoints").glob("step_*/DONE"))
    if not done:
        return None
    path = done[-1].parent
    return int(path.name.split("_")[1]), path


def save_checkpoint(
    model: DistributedModelParallel, optimizer: CombinedOptimizer, run_dir: Path, step: int
) -> Path:
    """Saves model and optimizer with torch.distributed.checkpoint; tiered tables stream from
    their tiers chunk by chunk. A ``DONE`` file marks the checkpoint complete."""
    path = _checkpoint_dir(run_dir, step)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        (path / "DONE").write_text(str(step))
    dist.barrier()
    return path


def load_checkpoint(
    model: DistributedModelParallel, optimizer: CombinedOptimizer, path: Path
) -> None:
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])


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


def _lookahead(cfg: DictConfig) -> int:
    value = OmegaConf.select(cfg, "pipeline.lookahead", default=0)
    try:
        lookahead = int(value)
    except (TypeError, ValueError):
        lookahead = -1
    if lookahead < 0 or isinstance(value, bool):
        raise ConfigError(
            f"pipeline.lookahead={value!r}: give the number of batches to prefetch ahead of the "
            "running one (0 = the plain training loop, no look-ahead)"
        )
    return lookahead


def io_totals(
    before: TierSnapshot,
    after: TierSnapshot,
    seconds: float,
    world: int,
    device: torch.device,
) -> dict[str, float]:
    """Tier I/O of the training phase: ``stall_s`` the training thread spent blocked on tier
    I/O (the slowest rank's, as the slowest rank sets the pace), ``prefetch_io_s`` and
    ``rows_fetched`` summed over ranks, ``stall_share`` of the training time."""
    delta = after - before
    # On the process group's device: NCCL reduces CUDA tensors only.
    stall = torch.tensor([delta.io.stall_seconds], dtype=torch.float64, device=device)
    summed = torch.tensor(
        [delta.io.io_seconds, float(delta.io.rows_fetched)], dtype=torch.float64, device=device
    )
    if world > 1:
        dist.all_reduce(stall, op=dist.ReduceOp.MAX)
        dist.all_reduce(summed)
    return {
        "stall_s": float(stall[0]),
        "prefetch_io_s": float(summed[0]),
        "rows_fetched": int(summed[1]),
        "stall_share": float(stall[0]) / seconds if seconds > 0 else 0.0,
    }


def _resume_point(cfg: DictConfig, run_dir: Path, rank: int) -> tuple[int, Path] | None:
    last = _last_checkpoint(run_dir)
    if cfg.run.resume:
        if last is None:
            raise ConfigError(
                f"run.resume=true but {run_dir}/checkpoints holds no finished checkpoint: "
                "point run.dir at an earlier run's directory, or drop run.resume."
            )
        return last
    if last is not None or tier_files(cfg, rank):
        raise ConfigError(
            f"run.dir={run_dir} already holds a run (checkpoints or tier files): pass "
            "run.resume=true to continue it, or choose a new run.dir."
        )
    return None


def _train(
    cfg: DictConfig, run_dir: Path, rank: int, world: int, device: torch.device
) -> dict[str, Any]:
    torch.manual_seed(int(cfg.run.seed))
    lookahead = _lookahead(cfg)
    phases: dict[str, float] = {}
    t0 = time.perf_counter()
    last = _resume_point(cfg, run_dir, rank)
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
    bar = tqdm(
        total=steps,
        initial=start,
        disable=rank != 0 or not cfg.run.progress,
        unit="batch",
        dynamic_ncols=True,
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
            if rank == 0 and (step + 1) % log_every == 0:
                rate = samples / (time.perf_counter() - timed_start)
                so_far = snapshot(groups) - io_before
                bar.set_postfix(
                    samples_s=f"{rate:,.0f}",
                    loss=f"{losses[-1]:.4f}",
                    hit=f"{_hit_rate(tier_stats(model)):.3f}",
                    stall=f"{so_far.io.stall_seconds / (time.perf_counter() - timed_start):.1%}",
                )
            bar.update(1)
            if ckpt_every and (step + 1) % ckpt_every == 0 and step + 1 < steps:
                save_checkpoint(model, optimizer, run_dir, step + 1)
    bar.close()
    elapsed = time.perf_counter() - timed_start
    io_train = io_totals(io_before, snapshot(groups), elapsed, world, device)
    trained_steps = len(losses)

    phases["train"] = elapsed
    t0 = time.perf_counter()
    with _cache_errors_explained(cfg):
        auc, ne = evaluate(model, batches, int(cfg.run.eval_batches), device)
    phases["eval"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    if trained_steps == 0 and last is not None:
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
        "cache_hit_rate": _hit_rate(stats),
        "lookahead": lookahead,
        **io_train,
        "tables": stats,
        "tier_files": {"created": int(file_counts[0]), "reopened": int(file_counts[1])},
        "checkpoint": str(ckpt),
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


@torch.no_grad()
def evaluate(
    model: DistributedModelParallel, batches: Iterator[Batch], count: int, device: torch.device
) -> tuple[float | None, float | None]:
    """AUC and normalized entropy on ``count`` batches not trained on (all ranks gathered)."""
    if count <= 0:
        return None, None
    model.eval()
    logits_all, labels_all = [], []
    for _ in range(count):
        try:
            batch = next(batches).to(device, non_blocking=True)
        except StopIteration:
            break
        _, (_, logits, labels) = model(batch)
        logits_all.append(logits.flatten())
        labels_all.append(labels.flatten())
    model.train()
    if not logits_all:
        return None, None
    logits = torch.cat(logits_all)
    labels = torch.cat(labels_all)
    if dist.get_world_size() > 1:
        gathered_l = [torch.empty_like(logits) for _ in range(dist.get_world_size())]
        gathered_y = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered_l, logits)
        dist.all_gather(gathered_y, labels)
        logits, labels = torch.cat(gathered_l), torch.cat(gathered_y)
    logits, labels = logits.float().cpu(), labels.float().cpu()
    auc = float(BinaryAUROC()(torch.sigmoid(logits), labels.long()))
    bce = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    p = float(labels.mean())
    if not 0.0 < p < 1.0:
        return auc, None
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    ne = bce / base
    return auc, ne


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def summary(metrics: dict[str, Any], run_dir: Path) -> str:
    """The end-of-run table: throughput, quality and per-tier traffic."""
    lines = [
        "",
        "=== summary ===",
        f"steps             {metrics['steps']}",
        f"throughput        {metrics['samples_per_s']:,.0f} samples/s",
        f"eval AUC          {_fmt(metrics['eval_auc'])}",
        f"eval NE           {_fmt(metrics['eval_ne'])}",
        f"cache hit rate    {metrics['cache_hit_rate']:.3f}",
        f"tier stall        {metrics['stall_s']:.2f} s, {metrics['stall_share']:.1%} of "
        f"training (look-ahead {metrics['lookahead'] or 'off'}; prefetch I/O "
        f"{metrics['prefetch_io_s']:.2f} s, {metrics['rows_fetched']:,} rows fetched)",
        "time (s)          "
        + ", ".join(f"{k} {v:.1f}" for k, v in metrics.get("seconds", {}).items()),
        f"{'table':<14}{'hit rate':>10}{'MB read':>10}{'MB written':>12}",
    ]
    for name, s in sorted(metrics["tables"].items()):
        lines.append(
            f"{name:<14}{s['hit_rate']:>10.3f}{s['tier_bytes_read'] / 2**20:>10.1f}"
            f"{s['tier_bytes_written'] / 2**20:>12.1f}"
        )
    lines.append(
        f"outputs in {run_dir.resolve()}: plan.txt, config.yaml, metrics.json, checkpoints/, tiers/"
    )
    return "\n".join(lines)


# Errors a user fixes by changing the command line, printed as one paragraph: ours, Hydra's
# composition errors (unknown preset, bad override syntax) and OmegaConf's (unknown key,
# failed interpolation).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    HydraException,
    OmegaConfBaseException,
)


def one_paragraph(error: BaseException) -> str:
    """The error's message as one paragraph: lines become sentences, an indented listing after
    a ``...:`` line becomes a comma-separated list, and the config search path Hydra appends to
    a missing-preset message is dropped."""
    text = str(error).split("Config search path:")[0]
    parts: list[str] = []
    listing = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if raw[:1].isspace() and parts and (listing or parts[-1].endswith(":")):
            parts[-1] += (", " if listing else " ") + line
            listing = True
            continue
        listing = False
        if parts and parts[-1][-1] not in ".:;,!?":
            parts[-1] += "."
        parts.append(line)
    return " ".join(parts) or type(error).__name__


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
