"""What a run directory holds besides checkpoints: each rank's tier files and where they go,
and the recorded plan's file name."""

from __future__ import annotations

from pathlib import Path

from apps.dlrm.model import tier_mounts, tier_root
from torchrec_mtrains.planner import HostTopology
from torchrec_mtrains.types import Tier

TIER_FILE_GLOB = "*.rows"
PLAN_FILE = "plan.json"


def tier_files(hardware: HostTopology, run_dir: Path, rank: int) -> dict[str, tuple[int, int]]:
    """This rank's tier files, path -> (device, inode), to tell reopened files from new ones."""
    roots = [tier_root(hardware, run_dir) / t.value for t in Tier]
    roots += [Path(d) for d in tier_mounts(hardware).values()]
    out: dict[str, tuple[int, int]] = {}
    for root in roots:
        for path in (root / f"rank{rank}").glob(TIER_FILE_GLOB):
            st = path.stat()
            out[str(path)] = (st.st_dev, st.st_ino)
    return out


def tier_dir(hardware: HostTopology, run_dir: Path, tier: str, rank: int) -> Path:
    """Where ``tier``'s files of ``rank`` go (as ``TierStorage.directory``, creating nothing)."""
    mounts = tier_mounts(hardware)
    base = Path(mounts[tier]) if tier in mounts else tier_root(hardware, run_dir) / tier
    return base / f"rank{rank}"
