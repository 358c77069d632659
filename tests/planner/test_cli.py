"""Smoke tests of the command-line entry points and the perf-model benchmark: they run and
write what they promise."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from torchrec_mtrains import plan as plan_cli
from torchrec_mtrains import profile as profile_cli
from torchrec_mtrains.profiler import AccessProfile

REPO = Path(__file__).resolve().parents[2]


def test_whatif_cli_runs_on_the_shipped_model(capsys: pytest.CaptureFixture[str]) -> None:
    code = plan_cli.main(
        [
            "--model",
            "whatif_multi_tb",
            "--hardware",
            "gpu_pmem_nvme",
            "--batch-size",
            "4096",
            "--target-throughput",
            "1000000",
            "planner.cache_steps=32",
            "planner.balance_rounds=2",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "t_cat_0" in out and "assumed zipf" in out and "predicted step time" in out
    assert "minimum hosts" in out
    for host_type in ("HBM+DRAM only", "+ byte SCM", "+ block SCM", "+ both SCM"):
        assert host_type in out


def test_whatif_cli_rejects_unknown_names(capsys: pytest.CaptureFixture[str]) -> None:
    assert plan_cli.main(["--model", "nope", "--hardware", "local"]) == 2
    assert "available" in capsys.readouterr().err


def test_profile_cli_on_tiny_synthetic_data(tmp_path: Path) -> None:
    out = tmp_path / "prof"
    code = profile_cli.main(
        [
            "--out",
            str(out),
            "model=small",
            "data=synthetic",
            "data.num_batches=6",
            "data.batch_size=64",
        ]
    )
    assert code == 0
    profile = AccessProfile.from_json(out.with_suffix(".json"))
    assert len(profile.tables) == 26 and profile.batches_profiled == 6
    assert profile["t_cat_2"].num_rows == 1_000_000
    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.usefixtures("process_group")
def test_perf_model_check_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location(
        "perf_model_check", REPO / "benchmarks" / "perf_model_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["perf_model_check"] = module
    spec.loader.exec_module(module)
    assert module.main(["check", "--quick", "--dir", str(tmp_path), "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "measured" in out and "error" in out


def _whatif(capsys: pytest.CaptureFixture[str], *overrides: str) -> tuple[int, str, str]:
    code = plan_cli.main(["--model", "small", "--hardware", "local", *overrides])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_whatif_cli_honours_the_apps_planner_budgets(capsys: pytest.CaptureFixture[str]) -> None:
    code, unbounded, _ = _whatif(capsys)
    assert code == 0 and "byte_scm" not in unbounded  # 279 MiB fit the VM's DRAM
    code, bounded, _ = _whatif(capsys, "planner.dram_budget=64MB")
    assert code == 0 and "byte_scm" in bounded
    # The app's default preset: 64 MB of DRAM and 100 MB of byte SCM, so block SCM too.
    code, bounded, _ = _whatif(capsys, "planner=tiered_capacity_bound")
    assert code == 0 and "byte_scm" in bounded and "block_scm" in bounded


def test_whatif_cli_refuses_what_it_cannot_use_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _whatif(capsys, "planner=size_rule")
    assert code == 2 and err.startswith("error: planner=size_rule")
    code, _, err = _whatif(capsys, "hardware.dram.capacity=200MB")
    assert code == 2 and "dram_reserved" in err and "200MB" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
