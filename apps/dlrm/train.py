"""Train and evaluate a DLRM whose large tables live on storage tiers.

Run ``python -m apps.dlrm.train`` (Hydra; override anything, e.g. ``run.steps=50``). Under
torchrun / ``torchx run -s local_cwd`` each process joins the gloo group from the environment;
alone, it forms a one-process group. ``main(cfg)`` is the testable entry point.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from omegaconf import DictConfig, OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from tqdm import tqdm

from apps.dlrm.data import build_dataloader
from apps.dlrm.placement import format_placements, parse_bytes, size_rule_plan
from torchrec_mtrains.distributed import TieredEmbeddingBagCollectionSharder, TierStorage
from torchrec_mtrains.tiers.base import OpenMode

logger: logging.Logger = logging.getLogger("apps.dlrm.train")
CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
EBC_PATH = "model.sparse_arch.embedding_bag_collection"


class ConfigError(ValueError):
    """A configuration or input problem the user can fix; printed as one paragraph."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed() -> tuple[int, int, bool]:
    """Joins (or forms) the gloo process group; returns ``(rank, world_size, created)``."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), False
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    return dist.get_rank(), dist.get_world_size(), True


def _prepare_run_dir(cfg: DictConfig) -> Path:
    run_dir = Path(str(cfg.run.dir))
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(
            f"run.dir={run_dir} is not writable ({e.strerror}). The run writes its plan, "
            "metrics, checkpoints and tier files there: pass run.dir=<a writable directory>."
        ) from None
    return run_dir


def build_model(
    cfg: DictConfig, world_size: int, resume: bool
) -> tuple[DistributedModelParallel, CombinedOptimizer, str]:
    """The sharded DLRM, its combined optimizer and the plan printout."""
    sizes = list(cfg.model.num_embeddings_per_feature)
    if len(sizes) != int(cfg.data.num_sparse_features if "num_sparse_features" in cfg.data else 26):
        raise ConfigError(
            f"model.num_embeddings_per_feature has {len(sizes)} entries but the data has "
            f"{cfg.data.get('num_sparse_features', 26)} sparse features: give one size per feature"
        )
    dim = int(cfg.model.embedding_dim)
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}", embedding_dim=dim, num_embeddings=int(n), feature_names=[f"cat_{i}"]
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
            dense_device=torch.device("cpu"),
        )
    )
    lr = float(cfg.run.learning_rate)
    hw = cfg.hardware
    storage = TierStorage(
        root=str(hw.tier_root),
        dirs={str(k): str(v) for k, v in hw.dirs.items()},
        tier_options={"block_scm": {"block_size": int(hw.block_size)}},
        open_mode=OpenMode.OPEN if resume else OpenMode.CREATE,
    )
    sharder = TieredEmbeddingBagCollectionSharder(
        storage,
        fused_params={"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr},
    )
    planner = cfg.planner
    dram_budget = parse_bytes(planner.dram_budget, "planner.dram_budget")
    plan, placements = size_rule_plan(
        ebc,
        sharder,
        world_size,
        dram_budget=dram_budget,
        block_scm_min_bytes=parse_bytes(planner.block_scm_min_bytes, "planner.block_scm_min_bytes"),
        cache_load_factor=float(planner.cache_load_factor),
        cache_policy=str(planner.cache_policy),
    )
    dmp = DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({EBC_PATH: plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=lr),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    return dmp, optimizer, format_placements(placements)


def tier_stats(model: torch.nn.Module) -> dict[str, dict[str, float]]:
    """Per-table cache and tier counters of every tiered sharded module on this rank."""
    out: dict[str, dict[str, float]] = {}
    for module in model.modules():
        stats = getattr(module, "tier_stats", None)
        if callable(stats) and hasattr(module, "_tier_storage"):
            out.update(stats())
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
    their tiers chunk by chunk."""
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
    data = OmegaConf.to_container(cfg.data, resolve=True)
    assert isinstance(data, dict)
    try:
        yield from build_dataloader(data, rank, world, start_batch=start)  # type: ignore[arg-type]
    except FileNotFoundError as e:
        raise ConfigError(
            f"data file not found: {e.filename or e}. Point the data config at existing files, "
            "e.g. data=criteo_tsv data.paths=[/path/day_0.tsv]."
        ) from None


def main(cfg: DictConfig) -> dict[str, Any]:
    """Trains ``cfg.run.steps`` batches, evaluates, writes ``metrics.json``; returns the metrics."""
    run_dir = _prepare_run_dir(cfg)
    rank, world, created = init_distributed()
    try:
        return _train(cfg, run_dir, rank, world)
    finally:
        if created:
            dist.destroy_process_group()


