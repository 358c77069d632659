"""Run directories stay resumable or restartable: what can be checked before the tier files
exist is, a run that stopped before its first finished checkpoint starts over in place, a
deleted tier file is rebuilt from the checkpoint, and a changed plan is reported as such."""

from __future__ import annotations

import json
import logging
import shutil
import sys
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from dlrm_helpers import TIERED_TABLES, app_config, same_tier_rows
from omegaconf import DictConfig

from apps.dlrm.config import to_app_config
from apps.dlrm.errors import ConfigError, RunDirError
from apps.dlrm.model import tier_root
from apps.dlrm.train import main, run

SMALL = ["data.batch_size=64", "run.eval_batches=4"]


def config(run_dir: Path, *overrides: str) -> DictConfig:
    return app_config(run_dir, *SMALL, *overrides)


def write_tsv(
    path: Path, rows: int, bad_line: int | None = None, big_cat_0: Iterable[int] = ()
) -> Path:
    """A Criteo TSV file: small categorical values (every table has >= 100 rows); cat_0 is
    ``0x2000`` on the lines ``big_cat_0``, and line ``bad_line`` has a bad label."""
    big = set(big_cat_0)
    lines = []
    for i in range(1, rows + 1):
        label = "x" if i == bad_line else str(i % 2)
        dense = [str(i % 7)] * 13
        cats = [f"{(i * 31 + t) % 97:x}" for t in range(26)]
        if i in big:
            cats[0] = "2000"
        lines.append("\t".join([label, *dense, *cats]) + "\n")
    path.write_text("".join(lines))
    return path


def tsv(run_dir: Path, path: Path, *overrides: str) -> DictConfig:
    return app_config(
        run_dir,
        "data=criteo_tsv",
        f"data.paths=[{path}]",
        "data.batch_size=16",
        "data.eval_fraction=0",
        "run.eval_batches=0",
        "run.steps=null",
        *overrides,
    )


def tier_files(run_dir: Path) -> list[Path]:
    return sorted(run_dir.glob("tiers/*/rank*/*.rows"))


def test_a_run_that_failed_before_its_first_checkpoint_starts_over_in_place(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = write_tsv(tmp_path / "day_0.tsv", 160, bad_line=100)
    for resume in ("false", "true"):  # with or without run.resume: nothing to resume
        run_dir = tmp_path / f"run-{resume}"
        with pytest.raises(ConfigError) as info:
            main(tsv(run_dir, data, "data.on_error=fail"))
        message = str(info.value)
        assert f"{data}:100" in message and "data.on_error=skip" in message
        assert "starts over in place" in message
        assert len(tier_files(run_dir)) == TIERED_TABLES  # the failure came after they existed

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="apps.dlrm"):
            metrics = main(tsv(run_dir, data, "data.on_error=skip", f"run.resume={resume}"))
        assert "starting over in place from step 0" in caplog.text
        assert metrics["steps"] == 10 and metrics["resumed_from_step"] is None
        assert metrics["tier_files"] == {"created": TIERED_TABLES, "reopened": 0}


def test_a_malformed_first_batch_is_refused_before_any_tier_file(tmp_path: Path) -> None:
    data = write_tsv(tmp_path / "day_0.tsv", 160, bad_line=3)
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        main(tsv(run_dir, data, "data.on_error=fail"))
    message = str(info.value)
    assert message.startswith(f"malformed data row {data}:3: label 'x' is not 0 or 1")
    assert "data.on_error=skip" in message
    assert not tier_files(run_dir)


def test_tier_files_that_would_not_fit_the_disk_are_refused_before_any(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)
    tiny = type(usage)(usage.total, usage.used, 100_000)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: tiny)  # as the plan check reads it
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        main(config(run_dir, "run.steps=2"))
    message = str(info.value)
    assert "the tier files of rank 0 need" in message and "0.1 MiB are free" in message
    assert "hardware.tier_root" in message
    assert not tier_files(run_dir)


