"""What a run reports: evaluation (AUC, NE), tier I/O totals, per-table counters and the
end-of-run summary."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel

from torchrec_mtrains.pipeline import TierSnapshot, tier_stats


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


def hit_rate(stats: dict[str, dict[str, float]]) -> float:
    lookups = sum(s["lookups"] for s in stats.values())
    return sum(s["hits"] for s in stats.values()) / lookups if lookups else 0.0


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
