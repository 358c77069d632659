"""The app on finite data: epochs over the training split, evaluation on held-out rows only
(torchrec.metrics), warnings instead of silent nulls, resuming mid-epoch, the per-step history
and TensorBoard events, and ranks that stay in step on uneven data."""

from __future__ import annotations

import json
import logging
import math
import random
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.multiprocessing as mp
from dlrm_helpers import TINY_TABLES, app_config
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from apps.dlrm.checkpoints import Position, checkpoint_position
from apps.dlrm.train import ConfigError, main

REPO = Path(__file__).resolve().parents[3]
CONF = REPO / "conf"
TINY = [*TINY_TABLES]


def config(run_dir: Path, *overrides: str) -> DictConfig:
    return app_config(run_dir, *TINY[len(TINY_TABLES) :], *overrides)


def write_tsv(path: Path, rows: int, seed: int = 0) -> Path:
    """Criteo-shaped rows; the label follows int_0, so a model can learn something."""
    rng = random.Random(seed)
    lines = []
    for _ in range(rows):
        dense = [rng.randint(0, 50) for _ in range(13)]
        label = int(rng.random() < (0.6 if dense[0] > 25 else 0.15))
        cats = [f"{rng.getrandbits(32):08x}" for _ in range(26)]
        lines.append("\t".join([str(label), *map(str, dense), *cats]) + "\n")
    path.write_text("".join(lines))
    return path


@pytest.fixture
def day(tmp_path: Path) -> Path:
    return write_tsv(tmp_path / "day_0.tsv", 200)


def tsv(day: Path, *overrides: str) -> list[str]:
    return ["data=criteo_tsv", f"data.paths=[{day}]", "data.batch_size=32", *overrides]


def test_criteo_tsv_trains_epochs_and_evaluates_the_held_out_rows(
    tmp_path: Path, day: Path
) -> None:
    # 200 rows, one in ten held out: 180 training rows make 6 batches of 32 (the last of 20).
    metrics = main(config(tmp_path / "run", *tsv(day, "run.steps=null", "run.epochs=3")))
    assert metrics["steps"] == 18
    assert metrics["epochs_completed"] == 3 and metrics["batches_per_epoch"] == 6
    assert metrics["eval_samples"] == 20 and metrics["eval_batches"] == 1
    for key in ("eval_auc", "eval_ne", "eval_calibration"):
        assert isinstance(metrics[key], float) and math.isfinite(metrics[key]), key
    assert 0.0 <= metrics["eval_auc"] <= 1.0
    assert metrics["warnings"] == []
    assert (
        json.loads((tmp_path / "run" / "metrics.json").read_text())["eval_calibration"]
        == (metrics["eval_calibration"])
    )


def test_run_steps_caps_the_epochs_and_an_unreached_cap_warns(
    tmp_path: Path, day: Path, caplog: pytest.LogCaptureFixture
) -> None:
    capped = main(config(tmp_path / "capped", *tsv(day, "run.steps=8", "run.epochs=3")))
    assert capped["steps"] == 8 and capped["epochs_completed"] == 1
    assert capped["warnings"] == []
    GlobalHydra.instance().clear()
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.train"):
        short = main(config(tmp_path / "short", *tsv(day, "run.steps=50", "run.epochs=1")))
    assert short["steps"] == 6
    (warning,) = short["warnings"]
    assert "run.steps=50 not reached" in warning and "run.epochs=1" in warning
    assert warning in caplog.text


def test_synthetic_epochs_are_data_num_batches_each(tmp_path: Path) -> None:
    metrics = main(
        config(
            tmp_path / "run",
            "data.batch_size=64",
            "data.num_batches=4",
            "run.steps=null",
            "run.epochs=2",
            "run.eval_batches=2",
        )
    )
    assert metrics["steps"] == 8 and metrics["epochs_completed"] == 2
    assert metrics["eval_samples"] == 128 and metrics["warnings"] == []


