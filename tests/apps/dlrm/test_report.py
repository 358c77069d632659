"""What a run reports: evaluation through torchrec.metrics against independent references, the
training window, the history file and the end-of-run summary's table."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torchmetrics.classification import BinaryAUROC
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.report import HISTORY_FILE, RunLog, TrainWindow, evaluate, summary


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """torchrec.metrics and the evaluation read the (one-rank) default group."""


class _Scores(torch.nn.Module):
    """Stands in for DLRMTrain: the logit is the first dense feature."""

    def forward(self, batch: Batch) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        logits = batch.dense_features[:, 0]
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, batch.labels)
        return loss, (loss.detach(), logits.detach(), batch.labels.detach())


def _batches(logits: torch.Tensor, labels: torch.Tensor, size: int) -> list[Batch]:
    out = []
    for lo in range(0, len(labels), size):
        n = len(labels[lo : lo + size])
        out.append(
            Batch(
                dense_features=logits[lo : lo + size].reshape(n, 1),
                sparse_features=KeyedJaggedTensor.from_lengths_sync(
                    keys=["cat_0"],
                    values=torch.zeros(n, dtype=torch.long),
                    lengths=torch.ones(n, dtype=torch.int32),
                ),
                labels=labels[lo : lo + size],
            )
        )
    return out


def test_evaluation_matches_independent_references() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(300, generator=generator)
    labels = (torch.rand(300, generator=generator) < torch.sigmoid(2 * logits)).float()
    model = _Scores()
    result = evaluate(model, iter(_batches(logits, labels, 64)), torch.device("cpu"), 64)

    p = torch.sigmoid(logits).double()
    ctr = float(labels.mean())
    bce = float(torch.nn.functional.binary_cross_entropy(p, labels.double()))
    entropy = -(ctr * math.log(ctr) + (1 - ctr) * math.log(1 - ctr))
    assert result.samples == 300 and result.batches == 5
    assert result.positives == int(labels.sum())
    assert result.auc == pytest.approx(float(BinaryAUROC()(p, labels.long())), abs=1e-5)
    assert result.ne == pytest.approx(bce / entropy, rel=1e-4)
    assert result.calibration == pytest.approx(float(p.sum() / labels.sum()), rel=1e-4)
    assert model.training  # evaluation puts the model back in training mode


def test_evaluation_of_one_class_or_no_rows_is_undefined_not_a_number() -> None:
    logits = torch.linspace(-2, 2, 50)
    result = evaluate(
        _Scores(), iter(_batches(logits, torch.zeros(50), 16)), torch.device("cpu"), 16
    )
    assert result.samples == 50 and result.positives == 0
    assert result.ne is None and result.calibration is None
    empty = evaluate(_Scores(), iter([]), torch.device("cpu"), 16)
    assert (empty.samples, empty.auc, empty.ne, empty.calibration) == (0, None, None, None)


def test_a_training_window_reports_its_own_steps_only() -> None:
    generator = torch.Generator().manual_seed(1)
    window = TrainWindow(torch.nn.Linear(1, 1), batch_size=32, device=torch.device("cpu"))
    reports = []
    for _ in range(2):
        logits = torch.randn(3, 32, generator=generator)
        labels = (torch.rand(3, 32, generator=generator) < torch.sigmoid(logits)).float()
        for step in range(3):
            window.add(torch.tensor(float(step)), logits[step], labels[step])
        reports.append((window.report(), logits.flatten(), labels.flatten()))
    for record, logits, labels in reports:
        p = torch.sigmoid(logits).double()
        assert record["loss"] == pytest.approx(1.0)  # mean of 0, 1, 2
        assert record["auc"] == pytest.approx(float(BinaryAUROC()(p, labels.long())), abs=1e-5)
        assert record["calibration"] == pytest.approx(float(p.sum() / labels.sum()), rel=1e-4)
        assert record["samples_per_s"] > 0
        assert record["hit_rate"] is None and record["tiers"] == {}  # no tiered tables
    assert window.steps == 0


def _record(loss: float) -> dict[str, Any]:
    return {
        "loss": loss,
        "samples_per_s": 100.0,
        "auc": 0.7,
        "ne": 0.9,
        "calibration": 1.0,
        "hit_rate": None,  # no lookups in the window: not plotted
        "stall_share": 0.1,
        "bytes_read": 2**20,
        "bytes_written": 0,
        "tiers": {"block_scm": {"hit_rate": 0.5, "bytes_read": 2**20, "bytes_written": 0}},
    }


def test_history_is_appended_across_runs(tmp_path: Path) -> None:
    first = RunLog(tmp_path, enabled=True, tensorboard=False, resumed_at=None)
    first.train(2, 0, _record(0.5))
    first.train(4, 0, _record(0.4))
    first.close()
    resumed = RunLog(tmp_path, enabled=True, tensorboard=False, resumed_at=4)
    resumed.train(6, 1, _record(0.3))
    resumed.close()
    lines = [json.loads(line) for line in (tmp_path / HISTORY_FILE).read_text().splitlines()]
    assert [(r["step"], r["epoch"], r["loss"]) for r in lines] == [
        (2, 0, 0.5),
        (4, 0, 0.4),
        (6, 1, 0.3),
    ]
    assert lines[0]["tiers"]["block_scm"]["bytes_read"] == 2**20
    assert not (tmp_path / "tensorboard").exists()
    off = RunLog(tmp_path / "other", enabled=False, tensorboard=True, resumed_at=None)
    off.train(2, 0, _record(0.5))  # not rank 0: writes nothing
    assert not (tmp_path / "other").exists()


def test_tensorboard_drops_points_after_the_resumed_step(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = RunLog(tmp_path, enabled=True, tensorboard=True, resumed_at=None)
    for step in (2, 4, 6):
        first.train(step, 0, _record(float(step)))
    first.close()
    # The run crashed after step 6 but its last checkpoint was at step 4.
    resumed = RunLog(tmp_path, enabled=True, tensorboard=True, resumed_at=4)
    resumed.train(6, 0, _record(60.0))
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (2, 2.0),
        (4, 4.0),
        (6, 60.0),
    ]
    assert "tiers/hit_rate" not in events.Tags()["scalars"]  # None is not plotted
    assert "tiers/block_scm/mb_read" in events.Tags()["scalars"]


def _metrics(tables: dict[str, dict[str, float]]) -> dict[str, Any]:
    return {
        "steps": 10,
        "samples_per_s": 1000.0,
        "eval_auc": 0.75,
        "eval_ne": 0.9,
        "eval_calibration": 1.01,
        "eval_samples": 640,
        "cache_hit_rate": 0.5,
        "stall_s": 0.1,
        "stall_share": 0.01,
        "lookahead": 2,
        "prefetch_io_s": 0.2,
        "rows_fetched": 100,
        "seconds": {"train": 1.0},
        "tables": tables,
        "warnings": ["evaluation got no held-out batch"],
    }


def test_summary_columns_line_up_for_sharded_table_names(tmp_path: Path) -> None:
    row = {"hit_rate": 0.5, "tier_bytes_read": 2**20, "tier_bytes_written": 2**21}
    names = ["t_cat_0", "t_cat_20@500000,0", "t_cat_3"]
    text = summary(_metrics(dict.fromkeys(names, row)), tmp_path)
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("table"))
    rows = [line for line in lines if line.startswith("t_cat_")]
    assert len(rows) == 3
    assert {len(line) for line in rows} == {len(header)}  # right-aligned columns end together
    for line in rows:
        assert line.split()[1:] == ["0.500", "1.0", "2.0"]
        assert line.index("0.500") + len("0.500") == header.index("hit rate") + len("hit rate")
    assert "eval calibration  1.0100 (640 held-out samples)" in lines
    assert "warning: evaluation got no held-out batch" in lines
