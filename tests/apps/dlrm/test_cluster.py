"""Runs over several nodes: run.dir shared and checked, tier files node-local (warned on a
network file system), and ranks resumed on each other's nodes rebuild their tier files."""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from dlrm_helpers import app_config, checkpoint_weights

from apps.dlrm import cluster
from apps.dlrm.checkpoints import finished_checkpoints
from apps.dlrm.cluster import check_shared_run_dir, file_system_type, network_storage_warnings
from apps.dlrm.errors import ConfigError
from apps.dlrm.train import main
from torchrec_mtrains.distributed.runtime import free_port, process_group

TRAIN = ("data.batch_size=32", "run.eval_batches=0", "pipeline.lookahead=0")

MOUNTINFO = """\
22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
30 22 0:40 / /tmp rw,nosuid shared:9 - tmpfs tmpfs rw
41 22 0:52 / /mnt/shared rw,relatime shared:20 - nfs4 fs1:/export rw,vers=4.2
42 41 0:53 / /mnt/shared/scratch\\040space rw shared:21 - lustre 10.0.0.1@tcp:/lfs rw
"""


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/", "ext4"),
        ("/var/lib/x", "ext4"),
        ("/tmp/run/tiers", "tmpfs"),
        ("/tmpfoo", "ext4"),  # a prefix of a mount point's name is not under it
        ("/mnt/shared/run1/tiers/block_scm", "nfs4"),
        ("/mnt/shared/scratch space/t", "lustre"),  # the deepest mount wins; escapes decoded
    ],
)
def test_file_system_type_reads_the_deepest_mount(path: str, kind: str) -> None:
    assert file_system_type(Path(path), MOUNTINFO) == kind


def test_file_system_type_of_this_machine(tmp_path: Path) -> None:
    assert file_system_type(tmp_path / "not" / "yet") not in ("", "unknown")


def test_a_storage_tier_on_a_network_file_system_is_named_with_its_type() -> None:
    dirs = {"block_scm": Path("/mnt/shared/run/tiers/block_scm/rank0"), "byte_scm": Path("/tmp/b")}
    (warning,) = network_storage_warnings(dirs, MOUNTINFO)
    assert "block_scm tier's files go to /mnt/shared/run/tiers/block_scm/rank0" in warning
    assert "network file system (nfs4)" in warning
    assert "hardware.dirs.block_scm" in warning


def _check_rank(
    rank: int, world: int, port: int, dirs: list[Path], out: Path, nodes: list[str]
) -> None:
    os.environ["GROUP_RANK"] = nodes[rank]
    with process_group(timeout=timedelta(seconds=60), rank=rank, world_size=world, port=port):
        try:
            result = f"ok {check_shared_run_dir(dirs[rank], rank, world)}"
        except ConfigError as e:
            result = f"error {e}"
    (out / f"rank{rank}.txt").write_text(result)


def _check(tmp_path: Path, dirs: list[Path], nodes: list[str]) -> list[str]:
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    world = len(dirs)
    mp.spawn(_check_rank, args=(world, free_port(), dirs, out, nodes), nprocs=world, join=True)
    return [(out / f"rank{r}.txt").read_text() for r in range(world)]


@pytest.mark.slow
def test_every_rank_must_see_the_same_run_dir(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    assert _check(tmp_path, [shared, shared, shared], ["0", "1", "1"]) == ["ok 2"] * 3
    assert not list(shared.iterdir())  # the marker is gone
    # Node 1's ranks see a directory of the same name that is not rank 0's.
    results = _check(
        tmp_path, [shared, tmp_path / "elsewhere", tmp_path / "elsewhere"], ["0", "1", "1"]
    )
    assert len(set(results)) == 1, results  # every rank stops with the same error
    message = results[0]
    assert message.startswith(f"error run.dir={shared} is not shared by every rank")
    assert "(node 1) (ranks 1,2) do not see the marker" in message
    assert "(node 0)" in message  # rank 0's node, which wrote it


def test_the_app_warns_when_a_tier_is_on_a_network_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real = cluster.file_system_type
    nfs = tmp_path / "nfs"

    def pretend(path: Path, mountinfo: str | None = None) -> str:
        return "nfs4" if nfs in [path, *path.parents] else real(path, mountinfo)

    nfs.mkdir()
    monkeypatch.setattr(cluster, "file_system_type", pretend)
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.train"):
        main(app_config(tmp_path / "run", *TRAIN, "run.steps=1", f"hardware.dirs.block_scm={nfs}"))
    warned = [r.getMessage() for r in caplog.records if "network file system" in r.getMessage()]
    assert len(warned) == 1, warned  # the block tier only: the byte tier is under run.dir
    assert (
        f"the block_scm tier's files go to {nfs}/rank0, on a network file system (nfs4)"
        in (warned[0])
    )


def _node_rank(
    rank: int, world: int, port: int, run_dir: Path, roots: list[Path], overrides: tuple[str, ...]
) -> None:
    os.environ["GROUP_RANK"] = str(rank)  # one rank per node, each with its own tier disk
    with process_group(timeout=timedelta(seconds=120), rank=rank, world_size=world, port=port):
        main(app_config(run_dir, *TRAIN, f"hardware.tier_root={roots[rank]}", *overrides))


def _on_nodes(run_dir: Path, roots: list[Path], *overrides: str) -> None:
    args = (len(roots), free_port(), run_dir, roots, overrides)
    mp.spawn(_node_rank, args=args, nprocs=len(roots), join=True)


def _rank_files(root: Path, rank: int) -> list[str]:
    return sorted(p.name for p in root.glob(f"*/rank{rank}/*.rows"))


@pytest.mark.slow
def test_ranks_resumed_on_each_others_nodes_rebuild_their_tier_files(tmp_path: Path) -> None:
    """Two nodes with their own tier disks; the resume puts each rank on the other node, where
    its tier files are missing: they are rebuilt from the checkpoint, every row exact (two
    steps at learning rate 0 leave the checkpoint's weights)."""
    run_dir, node_a, node_b = tmp_path / "run", tmp_path / "node_a", tmp_path / "node_b"
    _on_nodes(run_dir, [node_a, node_b], "run.steps=4")
    first, second = _rank_files(node_a, 0), _rank_files(node_b, 1)
    assert first and second and not _rank_files(node_a, 1) and not _rank_files(node_b, 0)
    _on_nodes(run_dir, [node_b, node_a], "run.steps=6", "run.resume=true", "run.learning_rate=0")
    assert _rank_files(node_b, 0) == first and _rank_files(node_a, 1) == second
    (before_step, before), (after_step, after) = sorted(finished_checkpoints(run_dir))[-2:]
    assert (before_step, after_step) == (4, 6)
    written = checkpoint_weights(before, tmp_path / "a")
    restored = checkpoint_weights(after, tmp_path / "b")
    assert len(written) == 26 and written.keys() == restored.keys()
    for name, weight in written.items():
        assert torch.equal(weight, restored[name]), name