def _train(cfg: DictConfig, run_dir: Path, rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(int(cfg.run.seed))
    last = _last_checkpoint(run_dir) if cfg.run.resume else None
    if cfg.run.resume and last is None:
        raise ConfigError(
            f"run.resume=true but {run_dir}/checkpoints holds no finished checkpoint: "
            "point run.dir at an earlier run's directory, or drop run.resume."
        )
    model, optimizer, plan_text = build_model(cfg, world, resume=last is not None)
    start = 0
    if last is not None:
        start, path = last
        load_checkpoint(model, optimizer, path)
        logger.info("resumed from %s at step %d", path, start)
    if rank == 0:
        (run_dir / "plan.txt").write_text(plan_text + "\n")
        print(f"Sharding plan ({world} rank{'s' if world > 1 else ''}):\n{plan_text}", flush=True)

    steps = int(cfg.run.steps)
    batches = _batches(cfg, rank, world, start)
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
    timed_start = time.perf_counter()
    ckpt_every = int(cfg.run.checkpoint_every)
    for step in range(start, steps):
        try:
            batch = next(batches)
        except StopIteration:
            logger.warning("data ran out after %d batches", step)
            break
        optimizer.zero_grad()
        loss, _ = model(batch)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        samples += int(batch.labels.numel()) * world
        if rank == 0 and (step + 1) % int(cfg.run.log_every) == 0:
            rate = samples / (time.perf_counter() - timed_start)
            bar.set_postfix(
                samples_s=f"{rate:,.0f}",
                loss=f"{losses[-1]:.4f}",
                hit=f"{_hit_rate(tier_stats(model)):.3f}",
            )
        bar.update(1)
        if ckpt_every and (step + 1) % ckpt_every == 0 and step + 1 < steps:
            save_checkpoint(model, optimizer, run_dir, step + 1)
    bar.close()
    elapsed = time.perf_counter() - timed_start
    trained_steps = len(losses)

    auc, ne = evaluate(model, batches, int(cfg.run.eval_batches))
    ckpt = save_checkpoint(model, optimizer, run_dir, start + trained_steps)
    stats = tier_stats(model)
    metrics: dict[str, Any] = {
        "world_size": world,
        "steps": start + trained_steps,
        "samples_per_s": samples / elapsed if elapsed > 0 else 0.0,
        "train_loss_last": losses[-1] if losses else None,
        "train_loss_mean_last_10pct": (
            sum(losses[-max(1, len(losses) // 10) :]) / max(1, len(losses) // 10)
            if losses
            else None
        ),
        "eval_auc": auc,
        "eval_ne": ne,
        "cache_hit_rate": _hit_rate(stats),
        "tables": stats,
        "checkpoint": str(ckpt),
    }
    if rank == 0:
        (run_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        print(summary(metrics, run_dir), flush=True)
    return metrics


@torch.no_grad()
def evaluate(
    model: DistributedModelParallel, batches: Iterator[Batch], count: int
) -> tuple[float | None, float | None]:
    """AUC and normalized entropy on ``count`` batches not trained on (all ranks gathered)."""
    if count <= 0:
        return None, None
    model.eval()
    logits_all, labels_all = [], []
    for _ in range(count):
        try:
            batch = next(batches)
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
    auc = float(BinaryAUROC()(torch.sigmoid(logits), labels.long()))
    bce = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    p = float(labels.mean())
    if not 0.0 < p < 1.0:
        return auc, None
    base = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    ne = bce / base
    return auc, ne


def summary(metrics: dict[str, Any], run_dir: Path) -> str:
    """The end-of-run table: throughput, quality and per-tier traffic."""
    lines = [
        "",
        "=== summary ===",
        f"steps             {metrics['steps']}",
        f"throughput        {metrics['samples_per_s']:,.0f} samples/s",
        f"eval AUC          {metrics['eval_auc'] if metrics['eval_auc'] is None else round(metrics['eval_auc'], 4)}",
        f"eval NE           {metrics['eval_ne'] if metrics['eval_ne'] is None else round(metrics['eval_ne'], 4)}",
        f"cache hit rate    {metrics['cache_hit_rate']:.3f}",
        f"{'table':<14}{'hit rate':>10}{'MB read':>10}{'MB written':>12}",
    ]
    for name, s in sorted(metrics["tables"].items()):
        lines.append(
            f"{name:<14}{s['hit_rate']:>10.3f}{s['tier_bytes_read'] / 2**20:>10.1f}"
            f"{s['tier_bytes_written'] / 2**20:>12.1f}"
        )
    lines.append(f"outputs in {run_dir}: plan.txt, metrics.json, checkpoints/, tiers/")
    return "\n".join(lines)


@record
@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def run(cfg: DictConfig) -> None:
    logging.basicConfig(level=logging.WARNING)
    try:
        main(cfg)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    run()