def test_eval_paths_are_evaluated_whole(tmp_path: Path, day: Path) -> None:
    held = write_tsv(tmp_path / "day_1.tsv", 40, seed=1)
    metrics = main(
        config(
            tmp_path / "run",
            *tsv(day, f"data.eval_paths=[{held}]", "run.steps=null", "run.eval_batches=null"),
        )
    )
    assert metrics["steps"] == 7  # every row of day_0 trains: 200 rows in batches of 32
    assert metrics["eval_samples"] == 40 and metrics["eval_batches"] == 2
    assert isinstance(metrics["eval_auc"], float)


def test_evaluation_without_held_out_rows_warns_naming_the_options(
    tmp_path: Path,
    day: Path,
    caplog: pytest.LogCaptureFixture,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.train"):
        metrics = main(config(tmp_path / "run", *tsv(day, "data.eval_fraction=0", "run.steps=3")))
    assert metrics["eval_auc"] is None and metrics["eval_samples"] == 0
    (warning,) = metrics["warnings"]
    assert "no held-out batch" in warning
    assert "data.eval_paths=[]" in warning and "data.eval_fraction=0.0" in warning
    assert warning in caplog.text
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["warnings"] == [warning]
    assert f"warning: {warning}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.steps=null", "run.epochs=null"], r"run\.steps=null and run\.epochs=null"),
        (["run.epochs=0"], r"run\.epochs=0"),
    ],
)
def test_a_schedule_without_an_end_is_refused(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        main(config(tmp_path / "run", *overrides))


def test_resume_in_a_later_epoch_matches_an_uninterrupted_run(tmp_path: Path, day: Path) -> None:
    """Two epochs of 6 batches; the run stops after its step-8 checkpoint (epoch 1, batch 2)
    and resumes there: the same model as never stopping, so the same data in the same order."""
    two_epochs = ["run.steps=null", "run.epochs=2", "pipeline.lookahead=0"]
    straight = main(config(tmp_path / "straight", *tsv(day, *two_epochs)))
    main(config(tmp_path / "resumed", *tsv(day, *two_epochs, "run.checkpoint_every=8")))
    (tmp_path / "resumed" / "checkpoints" / "step_00000012" / "DONE").unlink()
    GlobalHydra.instance().clear()
    resumed = main(config(tmp_path / "resumed", *tsv(day, *two_epochs, "run.resume=true")))

    assert resumed["resumed_from_step"] == 8
    assert resumed["steps"] == straight["steps"] == 12
    assert resumed["epochs_completed"] == 2
    assert resumed["train_loss_last"] == pytest.approx(straight["train_loss_last"], abs=1e-5)
    assert resumed["eval_auc"] == pytest.approx(straight["eval_auc"], abs=1e-5)
    assert resumed["eval_ne"] == pytest.approx(straight["eval_ne"], abs=1e-5)
    done = tmp_path / "resumed" / "checkpoints" / "step_00000008" / "DONE"
    assert json.loads(done.read_text()) == {"step": 8, "epoch": 1, "batch": 2}


def test_a_checkpoint_done_file_says_where_training_stands(tmp_path: Path) -> None:
    (tmp_path / "DONE").write_text("12")  # written before epochs: 12 batches into epoch 0
    assert checkpoint_position(tmp_path) == Position(0, 12)
    (tmp_path / "DONE").write_text('{"step": 30, "epoch": 2, "batch": 5}')
    assert checkpoint_position(tmp_path) == Position(2, 5)
    (tmp_path / "DONE").write_text("{}")
    with pytest.raises(ConfigError, match="DONE does not say where"):
        checkpoint_position(tmp_path)


def _history(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines()]


def test_history_and_tensorboard_follow_the_run_and_its_resume(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    main(config(run_dir, "data.batch_size=64", "run.steps=10", "run.log_every=4"))
    lines = _history(run_dir)
    assert [line["step"] for line in lines] == [4, 8, 10]  # the last steps too
    first = lines[0]
    for key in ("loss", "samples_per_s", "ne", "auc", "calibration", "stall_share"):
        assert isinstance(first[key], float), key
    assert set(first["tiers"]) == {"byte_scm", "block_scm"}
    assert first["bytes_read"] == sum(t["bytes_read"] for t in first["tiers"].values()) > 0
    assert 0.0 <= first["hit_rate"] <= 1.0

    GlobalHydra.instance().clear()
    main(
        config(run_dir, "data.batch_size=64", "run.steps=14", "run.log_every=4", "run.resume=true")
    )
    assert [line["step"] for line in _history(run_dir)] == [4, 8, 10, 12, 14]

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        "train/loss",
        "train/samples_per_s",
        "train/ne",
        "train/auc",
        "train/calibration",
        "tiers/hit_rate",
        "tiers/stall_share",
        "tiers/mb_read",
        "tiers/mb_written",
        "tiers/byte_scm/hit_rate",
        "tiers/block_scm/mb_read",
        "eval/auc",
        "eval/ne",
        "eval/calibration",
    }
    assert expected <= tags, expected - tags
    # One event file per run; TensorBoard orders points by step, whichever file it reads first.
    assert sorted(e.step for e in events.Scalars("train/loss")) == [4, 8, 10, 12, 14]
    assert sorted(e.step for e in events.Scalars("eval/auc")) == [10, 14]


def test_tensorboard_can_be_switched_off(tmp_path: Path) -> None:
    main(config(tmp_path / "run", "run.steps=2", "run.tensorboard=false", "data.batch_size=64"))
    assert not (tmp_path / "run" / "tensorboard").exists()
    assert (tmp_path / "run" / "history.jsonl").exists()


def _rank(rank: int, world: int, port: int, overrides: list[str], out: Path) -> None:
    from torch.distributed import destroy_process_group

    from torchrec_mtrains.distributed.runtime import init_process_group, resolve_device

    # A rank that missed a collective would make the others wait: fail fast instead.
    init_process_group(
        resolve_device("cpu"), timedelta(seconds=120), rank=rank, world_size=world, port=port
    )
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name="config", overrides=[*TINY, *overrides])
        metrics = main(cfg)
        (out / f"rank{rank}.json").write_text(json.dumps(metrics))
    finally:
        destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("lookahead", [0, 2])
