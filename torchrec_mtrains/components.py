"""The torchx component that launches the DLRM app: ``mtrains.dlrm``.

Registered under the ``torchx.components`` entry point as ``mtrains``, so from the repository
root::

    torchx run -s local_cwd mtrains.dlrm run.steps=100 planner.dram_budget=16MB
    torchx run -s slurm mtrains.dlrm -j 2x2 hardware=local model=w2_large
    torchx run -s local_cwd mtrains.dlrm --help

It lives in the library, not beside the app in ``apps/dlrm/``, because the entry point must
import wherever the package is installed: the wheel holds ``torchrec_mtrains`` only. The app
itself (``apps/dlrm/``, its Hydra config in ``conf/``) runs from a checkout, or an image built
from one: each rank runs ``python -m apps.dlrm.train`` in the job's working directory. So
``--help`` works anywhere; a launch composes the app's config and needs the app importable (a
checkout after ``make install``, or ``PYTHONPATH=<checkout>``).

The job is sized from the plan's host: the overrides are composed as every rank will compose
them, and the hardware preset they name (``hardware=...``, ``hardware.dram.capacity=...``) gives
each node's CPUs, memory and GPUs and each node's ranks, unless ``cpu`` / ``memMB`` / ``h`` /
``gpu`` / ``j`` say otherwise. A bad override fails here, at submission, not on the cluster.

Typing note: torchx 0.7's component linter reads the annotations from the source and accepts only
``typing.Optional`` / ``typing.Dict`` / ``typing.List``, not PEP 604/585 spellings, and the CLI
needs real (not postponed) annotations, so this module keeps the old spellings on purpose. The
CLI also hands ``Optional[int]`` arguments over as text, which :func:`dlrm` reads as numbers.
"""

# ruff: noqa: UP006, UP035, UP045

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Iterator, List, Optional, Tuple

import torchx
from torchx import specs
from torchx.components.dist import ddp

if TYPE_CHECKING:  # the planner imports TorchRec: only a launch pays for it, not torchx's listing
    from torchrec_mtrains.planner.topology import HostTopology

APP_MODULE = "apps.dlrm.train"

