"""What a run directory holds besides checkpoints: each rank's tier files and where they go,
the recorded plan's file name, and private files (0600 / 0700 whatever the umask: they hold
copies of the rows)."""

from __future__ import annotations

import os
from pathlib import Path

from apps.dlrm.model import tier_mounts, tier_root
from torchrec_mtrains.planner import HostTopology
from torchrec_mtrains.types import Tier

TIER_FILE_GLOB = "*.rows"
PLAN_FILE = "plan.json"
PRIVATE_FILE = 0o600
PRIVATE_DIR = 0o700


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


def private_dir(path: Path) -> None:
    """Creates ``path`` (and missing parents) as 0700 and makes an existing one 0700."""
    path.mkdir(mode=PRIVATE_DIR, parents=True, exist_ok=True)
    path.chmod(PRIVATE_DIR)


def write_private(path: Path, text: str) -> None:
    """Writes ``text`` to ``path`` with mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, PRIVATE_FILE)
    os.fchmod(fd, PRIVATE_FILE)
    with os.fdopen(fd, "w") as out:
        out.write(text)
