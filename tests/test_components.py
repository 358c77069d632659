"""The torchx component ``mtrains.dlrm``: its CLI contract, its AppDef sized from the hardware
preset, the jobs it submits to local_cwd, Slurm and Kubernetes (dry runs), and a real launch on
two torchrun agents (``-j 2x1``) resumed on one (``-j 1x2``)."""

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
from torchrec_mtrains.distributed.runtime import free_port

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
    cmd = command(dlrm("run.dir=/tmp/x", "++run.seed=3", "model=criteo_kaggle"))
    assert "run.dir=/tmp/x" in cmd
    assert "runs/" not in cmd
    assert "++run.seed=3" in cmd and "model=criteo_kaggle" in cmd
    # Composed as each rank composes them: what the app's schema refuses fails here.
    with pytest.raises(ValueError, match=r"script_args: .*~run\.seed"):
        dlrm("~run.seed")


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


def test_a_node_is_sized_from_the_preset_the_overrides_name() -> None:
    (role,) = dlrm("run.steps=5").roles  # hardware=local: 2 cores, 24 GB, 2 ranks
    assert (role.resource.cpu, role.resource.memMB, role.resource.gpu) == (
        2,
        24 * 10**9 // 2**20,
        0,
    )
    assert "--nproc_per_node 2" in role.args[-1]
    (role,) = dlrm("hardware=cpu_cxl_nvme", "hardware.dram.capacity=512GiB").roles
    assert (role.resource.cpu, role.resource.memMB) == (112, 512 * 1024)
    (role,) = dlrm("hardware=gpu_pmem_nvme", j="2x8").roles
    assert (role.resource.cpu, role.resource.gpu, role.resource.memMB) == (128, 8, 2**20)
    assert "run.device=cuda" in role.args[-1]
    # What the arguments give wins.
    (role,) = dlrm("hardware=gpu_pmem_nvme", cpu=16, memMB=4096, gpu=0).roles
    assert (role.resource.cpu, role.resource.memMB, role.resource.gpu) == (16, 4096, 0)
    assert "--nproc_per_node 8" in role.args[-1] and "run.device=cpu" in role.args[-1]


def test_overrides_that_do_not_compose_fail_at_submission() -> None:
    with pytest.raises(ValueError, match=r"script_args: .*hardware/nope"):
        dlrm("hardware=nope")
    with pytest.raises(ValueError, match=r"script_args: .*run\.stpes"):
        dlrm("run.stpes=3")


def test_a_launch_without_the_app_says_where_it_comes_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # An installed wheel holds the component but not the app (apps/, conf/): a checkout does.
    monkeypatch.setitem(sys.modules, "apps.dlrm.config", None)
    with pytest.raises(ModuleNotFoundError, match=r"\(apps\.dlrm\.train\).*checkout"):
        dlrm("run.steps=5")


def test_tier_root_is_the_hardware_tier_root() -> None:
    assert "hardware.tier_root=/local/nvme/run1" in command(dlrm(tier_root="/local/nvme/run1"))
    with pytest.raises(ValueError, match="tier_root"):
        dlrm("hardware.tier_root=/a", tier_root="/b")


# The W2 model on two hosts of the local preset, as the README launches it.
W2_TWO_HOSTS = ["-j", "2x2", "--tier_root", "/local/nvme/w2"]
W2_OVERRIDES = ["model=w2_large", "hardware=local", "run.dir=/shared/runs/w2"]


def _dryrun(scheduler: str, args: list[str], **cfg: str) -> str:
    from torchx.runner import get_runner

    with get_runner() as runner:
        return str(runner.dryrun_component("mtrains.dlrm", args, scheduler, cfg=cfg))


def test_slurm_dryrun_asks_for_the_presets_cpus_and_memory() -> None:
    script = _dryrun("slurm", [*W2_TWO_HOSTS, *W2_OVERRIDES])
    node = f"--ntasks-per-node=1 --cpus-per-task=2 --mem={24 * 10**9 // 2**20}"
    assert script.count(node) == 2, script  # one job of the heterogeneous job per node
    assert "--nnodes 2 --nproc_per_node 2" in script
    assert "hardware.tier_root=/local/nvme/w2" in script and "model=w2_large" in script
    # The CLI hands optional counts over as text.
    script = _dryrun("slurm", ["--cpu", "4", "--memMB", "2048", *W2_OVERRIDES])
    assert "--cpus-per-task=4 --mem=2048" in script, script


