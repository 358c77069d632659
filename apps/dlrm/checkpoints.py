"""Checkpoints of a run: where they go, which one to resume from, and the tier files a run
directory holds."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import DictConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.optim.keyed import CombinedOptimizer

from apps.dlrm.errors import ConfigError
from apps.dlrm.model import tier_mounts, tier_root
from torchrec_mtrains.types import Tier

TIER_FILE_GLOB = "*.rows"


class Position(NamedTuple):
    """Where training stands in the data: the epoch and the next batch (per rank) in it."""

    epoch: int
    batch: int


def tier_files(cfg: DictConfig, rank: int) -> dict[str, tuple[int, int]]:
    """This rank's tier files, path -> (device, inode), to tell reopened files from new ones."""
    roots = [tier_root(cfg) / t.value for t in Tier]
    roots += [Path(d) for d in tier_mounts(cfg).values()]
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
    model: DistributedModelParallel,
    optimizer: CombinedOptimizer,
    run_dir: Path,
    step: int,
    position: Position | None = None,
) -> Path:
    """Saves model and optimizer with torch.distributed.checkpoint; tiered tables stream from
    their tiers chunk by chunk. A ``DONE`` file marks the checkpoint complete and records the
    data ``position`` a resumed run continues from (default: ``step`` batches into epoch 0)."""
    path = checkpoint_dir(run_dir, step)
    dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        epoch, batch = position or Position(0, step)
        (path / "DONE").write_text(json.dumps({"step": step, "epoch": epoch, "batch": batch}))
    dist.barrier()
    return path


def checkpoint_position(path: Path) -> Position:
    """The data position a checkpoint was taken at. A ``DONE`` holding only the step (written
    before epochs existed) means that many batches into the first epoch."""
    done = path / "DONE"
    try:
        record = json.loads(done.read_text())
        if isinstance(record, int):
            return Position(0, record)
        return Position(int(record["epoch"]), int(record["batch"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(
            f"{done} does not say where the checkpoint stands ({e!r}): delete that checkpoint "
            "to resume from an earlier one"
        ) from None


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
