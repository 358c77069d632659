"""The app's command-line tools over its configs (what-if planning, profiling): they run and
write what they promise."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from apps.dlrm import profile as profile_cli
from apps.dlrm import whatif as plan_cli
from torchrec_mtrains.profiler import AccessProfile

REPO = Path(__file__).resolve().parents[3]
VENV_BIN = Path(sys.executable).parent


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
            "--launch",
            "slurm",
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
    # The launch: the host type reaching the target on the fewest hosts, as a torchx command
    # that runs as printed (here as a dry run).
    counts = {
        line[:26].strip(): int(line[26:33])
        for line in out.splitlines()
        if line.startswith("HBM+DRAM") and line[26:33].strip().isdigit()
    }
    hosts = min(counts.values())
    best = next(label for label, n in counts.items() if n == hosts)
    (launch,) = [line for line in out.splitlines() if line.startswith("torchx run")]
    assert f"to train on {hosts} {best} host" in out
    args = shlex.split(launch)
    assert args[:6] == ["torchx", "run", "-s", "slurm", "mtrains.dlrm", "-j"]
    assert args[6] == f"{hosts}x8" and args[7:9] == ["--gpu", "8"]
    assert "model=whatif_multi_tb" in args and "hardware=gpu_pmem_nvme" in args
    assert "data.batch_size=4096" in args and "planner=tiered" in args
    assert "planner.dram_budget=768GiB" in args  # 1 TiB less the preset's dram_reserved
    assert ("hardware.block_scm=null" in args) == ("block" not in best)
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    dry = subprocess.run(
        [str(VENV_BIN / "torchx"), "run", "--dryrun", *args[2:]],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert f"--nnodes {hosts} --nproc_per_node 8" in dry.stdout
    assert "--cpus-per-task=128 --mem=1048576 --gpus-per-task=8" in dry.stdout


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


def test_whatif_cli_plans_virtual_tables_by_their_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = plan_cli.main(["--model", "small_virtual", "--hardware", "local"])
    out = capsys.readouterr().out
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("t_cat_")}
    for name in ("t_cat_2", "t_cat_11", "t_cat_20"):  # 2**40 ids, 65,536 live rows each
        assert rows[name][1] == "1099511627776" and rows[name][4] == "tiered", rows[name]
        assert int(rows[name][5]) <= 65536  # cache rows: at most the bound
    # bounded by planner.max_live_rows too (it wins over the model's)
    code = plan_cli.main(
        ["--model", "small_virtual", "--hardware", "local", "+planner.max_live_rows.t_cat_2=1024"]
    )
    bounded = {
        line.split()[0]: line.split()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("t_cat_")
    }
    assert code == 0 and int(bounded["t_cat_2"][5]) <= 1024 < int(bounded["t_cat_11"][5])


def test_whatif_cli_refuses_what_it_cannot_use_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = _whatif(capsys, "planner=size_rule")
    assert code == 2 and err.startswith("error: planner=size_rule")
    code, _, err = _whatif(capsys, "hardware.dram.capacity=200MB")
    assert code == 2 and "dram_reserved" in err and "200MB" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def _predicted_step(out: str) -> str:
    (line,) = [line for line in out.splitlines() if "predicted step time" in line]
    return line


def test_whatif_cli_plans_with_the_datas_pooling_factors(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The app plans with ``data.pooling_factors`` when the model names none; so does the CLI."""
    code, one_id, _ = _whatif(capsys)
    assert code == 0
    code, twenty_ids, _ = _whatif(capsys, "data.pooling_factors=[20]")
    assert code == 0
    assert _predicted_step(one_id) != _predicted_step(twenty_ids)


@pytest.mark.parametrize("trim", ["64MiB", "null"])
def test_training_keeps_freed_host_memory_when_asked(tmp_path: Path, trim: str) -> None:
    """``run.malloc_trim_threshold`` sets the C library once the model is built (in a process
    of its own: the setting is the process's), and says so; ``null`` leaves it alone."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "apps.dlrm.train", f"run.dir={tmp_path / 'run'}"),
            *("run.steps=3", "run.eval_batches=0", f"run.malloc_trim_threshold={trim}"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    said = "host memory a step frees is kept for the next (up to 64 MiB free"
    assert (said in done.stderr + done.stdout) == (trim != "null")