def test_ids_outside_a_table_are_refused_before_any_tier_file(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        main(config(run_dir, "data.num_embeddings_per_feature=[100000]", "run.steps=2"))
    message = str(info.value)
    assert "the first training batch holds row id" in message
    assert "model.num_embeddings_per_feature[" in message
    assert "data.num_embeddings_per_feature=[100000]" in message
    assert not tier_files(run_dir) and not run_dir.joinpath("tiers").exists()
    main(config(run_dir, "run.steps=2"))  # the same directory, fixed: no run.resume needed


def test_ids_outside_a_table_are_looked_up_as_row_0_under_bounds_check_warn(
    tmp_path: Path,
) -> None:
    cfg = config(
        tmp_path / "run",
        "data.num_embeddings_per_feature=[100000]",
        "run.bounds_check=warn",
        "run.steps=3",
    )
    assert main(cfg)["steps"] == int(cfg.run.steps)


def test_a_cache_smaller_than_the_first_batch_is_refused_before_any_tier_file(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as info:
        main(config(run_dir, "planner.cache_load_factor=0.01", "run.steps=2"))
    message = str(info.value)
    assert "cannot hold the first batch's" in message
    assert "planner.cache_load_factor (now 0.01)" in message and "data.batch_size" in message
    assert not tier_files(run_dir)
    assert main(config(run_dir, "run.steps=2"))["steps"] == 2


def test_a_finished_run_still_needs_resume(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=2"))
    with pytest.raises(RunDirError, match=r"finished checkpoint .*pass run\.resume=true"):
        main(config(run_dir, "run.steps=2"))


def test_a_run_that_finished_without_a_checkpoint_is_not_started_over(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=2", "run.final_checkpoint=false"))
    files = tier_files(run_dir)
    with pytest.raises(RunDirError, match=r"finished without a checkpoint.*new run\.dir"):
        main(config(run_dir, "run.steps=2"))
    assert tier_files(run_dir) == files


def test_resume_of_a_directory_that_never_ran_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match=r"no finished checkpoint.*drop run\.resume"):
        main(config(tmp_path / "run", "run.resume=true"))


def test_a_deleted_tier_file_is_rebuilt_from_the_checkpoint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Resuming without one tier file gives bitwise the same tiers (weights and optimizer
    state of every row) as resuming with it."""
    kept, lost = tmp_path / "kept", tmp_path / "lost"
    main(config(kept, "run.steps=8"))
    shutil.copytree(kept, lost)
    victim = tier_files(lost)[0]
    victim.unlink()

    a = main(config(kept, "run.steps=12", "run.resume=true"))
    with caplog.at_level(logging.WARNING, logger="apps.dlrm"):
        b = main(config(lost, "run.steps=12", "run.resume=true"))

    assert f"rebuilt 1 missing tier file(s) from checkpoint {lost}" in caplog.text
    assert str(victim) in caplog.text
    assert b["tier_files"] == {"created": 1, "reopened": TIERED_TABLES - 1}
    # The rebuilt file is written as often as the kept one (once, by the load): it is not
    # first filled with initial values.
    table = victim.name.split(".")[0]
    assert b["tables"][table]["tier_rows_written"] == a["tables"][table]["tier_rows_written"]
    assert a["resumed_from_step"] == b["resumed_from_step"] == 8
    assert a["train_loss_last"] == b["train_loss_last"]
    pairs = [(p, lost / p.relative_to(kept)) for p in tier_files(kept)]
    assert len(pairs) == TIERED_TABLES
    for left, right in pairs:
        assert same_tier_rows(left, right), right


def test_a_changed_plan_is_reported_as_such(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=2"))
    plan = (run_dir / "plan.txt").read_text()
    assert "t_cat_0" in plan and "block_scm" in plan
    # 4,000-row tables (272 KB) now fall under the block SCM threshold: byte SCM.
    with pytest.raises(RunDirError) as info:
        main(config(run_dir, "run.steps=4", "run.resume=true", "planner.block_scm_min_bytes=1MB"))
    message = str(info.value)
    assert message.startswith(
        "the plan changed since the checkpoint: table t_cat_0 was on block_scm, now byte_scm"
    )
    assert "no such row file" not in message and str(run_dir / "plan.json") in message
    # Nothing was touched: the original options still resume.
    assert main(config(run_dir, "run.steps=4", "run.resume=true"))["resumed_from_step"] == 2


def test_a_table_moved_by_a_change_of_device_is_loaded_not_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A run planned for CUDA kept t_cat_0 in HBM; resumed on the CPU the planner puts it on a
    tier: its tier file is created and filled from the checkpoint."""
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=2"))
    record = json.loads((run_dir / "plan.json").read_text())
    assert record["device"] == "cpu" and record["tables"]["t_cat_0"]["where"] == "block_scm"
    record["device"] = "cuda"
    record["tables"]["t_cat_0"]["where"] = "device memory"
    (run_dir / "plan.json").write_text(json.dumps(record))
    [made] = run_dir.glob("tiers/block_scm/rank0/t_cat_0.*.rows")
    made.unlink()
    with caplog.at_level(logging.WARNING, logger="apps.dlrm"):
        metrics = main(config(run_dir, "run.steps=4", "run.resume=true"))
    assert metrics["resumed_from_step"] == 2 and made.exists()
    assert "table t_cat_0 was on device memory, now block_scm (planned for cuda, now cpu)" in (
        caplog.text
    )


def test_a_cache_change_on_resume_is_not_a_plan_change(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    main(config(run_dir, "run.steps=2"))
    metrics = main(
        config(run_dir, "run.steps=4", "run.resume=true", "planner.cache_load_factor=0.5")
    )
    assert metrics["resumed_from_step"] == 2


def test_tier_files_another_run_dir_made_are_left_alone(tmp_path: Path) -> None:
    shared = tmp_path / "shared-tiers"
    data = write_tsv(tmp_path / "day_0.tsv", 160, bad_line=100)
    first = tmp_path / "first"
    with pytest.raises(ConfigError):
        main(tsv(first, data, "data.on_error=fail", f"hardware.tier_root={shared}"))
    made = sorted(shared.glob("*/rank0/*.rows"))
    assert len(made) == TIERED_TABLES
    with pytest.raises(RunDirError) as info:
        main(tsv(tmp_path / "second", data, f"hardware.tier_root={shared}"))
    assert "were not made by run.dir=" in str(info.value)
    assert sorted(shared.glob("*/rank0/*.rows")) == made
    # Its own run directory, which recorded them, starts over.
    assert main(tsv(first, data, f"hardware.tier_root={shared}"))["steps"] == 10


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record under capture
def test_cli_reports_a_bad_row_mid_run_as_one_paragraph(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_tsv(tmp_path / "day_0.tsv", 160, bad_line=100)
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")
    monkeypatch.setenv("MTRAINS_TRACEBACK", "0")
    args = [
        f"run.dir={tmp_path / 'run'}",
        "data=criteo_tsv",
        f"data.paths=[{data}]",
        "data.on_error=fail",
        "data.batch_size=16",
        "data.eval_fraction=0",
        "run.eval_batches=0",
        "run.steps=null",
        "run.tensorboard=false",
        "model.num_embeddings_per_feature=[4000,2000,100,100,100,100,100,100,100,100,100,100,"
        "100,100,100,100,100,100,100,100,100,100,4000,2000,4000,2000]",
        "planner=size_rule",
        "planner.dram_budget=200KB",
        "planner.block_scm_min_bytes=200KB",
        "planner.cache_load_factor=0.25",
        "run.progress=false",
    ]
    monkeypatch.setattr(sys, "argv", ["train", *args])
    with pytest.raises(SystemExit) as info:
        run()
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: malformed data row {data}:100: label 'x' is not 0 or 1")
    assert "\n" not in err and "Traceback" not in err


def _rank(rank: int, world: int, port: int, cfg: DictConfig, out: Path) -> None:
    from torch.distributed import destroy_process_group, is_initialized

    from torchrec_mtrains.distributed.runtime import init_process_group, resolve_device

    # A rank left waiting in a collective fails after 120 s instead of hanging the test.
    init_process_group(
        resolve_device("cpu"), timedelta(seconds=120), rank=rank, world_size=world, port=port
    )
    try:
        try:
            result: dict[str, object] = {"steps": main(cfg)["steps"]}
        except ConfigError as e:
            result = {"error": str(e)}
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        if is_initialized():  # the app aborts the group when a rank fails
            destroy_process_group()


def _two_ranks(tmp_path: Path, cfg: DictConfig) -> list[dict[str, object]]:
    from torchrec_mtrains.distributed.runtime import free_port

    for old in tmp_path.glob("rank*.json"):
        old.unlink()
    mp.spawn(_rank, args=(2, free_port(), cfg, tmp_path), nprocs=2, join=True)
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_two_ranks_agree_on_refusals_resume_and_rebuilt_files(tmp_path: Path) -> None:
    # Lines go round-robin: only rank 1's first batch holds the out-of-range id (line 2).
    data = write_tsv(tmp_path / "day_0.tsv", 200, big_cat_0=[2])
    run_dir = tmp_path / "run"
    base = ["run.num_threads=1", "run.tensorboard=false", "pipeline.lookahead=0"]
    refused = _two_ranks(
        tmp_path, tsv(run_dir, data, *base, "data.num_embeddings_per_feature=[100000]")
    )
    for result in refused:  # rank 0's data was fine: it stops with rank 1's reason
        assert "row id 8192 for feature 'cat_0'" in str(result["error"])
    assert not tier_files(run_dir)

    good = write_tsv(tmp_path / "day_1.tsv", 200)
    ran = _two_ranks(tmp_path, tsv(run_dir, good, *base, "run.steps=4"))
    assert [r["steps"] for r in ran] == [4, 4]
    cfg = tsv(run_dir, good, *base, "run.steps=6", "run.resume=true")
    app = to_app_config(cfg)
    victim = sorted(tier_root(app.hardware, Path(app.run.dir)).glob("*/rank1/*.rows"))[0]
    victim.unlink()
    resumed = _two_ranks(tmp_path, cfg)
    assert [r["steps"] for r in resumed] == [6, 6]
    assert victim.exists()
