"""The built wheel works outside the repository: what the library needs ships inside it, nothing
else lands in site-packages, and the editable install the Makefile makes still puts the checkout
(the app, the benchmarks) on the path.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")
SKIP = (".*", "runs", "build", "*.egg-info", "results", "__pycache__", "outputs")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources.
    copy = tmp_path_factory.mktemp("source") / "torchrec_mtrains"
    shutil.copytree(REPO, copy, ignore=shutil.ignore_patterns(*SKIP))
    return copy


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([*PIP_WHEEL, "-w", str(out), str(source)], check=True, cwd=out)
    (found,) = out.glob("torchrec_mtrains-*.whl")
    return found


@pytest.fixture(scope="module")
def site(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel unpacked, as pip lays it into site-packages."""
    site = tmp_path_factory.mktemp("site")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def _dist_info_file(wheel: Path, file: str) -> str:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(f".dist-info/{file}")]
        return archive.read(name).decode()


def _outside_checkout(site: Path, probe: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Runs ``probe`` with the unpacked wheel and this venv's third-party packages on the path,
    but not the checkout: ``-S`` skips the .pth files, among them the editable install's."""
    purelib = sysconfig.get_paths()["purelib"]
    setup = f"import sys; sys.path[:0] = [{str(site)!r}, {purelib!r}]; "
    return subprocess.run(
        [sys.executable, "-S", "-P", "-c", setup + probe],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_wheel_carries_the_hardware_presets(wheel: Path, site: Path, tmp_path: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert "torchrec_mtrains/conf/hardware/local.yaml" in names
    assert "torchrec_mtrains/py.typed" in names
    probe = (
        "import torchrec_mtrains; from torchrec_mtrains.planner import load_topology; "
        f"assert torchrec_mtrains.__file__.startswith({str(site)!r}), torchrec_mtrains.__file__; "
        "print(load_topology('gpu_pmem_nvme').name)"
    )
    done = _outside_checkout(site, probe, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "gpu_pmem_nvme"


def test_the_wheel_installs_only_the_library(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        tops = {name.split("/")[0] for name in archive.namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"torchrec_mtrains"}
    assert _dist_info_file(wheel, "top_level.txt").split() == ["torchrec_mtrains"]


def test_torchx_finds_the_component_in_the_wheel_without_a_checkout(
    wheel: Path, site: Path, tmp_path: Path
) -> None:
    entry_points = _dist_info_file(wheel, "entry_points.txt")
    assert "mtrains = torchrec_mtrains.components" in entry_points
    # torchx reads the wheel's entry points (its dist-info comes first on the path), imports the
    # component from it and can print its help; the app is not there, and a launch says so.
    probe = (
        "import importlib.util\n"
        "from torchx.specs.finder import get_component\n"
        "c = get_component('mtrains.dlrm')\n"
        "assert not c.validation_errors, c.validation_errors\n"
        "assert c.fn.__module__ == 'torchrec_mtrains.components'\n"
        "assert importlib.util.find_spec('apps') is None\n"
        "print(c.description.splitlines()[0])\n"
        "try:\n"
        "    c.fn('run.steps=5')\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e)\n"
    )
    done = _outside_checkout(site, probe, tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("Trains the DLRM app (python -m apps.dlrm.train)")
    assert "apps.dlrm.train" in lines[1] and "checkout" in lines[1]


def test_the_editable_install_puts_the_checkout_on_the_path(source: Path, tmp_path: Path) -> None:
    # make install's `pip install -e .`: the app (apps/) is not a package of the wheel, but the
    # benchmarks, the torchx CLI and `python -m apps.dlrm.train` import it from the venv.
    build = (
        "import sys; from setuptools import build_meta; "
        "print(build_meta.build_editable(sys.argv[1]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)],
        cwd=source,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip().splitlines()[-1]
    with zipfile.ZipFile(tmp_path / name) as archive:
        (pth,) = [n for n in archive.namelist() if n.endswith(".pth")]
        assert archive.read(pth).decode().split() == [str(source)]
