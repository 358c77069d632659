"""The torchx component ``mtrains.dlrm``: its CLI contract, its AppDef, and a real 1x2 launch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from torchx.components.component_test_base import ComponentTestCase
from torchx.specs import AppDef, macros
from torchx.specs.finder import ModuleComponentsFinder, get_components

from torchrec_mtrains import components
from torchrec_mtrains.components import dlrm

REPO = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
# Small tables on all three tiers (see tests/apps/dlrm/test_train.py for the arithmetic).
SIZES = [4000, 2000] + [100] * 20 + [4000, 2000, 4000, 2000]


def test_registering_ours_keeps_torchx_builtins() -> None:
    # torchx falls back to its builtins only when no package registers components: ours must
    # not hide dist.ddp, utils.echo and the rest from an existing torchx workflow.
    builtins = {
        c.name
        for c in ModuleComponentsFinder("torchx.components", "").find()
        if not c.validation_errors
    }
    found = set(get_components())
    assert "mtrains.dlrm" in found
    assert {"dist.ddp", "utils.echo"} <= builtins
    assert builtins <= found, f"missing builtins: {sorted(builtins - found)}"


class DlrmComponentTest(ComponentTestCase):
    def test_validates_for_the_cli(self) -> None:
        self.validate(components, "dlrm")


def command(app: AppDef) -> str:
    (role,) = app.roles
    assert role.entrypoint == "bash"
    return role.args[-1]


def test_launches_the_app_under_torchrun_with_overrides() -> None:
    app = dlrm("run.steps=5", "planner.dram_budget=16MB", nnodes=1, nproc_per_node=2)
    cmd = command(app)
    assert cmd.startswith("torchrun ")
    assert "--nnodes 1 --nproc_per_node 2" in cmd
    assert "-m apps.dlrm.train run.steps=5 planner.dram_budget=16MB" in cmd
    # Without run.dir every rank must still agree on one: the app id.
    assert f"run.dir=runs/{macros.app_id}" in cmd
    assert app.roles[0].num_replicas == 1
    assert app.name == "dlrm"


def test_keeps_the_users_run_dir_and_passes_hydra_syntax_through() -> None:
    cmd = command(dlrm("run.dir=/tmp/x", "+extra.key=1", "~run.seed", "model=criteo_kaggle"))
    assert "run.dir=/tmp/x" in cmd
    assert "runs/" not in cmd
    assert "+extra.key=1" in cmd and "'~run.seed'" in cmd and "model=criteo_kaggle" in cmd


def test_multi_node_shape() -> None:
    app = dlrm(nnodes=2, nproc_per_node=4, name="exp/run1")
    assert app.roles[0].num_replicas == 2
    assert "--nnodes 2 --nproc_per_node 4" in command(app)


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"nnodes": 0}, "nnodes"),
        ({"nproc_per_node": 0}, "nproc_per_node"),
        ({"name": "bad name!"}, "name"),
        ({"cpu": 0}, "cpu"),
        ({"memMB": -1}, "memMB"),
        ({"max_retries": -1}, "max_retries"),
        ({"rdzv_port": 70000}, "rdzv_port"),
    ],
)
def test_bad_arguments_name_the_option(kwargs: dict[str, object], option: str) -> None:
    with pytest.raises(ValueError, match=rf"^{option}="):
        dlrm(**kwargs)  # type: ignore[arg-type]


def test_gpu_launch_runs_one_rank_per_gpu_on_cuda() -> None:
    app = dlrm("run.steps=5", gpu=8, j="2x8")
    (role,) = app.roles
    assert role.resource.gpu == 8
    assert role.num_replicas == 2
    cmd = command(app)
    assert "--nnodes 2 --nproc_per_node 8" in cmd
    assert "run.device=cuda" in cmd
    # Without -j or nproc_per_node: one rank per GPU.
    assert "--nproc_per_node 4" in command(dlrm(gpu=4))


def test_cpu_launch_runs_on_cpu_unless_the_overrides_say_otherwise() -> None:
    assert "run.device=cpu" in command(dlrm())
    cmd = command(dlrm("run.device=auto"))
    assert "run.device=auto" in cmd and "run.device=cpu" not in cmd
    assert "--nnodes 1 --nproc_per_node 3" in command(dlrm(j="3"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gpu": 2, "j": "1x4"}, "at most one rank per GPU"),
        ({"gpu": -1}, "^gpu="),
        ({"j": "1:2x4"}, "^j="),
        ({"j": "two"}, "^j="),
    ],
)
def test_bad_gpu_shapes_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dlrm(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("arg", ["steps", "run.steps", "--multirun", "-m", "=5"])
def test_non_override_script_args_are_rejected(arg: str) -> None:
    with pytest.raises(ValueError, match="script_args"):
        dlrm(arg)


def test_ranks_get_huge_pages_for_tensors_unless_env_says_otherwise() -> None:
    assert dlrm().roles[0].env["THP_MEM_ALLOC_ENABLE"] == "1"
    role = dlrm(env={"THP_MEM_ALLOC_ENABLE": "0", "LOGLEVEL": "INFO"}).roles[0]
    assert role.env["THP_MEM_ALLOC_ENABLE"] == "0"
    assert role.env["LOGLEVEL"] == "INFO"


def test_hydra_flags_with_values_are_allowed() -> None:
    assert "--cfg job" in command(dlrm("--cfg", "job", "run.steps=1"))


@pytest.mark.slow
def test_torchx_runs_the_app_on_two_ranks(tmp_path: Path) -> None:
    torchx = VENV_BIN / "torchx"
    if not torchx.exists() or shutil.which("torchrun", path=str(VENV_BIN)) is None:
        pytest.skip("torchx / torchrun not installed next to this interpreter")
    run_dir = tmp_path / "run"
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        [
            str(torchx),
            "run",
            "-s",
            "local_cwd",
            "mtrains.dlrm",
            "run.steps=10",
            "run.eval_batches=2",
            "run.progress=false",
            f"run.dir={run_dir}",
            "data.batch_size=64",
            f"model.num_embeddings_per_feature=[{','.join(map(str, SIZES))}]",
            "planner=size_rule",
            "planner.dram_budget=200KB",
            "planner.block_scm_min_bytes=200KB",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2
    assert metrics["steps"] == 10
    assert len(metrics["tables"]) == 6  # both ranks' tiered tables
    assert list(run_dir.glob("tiers/*/rank1/*.rows"))