def test_two_ranks_with_uneven_data_stay_in_step(tmp_path: Path, lookahead: int) -> None:
    """41 training lines over 2 ranks (batches of 10): rank 0 has 21 (3 batches), rank 1 has 20
    (2). Every rank must run the same steps: both stop after 2 per epoch."""
    from torchrec_mtrains.distributed.runtime import free_port

    day = write_tsv(tmp_path / "day_0.tsv", 41)
    held = write_tsv(tmp_path / "day_1.tsv", 25, seed=1)  # 13 and 12 rows: 2 and 2 batches
    run_dir = tmp_path / "run"
    overrides = [
        f"run.dir={run_dir}",
        "data=criteo_tsv",
        f"data.paths=[{day}]",
        f"data.eval_paths=[{held}]",
        "data.batch_size=10",
        "run.steps=null",
        "run.epochs=2",
        "run.eval_batches=null",
        "run.log_every=3",
        "run.num_threads=1",
        f"pipeline.lookahead={lookahead}",
    ]
    mp.spawn(_rank, args=(2, free_port(), overrides, tmp_path), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for metrics in ranks:
        assert metrics["steps"] == 4 and metrics["epochs_completed"] == 2
        assert metrics["batches_per_epoch"] == 2
        assert metrics["eval_samples"] == 25 and metrics["eval_batches"] == 2
    assert ranks[0]["eval_auc"] == ranks[1]["eval_auc"] is not None
    assert [line["step"] for line in _history(run_dir)] == [3, 4]  # rank 0 alone writes it
