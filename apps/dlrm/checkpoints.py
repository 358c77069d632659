"""Checkpoints of a run: where they go, which one to resume from, and the tier files a run
directory holds."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

from apps.dlrm.errors import ConfigError
from torchrec_mtrains.types import Tier

TIER_FILE_GLOB = "*.rows"


def tier_files(cfg: DictConfig, rank: int) -> dict[str, tuple[int, int]]:
    """This rank's tier files, path -> (device, inode), to tell reopened files from new ones."""
    roots = [Path(str(cfg.hardware.tier_root)) / t.value for t in Tier]
    roots += [Path(str(d)) for d in cfg.hardware.dirs.values()]
    out: dict[str, tuple[int, int]] = {}
    for root in roots:
        for path in (root / f"rank{rank}").glob(TIER_FILE_GLOB):
            st = path.stat()
            out[str(path)] = (st.st_dev, st.st_ino)
    return out


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def last_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    done = sorted((run_dir / "checkpoints").glob("step_*/DONE"))
    if not done:
        return None
    path = done[-1].parent
    return int(path.name.split("_")[1]), path


def save_checkpoint(
    model: DistributedModelParallel, optimizer: CombinedOptimizer, run_dir: Path, step: int
) -> Path:
    """Saves model and optimizer with torch.distributed.checkpoint; tiered tables stream from
    their tiers chunk by chunk. A ``DONE`` file marks the checkpoint complete."""
    path = checkpoint_dir(run_dir, step)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        (path / "DONE").write_text(str(step))
    dist.barrier()
    return path


def load_checkpoint(
    model: DistributedModelParallel, optimizer: CombinedOptimizer, path: Path
) -> None:
    state = {"model": model.state_dict(), "optim": optimizer.state_dict()}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])


def resume_point(cfg: DictConfig, run_dir: Path, rank: int) -> tuple[int, Path] | None:
    last = last_checkpoint(run_dir)
    if cfg.run.resume:
        if last is None:
            raise ConfigError(
                f"run.resume=true but {run_dir}/checkpoints holds no finished checkpoint: "
                "point run.dir at an earlier run's directory, or drop run.resume."
            )
        return last
    if last is not None or tier_files(cfg, rank):
        raise ConfigError(
            f"run.dir={run_dir} already holds a run (checkpoints or tier files): pass "
            "run.resume=true to continue it, or choose a new run.dir."
        )
    return None
