"""The built wheel works outside the repository: what the library needs ships inside it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources.
    source = out / "source"
    skip = (".*", "runs", "build", "*.egg-info", "results", "__pycache__", "outputs")
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(*skip))
    subprocess.run(
        [*PIP_WHEEL, "-w", str(out), str(source)],
        check=True,
        cwd=out,
    )
    (found,) = out.glob("torchrec_mtrains-*.whl")
    return found


def test_the_wheel_carries_the_hardware_presets(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(site)
    assert "torchrec_mtrains/conf/hardware/local.yaml" in names
    assert "torchrec_mtrains/py.typed" in names
    # A fresh interpreter that sees only the unpacked wheel (not this checkout) loads a preset.
    probe = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import torchrec_mtrains; from torchrec_mtrains.planner import load_topology; "
        "assert torchrec_mtrains.__file__.startswith(sys.argv[1]), torchrec_mtrains.__file__; "
        "print(load_topology('gpu_pmem_nvme').name)"
    )
    done = subprocess.run(
        [sys.executable, "-P", "-c", probe, str(site)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_pmem_nvme"
