"""A run over several hosts: what all ranks share and what stays on each node.

``run.dir`` holds what every rank reads or writes together (the plan record, checkpoints,
metrics), so it must be one file system that every node mounts at the same path; the app checks
that before any tier file is made. Tier files are each rank's own and see random block I/O, so
they belong on node-local storage (``hardware.tier_root`` / ``hardware.dirs``, e.g. an NVMe
mount); the app warns, naming the path and its file system, when a storage tier sits on a
network file system. A rank that lands on a node without its tier files rebuilds them from the
checkpoint on resume (:func:`apps.dlrm.model.build_storage`).
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import cast

import torch.distributed as dist

from apps.dlrm.errors import ConfigError

__all__ = [
    "NETWORK_FILE_SYSTEMS",
    "check_shared_run_dir",
    "file_system_type",
    "network_storage_warnings",
    "node_name",
]

logger = logging.getLogger(__name__)

# File system types whose I/O goes over a network (as /proc/self/mountinfo names them).
NETWORK_FILE_SYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "ceph",
        "glusterfs",
        "fuse.glusterfs",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
        "fuse.juicefs",
        "9p",
        "afs",
        "panfs",
        "wekafs",
        "virtiofs",
    }
)


def node_name() -> str:
    """This rank's node as a user would name it: the host name, and torchrun's node rank when
    it runs under torchrun (two agents on one host are two nodes to the job)."""
    host = socket.gethostname()
    group = os.environ.get("GROUP_RANK")
    return f"{host} (node {group})" if group is not None else host


def check_shared_run_dir(run_dir: Path, rank: int, world: int) -> int:
    """Checks that every rank sees the same ``run_dir``: rank 0 writes a marker there and every
    rank reads it. Returns the number of nodes the ranks run on.

    Raises:
        ConfigError: on every rank, naming the nodes (and their ranks) that do not see rank 0's
            marker, when some do not.
    """
    if world == 1:
        return 1
    token: list[object] = [uuid.uuid4().hex, str(run_dir)] if rank == 0 else [None, None]
    dist.broadcast_object_list(token, src=0)  # rank 0's path names run.dir in the error
    marker = run_dir / f".shared-check-{token[0]}"
    if rank == 0:
        marker.write_text(str(token[0]))
    dist.barrier()
    try:
        seen = marker.read_text() == token[0]
    except OSError:
        seen = False
    gathered: list[object] = [None] * world
    dist.all_gather_object(gathered, (seen, node_name()))
    views = [cast(tuple[bool, str], view) for view in gathered]
    if rank == 0:
        marker.unlink(missing_ok=True)
    nodes: dict[str, list[int]] = defaultdict(list)
    blind: dict[str, list[int]] = defaultdict(list)
    for r, (ok, node) in enumerate(views):
        nodes[node].append(r)
        if not ok:
            blind[node].append(r)
    if blind:
        who = "; ".join(f"{node} (ranks {_ranks(ranks)})" for node, ranks in blind.items())
        raise ConfigError(
            f"run.dir={token[1]} is not shared by every rank: {who} do not see the marker rank 0 "
            f"({views[0][1]}) wrote there. The plan, checkpoints and metrics of a run live in "
            "run.dir, so it must be a file system every node mounts at the same path (NFS, "
            "Lustre, ...): pass run.dir=<that path>. Tier files go to node-local storage "
            "(hardware.tier_root / hardware.dirs)."
        )
    if len(nodes) > 1 and rank == 0:
        logger.info(
            "%d nodes: %s",
            len(nodes),
            "; ".join(f"{node} ranks {_ranks(ranks)}" for node, ranks in nodes.items()),
        )
    return len(nodes)


def _ranks(ranks: Iterable[int]) -> str:
    return ",".join(map(str, ranks))


def _unescape(field: str) -> str:
    """A mountinfo path field: spaces, tabs, newlines and backslashes come octal-escaped."""
    for code, char in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
        field = field.replace(code, char)
    return field


def file_system_type(path: Path, mountinfo: str | None = None) -> str:
    """The type of the file system ``path`` is on (``ext4``, ``nfs4``, ``tmpfs``, ...), from the
    deepest mount over it (links resolved in its existing part); ``unknown`` where mountinfo
    cannot be read.

    Args:
        path: a file or directory, which need not exist yet.
        mountinfo: the text of ``/proc/self/mountinfo`` (read when not given).
    """
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return "unknown"
    # Links resolved in the part that exists; the rest will be made under it.
    target, rest = Path(os.path.abspath(path)), []
    while not target.exists() and target != target.parent:
        rest.append(target.name)
        target = target.parent
    where = Path(os.path.realpath(target)).joinpath(*reversed(rest))
    best, kind = -1, "unknown"
    for line in mountinfo.splitlines():
        before, sep, after = line.partition(" - ")
        fields = before.split()
        if not sep or len(fields) < 5 or not after.split():
            continue
        mount = Path(_unescape(fields[4]))
        depth = len(mount.parts)
        # The deepest mount over the path wins; a later line for the same point mounts over.
        if (where == mount or mount in where.parents) and depth >= best:
            best, kind = depth, after.split()[0]
    return kind


def network_storage_warnings(
    tier_dirs: Mapping[str, Path], mountinfo: str | None = None
) -> list[str]:
    """One warning per storage tier whose directory is on a network file system."""
    warnings = []
    for tier, directory in sorted(tier_dirs.items()):
        kind = file_system_type(directory, mountinfo)
        if kind in NETWORK_FILE_SYSTEMS:
            warnings.append(
                f"the {tier} tier's files go to {directory}, on a network file system ({kind}): "
                "each row read and write-back goes over the network. Point hardware.tier_root "
                f"or hardware.dirs.{tier} at node-local storage (an NVMe mount)."
            )
    return warnings
