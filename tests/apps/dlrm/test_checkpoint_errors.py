"""Errors met while training, saving or resuming name the file, table or option at fault in one
paragraph; a damaged checkpoint gives way to the previous finished one; checkpoints are
private files."""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import shutil
import stat
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest
from dlrm_helpers import app_config, same_tier_rows
from omegaconf import DictConfig
from test_run_dirs import tsv, write_tsv

from apps.dlrm import checkpoints
from apps.dlrm.errors import CheckpointError, ConfigError, one_paragraph
from apps.dlrm.train import main
from torchrec_mtrains.checkpoint.storage import PrivateFileSystem

SMALL = ["data.batch_size=64", "run.eval_batches=4"]


def config(run_dir: Path, *overrides: str) -> DictConfig:
    return app_config(run_dir, *SMALL, *overrides)


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def largest_data_file(path: Path) -> Path:
    return max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)


def tier_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("tiers/*/rank*/*.rows"))


def test_disk_full_while_saving_names_the_checkpoint_and_the_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    create_stream = PrivateFileSystem.create_stream

    @contextlib.contextmanager
    def full_disk(self: Any, path: Any, mode: str) -> Generator[io.IOBase, None, None]:
        with create_stream(self, path, mode) as stream:
            if "step_00000008" not in str(path) or "r" in mode:
                yield stream
                return
            real_write = stream.write

            def write(data: Any) -> int:
                if stream.tell() + len(memoryview(data)) > 600:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                return real_write(data)

            monkeypatch.setattr(stream, "write", write)
            yield stream

    monkeypatch.setattr(PrivateFileSystem, "create_stream", full_disk)
    with pytest.raises(CheckpointError) as info:
        main(config(run_dir, "run.steps=10", "run.checkpoint_every=4"))
    message = one_paragraph(info.value)
    assert message.startswith(f"checkpoint {step_dir(run_dir, 8)} could not be written: ")
    assert "the disk holding it ran out of space" in message and "run.dir=" in message
    assert f"{step_dir(run_dir, 4)} (step 4)" in message and "run.resume=true" in message
    assert "unexpected pos" not in message and "\n" not in message
    assert not step_dir(run_dir, 8).exists()  # the unfinished checkpoint is gone

    monkeypatch.setattr(PrivateFileSystem, "create_stream", create_stream)
    resumed = main(config(run_dir, "run.steps=10", "run.checkpoint_every=4", "run.resume=true"))
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 10


