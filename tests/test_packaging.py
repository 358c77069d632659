"""The built wheel works outside the repository: what the library needs ships inside it, nothing
else lands in site-packages, its metadata declares every third-party import of the code, and the
editable install the Makefile makes still puts the checkout (the app, the benchmarks) on the path.
"""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PIP_WHEEL = (sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation")
SKIP = (".*", "runs", "build", "*.egg-info", "results", "__pycache__", "outputs")
# The torch stack: never an unconditional requirement (see pyproject.toml's extras).
TORCH_STACK = {"torch", "fbgemm-gpu", "fbgemm-gpu-cpu", "torchrec"}
# Modules of one distribution that need another one installed to import.
NEEDS = {"torch.utils.tensorboard": "tensorboard"}


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


def _metadata(wheel: Path) -> Message:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return Parser().parsestr(archive.read(name).decode())


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


def test_the_torch_stack_is_only_in_extras(wheel: Path) -> None:
    requires = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    unconditional = {canonicalize_name(r.name) for r in requires if r.marker is None}
    assert not unconditional & TORCH_STACK
    extras = {r.marker and str(r.marker) for r in requires if r.marker is not None}
    assert {'extra == "cpu"', 'extra == "cuda"'} <= extras


def _third_party_imports(roots: list[Path]) -> dict[str, set[str]]:
    """Every module imported (statically, or by ``importlib.import_module("name")``) by the
    files under ``roots`` that neither the standard library nor this repository provides,
    with the files importing it."""
    ours = {p.name for p in REPO.iterdir()}
    found: dict[str, set[str]] = {}
    for root in roots:
        for path in root.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    modules = [node.module]
                elif (
                    isinstance(node, ast.Call)
                    and ast.unparse(node.func) == "importlib.import_module"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    modules = [str(node.args[0].value)]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        found.setdefault(module, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_third_party_import_is_declared(wheel: Path) -> None:
    requires = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    declared = {canonicalize_name(r.name) for r in requires if r.marker is None}
    stack = {canonicalize_name(r.name) for r in requires if r.marker is not None}
    providers = importlib.metadata.packages_distributions()
    imports = _third_party_imports([REPO / "torchrec_mtrains", REPO / "apps", REPO / "benchmarks"])
    missing = {}
    for module, files in sorted(imports.items()):
        dists = [NEEDS[m] for m in NEEDS if module == m or module.startswith(m + ".")]
        dists += providers.get(module.split(".")[0], [])
        assert dists, f"{module} (imported by {sorted(files)}) is not installed here"
        names = {canonicalize_name(d) for d in dists}
        allowed = stack | declared if names & TORCH_STACK else declared
        if not names & allowed:
            missing[module] = (sorted(names), sorted(files))
    assert not missing, f"imported but not in pyproject.toml's dependencies: {missing}"


def test_torchrecs_own_needs_are_declared(wheel: Path) -> None:
    # torchrec goes in with --no-deps on a CPU host, so what its metadata requires (less the
    # CUDA fbgemm-gpu and its optional extras) must come from ours.
    requires = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    declared = {canonicalize_name(r.name): r for r in requires if r.marker is None}
    for line in importlib.metadata.requires("torchrec") or []:
        need = Requirement(line)
        if need.marker is not None or canonicalize_name(need.name) in TORCH_STACK:
            continue
        ours = declared.get(canonicalize_name(need.name))
        assert ours is not None, f"torchrec needs {need}; not in our dependencies"
        assert not need.specifier or ours.specifier == need.specifier, (need, ours)


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s#]+)", line)
        if match:
            pins[canonicalize_name(match.group(1))] = match.group(2)
    return pins


def test_the_extras_pin_the_stacks_of_the_requirements_files(wheel: Path) -> None:
    requires = [Requirement(r) for r in _metadata(wheel).get_all("Requires-Dist") or []]
    cpu, cuda = _pins(REPO / "requirements/cpu.txt"), _pins(REPO / "requirements/cuda.txt")
    # torchrec is installed apart from the requirements files: `make install TORCHREC=...`
    # (the Makefile's default on CPU, cuda.txt's install line on CUDA).
    makefile = re.search(r"^TORCHREC \?= (\S+)$", (REPO / "Makefile").read_text(), re.M)
    on_cuda = re.search(r"TORCHREC=(\S+)", (REPO / "requirements/cuda.txt").read_text())
    assert makefile is not None and on_cuda is not None
    cpu["torchrec"], cuda["torchrec"] = makefile.group(1), on_cuda.group(1)
    for extra, pins in (("cpu", cpu), ("cuda", cuda)):
        stack = [r for r in requires if r.marker and r.marker.evaluate({"extra": extra})]
        assert stack, extra
        for req in stack:
            pin = pins.get(canonicalize_name(req.name))
            assert str(req.specifier) == f"=={pin}", (extra, str(req), pin)
    # Every dependency is pinned in both requirements files, within its declared range.
    for req in (r for r in requires if r.marker is None):
        for pins in (cpu, cuda):
            assert req.specifier.contains(pins[canonicalize_name(req.name)]), str(req)


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