def test_kubernetes_dryrun_asks_for_the_presets_cpus_and_memory() -> None:
    pytest.importorskip("kubernetes")
    mounts = "type=bind,src=/local/nvme,dst=/local/nvme,type=volume,src=mtrains-runs,dst=/shared"
    args = ["--image", "mtrains:latest", "--mounts", mounts, *W2_TWO_HOSTS, *W2_OVERRIDES]
    spec = _dryrun("kubernetes", args, queue="default")
    assert spec.count("\n    name: train-") == 2, spec  # one task per node
    mem_mb = 24 * 10**9 // 2**20
    assert spec.count("cpu: 2000m") == 2 and spec.count(f"memory: {mem_mb}M") == 2  # limits
    # torchx's requests leave 100m of a node's cores and 1 GiB of its memory to the kubelet
    assert spec.count("cpu: 1900m") == 2 and spec.count(f"memory: {mem_mb - 1024}M") == 2
    assert "--nnodes 2 --nproc_per_node 2" in spec and "model=w2_large" in spec
    assert "hardware.tier_root=/local/nvme/w2" in spec
    # The node's own NVMe for the tier files, a shared claim for run.dir.
    assert "path: /local/nvme" in spec and "claimName: mtrains-runs" in spec


def test_local_dryrun_runs_torchrun_per_node() -> None:
    request = _dryrun("local_cwd", ["-j", "2x1", "run.steps=5"])
    assert request.count("torchrun") == 2, request
    assert "--nnodes 2 --nproc_per_node 1" in request


def _torchx_run(args: list[str], timeout: int) -> subprocess.CompletedProcess[str]:
    torchx = VENV_BIN / "torchx"
    if not torchx.exists() or shutil.which("torchrun", path=str(VENV_BIN)) is None:
        pytest.skip("torchx / torchrun not installed next to this interpreter")
    env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    proc = subprocess.run(
        [str(torchx), "run", "-s", "local_cwd", "mtrains.dlrm", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
def test_two_torchrun_agents_train_and_one_resumes(tmp_path: Path) -> None:
    """``-j 2x1``: two torchrun agents (two "nodes") join over c10d on loopback, each rank with
    its own tier root; ``-j 1x2`` resumes the run from its checkpoint on one agent."""
    run_dir = tmp_path / "run"
    model = [
        "run.eval_batches=2",
        "run.progress=false",
        f"run.dir={run_dir}",
        "data.batch_size=64",
        f"model.num_embeddings_per_feature=[{','.join(map(str, SIZES))}]",
        "planner=size_rule",
        "planner.dram_budget=200KB",
        "planner.block_scm_min_bytes=200KB",
    ]
    two_nodes = ["-j", "2x1", "--rdzv_port", str(free_port()), "--tier_root", str(tmp_path / "t")]
    proc = _torchx_run([*two_nodes, *model, "run.steps=6"], timeout=300)
    assert "2 nodes" in proc.stdout + proc.stderr
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["steps"]) == (2, 6)
    assert metrics["tables"]  # both ranks' tiered tables
    assert list((tmp_path / "t").glob("*/rank1/*.rows"))
    assert (run_dir / "checkpoints" / "step_00000006" / "DONE").exists()

    # One host instead of two: half the DRAM, so another plan (run.replan=true rebuilds the
    # tier files from the checkpoint under it).
    one_node = ["-j", "1x2", "--tier_root", str(tmp_path / "t")]
    resume = [*model, "run.steps=10", "run.resume=true", "run.replan=true"]
    _torchx_run([*one_node, *resume], timeout=300)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["steps"]) == (2, 10)
    assert metrics["resumed_from_step"] == 6
    files = metrics["tier_files"]
    assert files["created"] >= 1 and files["created"] + files["reopened"] == len(metrics["tables"])
    assert (run_dir / "checkpoints" / "step_00000010" / "DONE").exists()