def test_a_truncated_latest_checkpoint_falls_back_to_the_previous_one(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The fallback resumes exactly as a run that never had the damaged checkpoint."""
    damaged, reference = tmp_path / "damaged", tmp_path / "reference"
    main(config(damaged, "run.steps=10", "run.checkpoint_every=5"))
    shutil.copytree(damaged, reference)
    shutil.rmtree(step_dir(reference, 10))
    victim = largest_data_file(step_dir(damaged, 10))
    os.truncate(victim, victim.stat().st_size // 2)

    with caplog.at_level(logging.WARNING, logger="apps.dlrm"):
        resumed = main(config(damaged, "run.steps=12", "run.resume=true"))
    expected = main(config(reference, "run.steps=12", "run.resume=true"))

    assert f"checkpoint {step_dir(damaged, 10)} is damaged ({victim} is truncated" in caplog.text
    assert "falling back to the previous finished checkpoint" in caplog.text
    assert resumed["resumed_from_step"] == expected["resumed_from_step"] == 5
    assert (damaged / "checkpoints" / "damaged_step_00000010").is_dir()  # kept, set aside
    assert resumed["train_loss_last"] == expected["train_loss_last"]
    for left in tier_files(damaged):
        assert same_tier_rows(left, reference / left.relative_to(damaged)), left


def test_a_checkpoint_that_fails_to_load_falls_back_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Found only by loading it (after the model is built and part of it loaded): the older
    checkpoint then loads over every row, as if the damaged one had never been."""
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    main(config(run_dir, "run.steps=10", "run.checkpoint_every=5"))
    shutil.copytree(run_dir, reference)
    shutil.rmtree(step_dir(reference, 10))
    victim = largest_data_file(step_dir(run_dir, 10))
    with victim.open("r+b") as f:  # same size, unreadable: only loading finds out
        f.write(b"\0" * 4096)

    with caplog.at_level(logging.WARNING, logger="apps.dlrm"):
        resumed = main(config(run_dir, "run.steps=12", "run.resume=true"))
    expected = main(config(reference, "run.steps=12", "run.resume=true"))
    assert f"checkpoint {step_dir(run_dir, 10)} is damaged" in caplog.text
    assert resumed["resumed_from_step"] == 5 and resumed["steps"] == 12
    assert resumed["train_loss_last"] == expected["train_loss_last"]
    for left in tier_files(run_dir):
        assert same_tier_rows(left, reference / left.relative_to(run_dir)), left


def test_every_checkpoint_damaged_says_what_to_do(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=4"))
    (step_dir(run_dir, 4) / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(CheckpointError) as info:
        main(config(run_dir, "run.steps=6", "run.resume=true"))
    assert "every finished checkpoint" in str(info.value) and "drop run.resume" in str(info.value)
    # Without run.resume the directory starts over in place.
    assert main(config(run_dir, "run.steps=2"))["resumed_from_step"] is None


def test_an_unfinished_checkpoint_is_removed_on_resume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=10", "run.checkpoint_every=5"))
    (step_dir(run_dir, 10) / "DONE").unlink()
    with caplog.at_level(logging.WARNING, logger="apps.dlrm"):
        resumed = main(config(run_dir, "run.steps=12", "run.resume=true"))
    assert f"removed the unfinished checkpoint {step_dir(run_dir, 10)}" in caplog.text
    assert resumed["resumed_from_step"] == 5
    assert not step_dir(run_dir, 10).exists()


def test_an_id_outside_its_table_mid_run_names_the_table_and_option(tmp_path: Path) -> None:
    # The first batch's ids fit; from line 40 on, cat_0 is 0x2000 = 8192 > t_cat_0's 4000 rows.
    data = write_tsv(tmp_path / "day_0.tsv", 160, big_cat_0=range(40, 161))
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        main(tsv(run_dir, data, "data.num_embeddings_per_feature=[100000]"))
    message = one_paragraph(info.value)
    assert "table 't_cat_0': row id 8192" in message
    assert "model.num_embeddings_per_feature" in message and "starts over in place" in message


def test_checkpoints_are_private_whatever_the_umask(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    old = os.umask(0)
    try:
        main(config(run_dir, "run.steps=4", "run.checkpoint_every=2"))
    finally:
        os.umask(old)
    root = run_dir / "checkpoints"
    dirs = [root, *(p for p in root.rglob("*") if p.is_dir())]
    files = [p for p in root.rglob("*") if p.is_file()]
    assert len(dirs) == 3 and any(p.suffix == ".distcp" for p in files)
    assert {p.name for p in files} >= {".metadata", "DONE"}
    for path in dirs:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in [*files, *tier_files(run_dir)]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path


@pytest.mark.parametrize(
    ("keep", "full_every", "left"),
    [
        ("2", 1, [6, 8]),
        ("null", 1, [2, 4, 6, 8]),
        # 2 full, 4 and 6 incremental on it, 8 (the last) full: 6 needs 2 and 4.
        ("2", 4, [2, 4, 6, 8]),
        ("1", 4, [8]),
    ],
)
def test_keep_checkpoints_deletes_the_oldest_finished_ones(
    tmp_path: Path, keep: str, full_every: int, left: list[int]
) -> None:
    """Beyond the newest ``keep``, finished checkpoints go, except those a kept one builds on."""
    run_dir = tmp_path / "run"
    overrides = ("data.batch_size=32", "run.eval_batches=0", "run.checkpoint_every=2")
    main(
        app_config(
            run_dir,
            *overrides,
            "run.steps=8",
            f"run.keep_checkpoints={keep}",
            f"run.full_checkpoint_every={full_every}",
        )
    )
    assert sorted(step for step, _ in checkpoints.finished_checkpoints(run_dir)) == left
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        f"step_{step:08d}" for step in left
    ]


def test_keep_checkpoints_must_be_a_positive_count(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"run\.keep_checkpoints=0"):
        main(app_config(tmp_path / "run", "run.steps=2", "run.keep_checkpoints=0"))