# Hydra's command-line flags that take a value in the next argument.
_HYDRA_FLAGS_WITH_VALUE = frozenset(
    {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp"}
)
_HYDRA_FLAGS_WITH_VALUE |= {"--config-name", "-cn", "--config-dir", "-cd"}
# Sweeps would start one Hydra multirun per rank, each forming its own job: not a DDP launch.
_REJECTED_FLAGS = frozenset({"--multirun", "-m"})
_OVERRIDE = re.compile(r"^(~|\+\+|\+)?[A-Za-z_@][\w.@/\-]*(=.*)?$", re.DOTALL)
_NAME = re.compile(r"^[A-Za-z0-9_\-]*(/[A-Za-z0-9_\-]*)?$")


def _hydra_args(script_args: List[str]) -> Iterator[Tuple[str, bool]]:
    """Each of ``script_args`` but the values of Hydra's flags, with whether it is a flag."""
    expect_value = False
    for arg in script_args:
        if expect_value:
            expect_value = False
            continue
        is_flag = arg.startswith("-")
        if is_flag:
            expect_value = arg in _HYDRA_FLAGS_WITH_VALUE
        yield arg, is_flag


def _check_overrides(overrides: List[str]) -> None:
    for arg, is_flag in _hydra_args(overrides):
        if arg in _REJECTED_FLAGS:
            raise ValueError(
                f"script_args: {arg!r} (Hydra multirun) is not supported under a distributed "
                "launch; submit one job per configuration instead"
            )
        if is_flag:
            continue
        is_override = "=" in arg or arg.startswith("~")
        if not (is_override and _OVERRIDE.match(arg)):
            raise ValueError(
                f"script_args: {arg!r} is not a Hydra override; write key=value "
                "(e.g. run.steps=100, hardware=local, model.num_embeddings_per_feature=[...])"
            )


_J = re.compile(r"^(?:(\d+)x)?(\d+)$")


def _parse_j(j: str) -> Tuple[int, int]:
    match = _J.match(j.strip())
    if not match:
        raise ValueError(
            f"j={j!r}: write {{nnodes}}x{{nproc_per_node}} (e.g. 1x8) or {{nproc_per_node}}; "
            "elastic ranges (min:max) are not supported"
        )
    return int(match.group(1) or 1), int(match.group(2))


def _has_override(overrides: List[str], key: str) -> bool:
    return any(re.match(rf"^(\+\+|\+)?{re.escape(key)}=", arg) for arg in overrides)


def _hydra_overrides(script_args: List[str]) -> List[str]:
    """The key=value overrides among ``script_args`` (Hydra's flags and their values left out)."""
    return [arg for arg, is_flag in _hydra_args(script_args) if not is_flag]


def _optional_int(value: object, name: str) -> Optional[int]:
    if value is None or isinstance(value, int):
        return value
    try:
        return int(str(value))
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a whole number") from None


@dataclass(frozen=True)
class NodeShape:
    """What one node of the job needs, from the hardware preset the overrides name."""

    preset: str
    cpu: int
    mem_mb: int
    gpu: int
    ranks: int

    @classmethod
    def of(cls, host: "HostTopology") -> "NodeShape":
        from torchrec_mtrains.planner.sizes import parse_size

        return cls(
            preset=host.name,
            cpu=host.cpu_cores,
            mem_mb=parse_size(host.dram.capacity, "hardware.dram.capacity") // 2**20,
            gpu=host.gpu.count if host.gpu is not None else 0,
            ranks=host.ranks_per_host,
        )


def _app_conf_dir() -> str:
    """The app's Hydra config directory; importing the app's config registers its schemas.

    Raises:
        ModuleNotFoundError: the app is not importable here (an installed wheel without a
            checkout), saying where it comes from.
    """
    try:
        from apps.dlrm.config import CONF_DIR
    except ModuleNotFoundError as e:
        if e.name not in {"apps", "apps.dlrm", "apps.dlrm.config"}:
            raise
        raise ModuleNotFoundError(
            f"mtrains.dlrm launches the DLRM app ({APP_MODULE}), which is not importable here "
            f"({e.name!r} not found). The app and its config (apps/, conf/) are not part of the "
            "installed package: run torchx from the root of a torchrec_mtrains checkout after "
            "`make install`, or with PYTHONPATH=<checkout>",
            name=e.name,
        ) from None
    return CONF_DIR


def node_shape(script_args: List[str]) -> NodeShape:
    """The node the app's config describes once ``script_args`` are applied, composed as each
    rank composes it (``conf/config.yaml``, its defaults, the overrides).

    Raises:
        ValueError: an override does not compose (unknown key or preset, bad value), naming it.
    """
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    conf_dir = _app_conf_dir()  # before the planner, which imports TorchRec

    from torchrec_mtrains.planner.presets import topology_from_config

    try:
        with initialize_config_dir(config_dir=conf_dir, version_base=None):
            cfg = compose(config_name="config", overrides=_hydra_overrides(script_args))
        return NodeShape.of(topology_from_config(cfg.hardware))
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise ValueError(f"script_args: {e}") from None


# PyTorch backs large CPU tensors with transparent huge pages: a step allocates hundreds of MiB
# of activations and gradients afresh, and faulting them in 4 KiB at a time costs tens of ms.
DEFAULT_ENV: Dict[str, str] = {"THP_MEM_ALLOC_ENABLE": "1"}


def dlrm(
    *script_args: str,
    nnodes: int = 1,
    nproc_per_node: Optional[int] = None,
    j: Optional[str] = None,
    name: str = "dlrm",
    image: str = torchx.IMAGE,
    cpu: Optional[int] = None,
    gpu: Optional[int] = None,
    memMB: Optional[int] = None,
    h: Optional[str] = None,
    tier_root: Optional[str] = None,
    mounts: Optional[List[str]] = None,
    env: Optional[Dict[str, str]] = None,
    max_retries: int = 0,
    rdzv_port: int = 29500,
    debug: bool = False,
) -> specs.AppDef:
    """Trains the DLRM app (python -m apps.dlrm.train) with its large tables on storage tiers.

    Every rank runs the Hydra app with the same overrides; ranks join one process group through
    torchrun: NCCL with one rank per GPU when gpu > 0 (the app gets run.device=cuda), gloo on
    CPUs otherwise (run.device=cpu), unless the overrides set run.device. Without a run.dir
    override all ranks write to runs/<app id>. Each node is sized from the hardware preset the
    overrides name (hardware=local by default): its cpu_cores, dram.capacity, GPUs and
    ranks_per_host, unless the arguments below set them.

    On a cluster, run.dir must be a file system every node mounts at the same path (plan,
    checkpoints, metrics; the app checks it) and tier_root a node-local disk (NVMe).

    Args:
        script_args: Hydra overrides for the app, e.g. run.steps=100 planner.dram_budget=16MB
        nnodes: number of nodes (hosts)
        nproc_per_node: number of training processes (ranks) on each node; default: one per
            GPU when gpu > 0, else the preset's ranks_per_host
        j: {nnodes}x{nproc_per_node} as for dist.ddp, e.g. 2x8 (or {nproc_per_node} alone);
            takes precedence over nnodes and nproc_per_node
        name: job name, {experimentname}/{runname} or {runname}
        image: image to run in (the working directory for the local_cwd scheduler)
        cpu: number of CPUs per node; default: the preset's cpu_cores
        gpu: number of GPUs per node, each rank gets one; default: the preset's gpu.count (0
            without GPUs)
        memMB: host memory per node in MiB; default: the preset's dram.capacity
        h: a registered named resource (takes precedence over cpu, gpu and memMB)
        tier_root: node-local directory for the tier files (hardware.tier_root), e.g. an NVMe
            mount; default: the overrides' hardware.tier_root, else <run.dir>/tiers
        mounts: mounts into each node's container, e.g. on Kubernetes
            type=bind,src=/local/nvme,dst=/local/nvme (the tier root) and
            type=volume,src=<shared claim>,dst=/shared (run.dir)
        env: extra environment variables, e.g. OMP_NUM_THREADS=1,LOGLEVEL=INFO; ranks get
            THP_MEM_ALLOC_ENABLE=1 (huge pages for large tensors) unless env sets it
        max_retries: the number of scheduler retries allowed
        rdzv_port: port on the rank 0 host for the c10d rendezvous (multi-node only)
        debug: whether to run with torch's distributed debug flags enabled

    Returns:
        specs.AppDef: one role of nnodes replicas, each a torchrun of nproc_per_node ranks.

    Raises:
        ValueError: an argument is out of range or a script argument is not a Hydra override
            (or does not compose with the app's config).
    """
    # torchx's CLI hands Optional[int] arguments over as text.
    nproc_per_node = _optional_int(nproc_per_node, "nproc_per_node")
    cpu, gpu, memMB = (
        _optional_int(cpu, "cpu"),
        _optional_int(gpu, "gpu"),
        _optional_int(memMB, "memMB"),
    )
    if gpu is not None and gpu < 0:
        raise ValueError(f"gpu={gpu}: must be 0 or more")
    if cpu is not None and cpu < 1:
        raise ValueError(f"cpu={cpu}: must be at least 1")
    if memMB is not None and memMB < 1:
        raise ValueError(f"memMB={memMB}: must be at least 1")
    if j is not None:
        nnodes, nproc_per_node = _parse_j(j)
    if nnodes < 1:
        raise ValueError(f"nnodes={nnodes}: must be at least 1")
    if not name or not _NAME.match(name):
        raise ValueError(
            f"name={name!r}: use letters, digits, '-' and '_', optionally as experiment/run"
        )
    if max_retries < 0:
        raise ValueError(f"max_retries={max_retries}: must be 0 or more")
    if not 0 < rdzv_port < 65536:
        raise ValueError(f"rdzv_port={rdzv_port}: must be a TCP port in 1..65535")
    if tier_root is not None and not tier_root.strip():
        raise ValueError("tier_root='': give a directory, or leave it out")
    overrides = list(script_args)
    _check_overrides(overrides)
    if tier_root is not None:
        if _has_override(overrides, "hardware.tier_root"):
            raise ValueError(
                "tier_root is given both as an argument and as hardware.tier_root: keep one"
            )
        overrides.append(f"hardware.tier_root={tier_root}")
    shape = node_shape(overrides)
    gpu = shape.gpu if gpu is None else gpu
    if nproc_per_node is None:
        nproc_per_node = gpu if gpu > 0 else shape.ranks
    if nproc_per_node < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node}: must be at least 1")
    if gpu and nproc_per_node > gpu:
        raise ValueError(
            f"{nproc_per_node} ranks per node but gpu={gpu}: run at most one rank per GPU"
        )
    if not _has_override(overrides, "run.dir"):
        # Each rank composes its own config; a timestamped default could differ between them.
        overrides.append(f"run.dir=runs/{specs.macros.app_id}")
    if not _has_override(overrides, "run.device"):
        overrides.append(f"run.device={'cuda' if gpu else 'cpu'}")
    return ddp(
        *overrides,
        m=APP_MODULE,
        image=image,
        name=name,
        h=h,
        cpu=shape.cpu if cpu is None else cpu,
        gpu=gpu,
        memMB=shape.mem_mb if memMB is None else memMB,
        j=f"{nnodes}x{nproc_per_node}",
        env={**DEFAULT_ENV, **(env or {})},
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        mounts=mounts,
        debug=debug,
    )
