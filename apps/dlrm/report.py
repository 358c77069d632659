"""What a run reports: evaluation and training-window quality through ``torchrec.metrics`` (NE,
AUC, calibration), tier I/O totals, per-table counters, the per-step history and TensorBoard
events (:class:`RunLog`) and the end-of-run summary."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.metrics.metric_module import RecMetricModule, generate_metric_module
from torchrec.metrics.metrics_config import (
    MetricsConfig,
    RecMetricDef,
    RecMetricEnum,
    RecTaskInfo,
)

from apps.dlrm.errors import ConfigError
from torchrec_mtrains.distributed import HostBoundsCheck
from torchrec_mtrains.pipeline import TierSnapshot, snapshot, tier_stats, tiered_groups
from torchrec_mtrains.types import Tier

HISTORY_FILE = "history.jsonl"
TENSORBOARD_DIR = "tensorboard"
# The app's one task, as torchrec.metrics names a model output's fields.
CLICK = RecTaskInfo(
    name="click", label_name="label", prediction_name="prediction", weight_name="weight"
)
# metric -> the RecMetricModule result it is read from: every row since the module's start or
# reset (AUC has no lifetime value, but its window is longer than any run's rows).
RESULT_KEYS = {"auc": "window_auc", "ne": "lifetime_ne", "calibration": "lifetime_calibration"}
UNBOUNDED_SAMPLES = 2**62
FUSED_UPDATES = 16


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


def rec_metrics(batch_size: int, device: torch.device) -> RecMetricModule:
    """TorchRec's metric module for the click task: NE, AUC and calibration of the rows of all
    ranks since its start (or :meth:`~RecMetricModule.reset`), computed on every rank so that
    every rank returns the same numbers. A collective group is needed, even of one rank."""
    config = MetricsConfig(
        rec_tasks=[CLICK],
        rec_metrics={
            metric: RecMetricDef(rec_task_indices=[0], window_size=UNBOUNDED_SAMPLES)
            for metric in (RecMetricEnum.NE, RecMetricEnum.AUC, RecMetricEnum.CALIBRATION)
        },
        compute_on_all_ranks=True,
        # Buffer this many batches and update once: per-batch updates cost more than a step's
        # worth of small ops; compute() takes the buffered ones first.
        fused_update_limit=FUSED_UPDATES,
    )
    return generate_metric_module(
        RecMetricModule,
        metrics_config=config,
        batch_size=batch_size,
        world_size=dist.get_world_size(),
        my_rank=dist.get_rank(),
        state_metrics_mapping={},
        device=device,
    )


def update_metrics(module: RecMetricModule, logits: torch.Tensor, labels: torch.Tensor) -> None:
    predictions = torch.sigmoid(logits.detach().flatten().float())
    module.update(
        {
            CLICK.prediction_name: predictions,
            CLICK.label_name: labels.detach().flatten().float(),
            CLICK.weight_name: torch.ones_like(predictions),
        }
    )


def metric_values(module: RecMetricModule, samples: int, positives: int) -> dict[str, float | None]:
    """AUC, NE and calibration of ``module.compute()`` (a collective), None where undefined:
    AUC and NE need both labels among the ``samples``, calibration a click. torchrec.metrics
    returns numbers there too (AUC 0.5, calibration 0, NE of a clamped entropy), which would
    read as results."""
    results = {str(k).rsplit("|", 1)[-1]: v for k, v in dict(module.compute()).items()}
    out: dict[str, float | None] = {}
    for name, key in RESULT_KEYS.items():
        value = results.get(key)
        number = float(value) if value is not None else math.nan
        out[name] = number if math.isfinite(number) else None
    if not 0 < positives < samples:
        out["auc"] = out["ne"] = None
    if positives == 0:
        out["calibration"] = None
    return out


@dataclass(frozen=True)
class EvalResult:
    """Quality on the held-out rows of all ranks.

    Attributes:
        auc / ne / calibration: None when undefined (no rows, or labels of one class only).
        samples: held-out rows evaluated, over all ranks.
        positives: of those, the clicks.
        batches: batches evaluated per rank.
        seconds: wall time of the evaluation.
    """

    auc: float | None
    ne: float | None
    calibration: float | None
    samples: int
    positives: int
    batches: int
    seconds: float


@torch.no_grad()
def evaluate(
    model: DistributedModelParallel,
    batches: Iterator[Batch],
    device: torch.device,
    batch_size: int,
) -> EvalResult:
    """NE, AUC and calibration of ``model`` on ``batches`` (every rank must be given the same
    number of batches: each forward is a collective)."""
    start = time.perf_counter()
    module = rec_metrics(batch_size, device)
    # [samples, clicks], on the device so that a GPU run never waits for a count.
    counts = torch.zeros(2, dtype=torch.float64, device=device)
    count = 0
    host_check = HostBoundsCheck(model)  # ids checked before the copy: no device sync
    model.eval()
    try:
        for batch in batches:
            _, (_, logits, labels) = model(host_check.to_device(batch, device))
            update_metrics(module, logits, labels)
            counts[0] += labels.numel()
            counts[1] += labels.sum()
            count += 1
    finally:
        model.train()
    if dist.get_world_size() > 1:
        dist.all_reduce(counts)
    samples, positives = int(counts[0]), int(counts[1])
    values: dict[str, float | None] = dict.fromkeys(RESULT_KEYS)
    if samples:
        values = metric_values(module, samples, positives)
    return EvalResult(
        auc=values["auc"],
        ne=values["ne"],
        calibration=values["calibration"],
        samples=samples,
        positives=positives,
        batches=count,
        seconds=time.perf_counter() - start,
    )


# Per tier, in this order: cache hits, cache lookups, bytes read from and written to the tier.
_TIER_COUNTERS = 4


def _tier_counters(model: torch.nn.Module) -> list[float]:
    """This rank's cumulative counters of every tiered table, summed per tier (:class:`Tier`
    order), so that all ranks reduce vectors of the same length."""
    index = {tier.value: i for i, tier in enumerate(Tier)}
    out = [0.0] * (_TIER_COUNTERS * len(index))
    for group in tiered_groups(model):
        for shard in group.shards:
            at = _TIER_COUNTERS * index[shard.store.serves_tier]
            out[at] += shard.cache.stats.hits
            out[at + 1] += shard.cache.stats.lookups
            out[at + 2] += shard.store.stats.bytes_read
            out[at + 3] += shard.store.stats.bytes_written
    return out


class TrainWindow:
    """The training steps since the last report, combined over ranks when reported: loss,
    samples/s, NE / AUC / calibration (``torchrec.metrics``), cache hit rate (overall and per
    tier), stall share and bytes moved to and from the tiers. A report is collective: every
    rank calls :meth:`report` after the same steps.

    Args:
        model: the sharded model (its tiered tables are read for the counters).
        batch_size: samples per batch and rank.
        device: the process group's device (NCCL reduces CUDA tensors only).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        batch_size: int,
        device: torch.device,
    ) -> None:
        self._model = model
        self._groups = tiered_groups(model)
        self._device = device
        self._world = dist.get_world_size()
        self._metrics = rec_metrics(batch_size, device)
        self.steps = 0
        self._start()

    def _start(self) -> None:
        self.steps = 0
        self._loss_sum = torch.zeros((), dtype=torch.float64, device=self._device)
        self._samples = 0
        self._positives = torch.zeros((), dtype=torch.float64, device=self._device)
        self._started = time.perf_counter()
        self._stall = snapshot(self._groups).io.stall_seconds
        self._counters = _tier_counters(self._model)

    def add(self, loss: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Counts a step: its loss, logits and labels stay on the device until the report."""
        self.steps += 1
        self._loss_sum += loss.detach().to(torch.float64)
        self._samples += int(labels.numel())
        self._positives += labels.sum()
        update_metrics(self._metrics, logits, labels)

    def report(self) -> dict[str, Any]:
        """The window's numbers (the same on every rank), then a new window starts."""
        seconds = time.perf_counter() - self._started
        counters = _tier_counters(self._model)
        summed = torch.tensor(
            [0.0, self._samples, self.steps, 0.0]
            + [now - before for now, before in zip(counters, self._counters)],
            dtype=torch.float64,
            device=self._device,
        )
        summed[0] = self._loss_sum
        summed[3] = self._positives
        stall = snapshot(self._groups).io.stall_seconds - self._stall
        slowest = torch.tensor([stall, seconds], dtype=torch.float64, device=self._device)
        if self._world > 1:
            dist.all_reduce(summed)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        loss_sum, samples, steps, positives, *tiers = summed.tolist()
        stall, seconds = slowest.tolist()
        per_tier: dict[str, dict[str, float | None]] = {}
        for i, tier in enumerate(Tier):
            hits, lookups, read, written = tiers[_TIER_COUNTERS * i : _TIER_COUNTERS * (i + 1)]
            if lookups or read or written:
                per_tier[tier.value] = {
                    "hit_rate": hits / lookups if lookups else None,
                    "bytes_read": int(read),
                    "bytes_written": int(written),
                }
        hits = sum(tiers[0::_TIER_COUNTERS])
        lookups = sum(tiers[1::_TIER_COUNTERS])
        record: dict[str, Any] = {
            "loss": loss_sum / steps if steps else None,
            "samples_per_s": samples / seconds if seconds > 0 else 0.0,
            **metric_values(self._metrics, int(samples), int(positives)),
            # None when no rows were looked up: look-ahead planned the last batches earlier.
            "hit_rate": hits / lookups if lookups else None,
            "stall_share": stall / seconds if seconds > 0 else 0.0,
            "bytes_read": int(sum(tiers[2::_TIER_COUNTERS])),
            "bytes_written": int(sum(tiers[3::_TIER_COUNTERS])),
            "tiers": per_tier,
        }
        self._metrics.reset()
        self._start()
        return record


class RunLog:
    """Rank 0's record of a run as it goes: one JSON object per report appended to
    ``history.jsonl`` (kept across resumes, so a resumed run's lines follow the earlier ones;
    after a resume from an earlier checkpoint the later line of a step is the current one),
    and TensorBoard event files under ``tensorboard/`` (a resumed run's writer drops the
    points after its checkpoint's step, so the curves continue from there).

    Args:
        run_dir: the run directory.
        enabled: whether this process writes (rank 0 only).
        tensorboard: whether to write TensorBoard events (``run.tensorboard``).
        resumed_at: the step a resumed run starts from; None for a new run.

    Raises:
        ConfigError: ``run.tensorboard=true`` without the ``tensorboard`` package (at
            construction, so before the run builds anything; files appear at the first point).
    """

    def __init__(
        self, run_dir: Path, enabled: bool, tensorboard: bool, resumed_at: int | None
    ) -> None:
        self.history = run_dir / HISTORY_FILE
        self._enabled = enabled
        self._writer: Any = None
        self._open: Callable[[], Any] | None = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError(
                    f"run.tensorboard=true needs the tensorboard package ({e}): install "
                    "requirements/cpu.txt (or cuda.txt), or pass run.tensorboard=false"
                ) from None
            log_dir = str(run_dir / TENSORBOARD_DIR)
            # The checkpoint's own step stays; later points of the earlier run go.
            purge = None if resumed_at is None else resumed_at + 1
            self._open = lambda: SummaryWriter(log_dir=log_dir, purge_step=purge)

    def train(self, step: int, epoch: int, record: dict[str, Any]) -> None:
        """One training report: a history line and its TensorBoard points at ``step``."""
        if not self._enabled:
            return
        line = {"step": step, "epoch": epoch, "time": time.time(), **record}
        with self.history.open("a") as f:
            f.write(json.dumps(line) + "\n")
        scalars: dict[str, float | None] = {
            "train/loss": record["loss"],
            "train/samples_per_s": record["samples_per_s"],
            "train/ne": record["ne"],
            "train/auc": record["auc"],
            "train/calibration": record["calibration"],
            "tiers/hit_rate": record["hit_rate"],
            "tiers/stall_share": record["stall_share"],
            "tiers/mb_read": record["bytes_read"] / 2**20,
            "tiers/mb_written": record["bytes_written"] / 2**20,
        }
        for tier, counters in record["tiers"].items():
            scalars[f"tiers/{tier}/hit_rate"] = counters["hit_rate"]
            scalars[f"tiers/{tier}/mb_read"] = counters["bytes_read"] / 2**20
            scalars[f"tiers/{tier}/mb_written"] = counters["bytes_written"] / 2**20
        self._scalars(step, scalars)

    def eval(self, step: int, result: EvalResult) -> None:
        """The evaluation's TensorBoard points at the step the model was trained to."""
        if self._enabled:
            self._scalars(
                step,
                {
                    "eval/auc": result.auc,
                    "eval/ne": result.ne,
                    "eval/calibration": result.calibration,
                },
            )

    def _scalars(self, step: int, scalars: dict[str, float | None]) -> None:
        if self._open is None:
            return
        if self._writer is None:
            self._writer = self._open()
        for tag, value in scalars.items():
            if value is not None:
                self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def summary(metrics: dict[str, Any], run_dir: Path) -> str:
    """The end-of-run table: throughput, quality and per-tier traffic."""
    epochs = metrics.get("epochs_completed") or 0
    lines = [
        "",
        "=== summary ===",
        f"steps             {metrics['steps']}"
        + (f" ({epochs} full epoch{'s' if epochs > 1 else ''})" if epochs else ""),
        f"throughput        {metrics['samples_per_s']:,.0f} samples/s",
        f"eval AUC          {_fmt(metrics['eval_auc'])}",
        f"eval NE           {_fmt(metrics['eval_ne'])}",
        f"eval calibration  {_fmt(metrics.get('eval_calibration'))}"
        + (f" ({metrics['eval_samples']:,} held-out samples)" if "eval_samples" in metrics else ""),
        f"cache hit rate    {metrics['cache_hit_rate']:.3f}",
        f"tier stall        {metrics['stall_s']:.2f} s, {metrics['stall_share']:.1%} of "
        f"training (look-ahead {metrics['lookahead'] or 'off'}; prefetch I/O "
        f"{metrics['prefetch_io_s']:.2f} s, {metrics['rows_fetched']:,} rows fetched)",
        "time (s)          "
        + ", ".join(f"{k} {v:.1f}" for k, v in metrics.get("seconds", {}).items()),
    ]
    # Sharded tables are named like "t_cat_20@500000,0": the column is as wide as the longest.
    width = max([len("table"), *map(len, metrics["tables"])]) + 2
    lines.append(f"{'table':<{width}}{'hit rate':>10}{'MB read':>10}{'MB written':>12}")
    for name, s in sorted(metrics["tables"].items()):
        lines.append(
            f"{name:<{width}}{s['hit_rate']:>10.3f}{s['tier_bytes_read'] / 2**20:>10.1f}"
            f"{s['tier_bytes_written'] / 2**20:>12.1f}"
        )
    virtual = {n: s for n, s in sorted(metrics["tables"].items()) if "live_rows" in s}
    if virtual:
        lines.append(
            f"{'virtual table':<{width}}{'live rows':>12}{'of':>12}{'made':>12}{'evicted':>12}"
            f"{'rounds':>8}"
        )
        for name, s in virtual.items():
            lines.append(
                f"{name:<{width}}{s['live_rows']:>12,.0f}{s['max_live_rows']:>12,.0f}"
                f"{s['rows_made']:>12,.0f}{s['rows_evicted']:>12,.0f}{s['eviction_rounds']:>8,.0f}"
            )
    lines.extend(f"warning: {w}" for w in metrics.get("warnings", []))
    outputs = ["plan.txt", "config.yaml", "metrics.json", HISTORY_FILE, TENSORBOARD_DIR]
    shown = [n + ("/" if (run_dir / n).is_dir() else "") for n in outputs if (run_dir / n).exists()]
    lines.append(f"outputs in {run_dir.resolve()}: {', '.join(shown)}, checkpoints/, tiers/")
    return "\n".join(lines)
