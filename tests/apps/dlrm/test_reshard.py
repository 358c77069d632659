"""A checkpoint written at one world size resumes at another, under a new plan, every row exact;
a changed plan at the same world size is refused unless ``run.replan=true``."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from dlrm_helpers import app_config, checkpoint_weights

from apps.dlrm.checkpoints import finished_checkpoints
from apps.dlrm.errors import RunDirError
from apps.dlrm.plan_record import planned_world_size
from apps.dlrm.train import main

# Row-wise sharding of the large tables makes the plan depend on the world size.
TRAIN = ("data.batch_size=32", "run.eval_batches=0", "pipeline.lookahead=0")


def _rank(rank: int, world: int, port: int, run_dir: Path, overrides: tuple[str, ...]) -> None:
    from torchrec_mtrains.distributed.runtime import process_group

    with process_group(timeout=timedelta(seconds=120), rank=rank, world_size=world, port=port):
        main(app_config(run_dir, *TRAIN, *overrides))


def _run(world: int, run_dir: Path, *overrides: str) -> None:
    if world == 1:
        main(app_config(run_dir, *TRAIN, *overrides))
        return
    from torchrec_mtrains.distributed.runtime import free_port

    mp.spawn(_rank, args=(world, free_port(), run_dir, overrides), nprocs=world, join=True)


@pytest.mark.slow
@pytest.mark.parametrize("resume_world", [1, 4])
def test_a_two_rank_checkpoint_resumes_at_another_world_size(
    tmp_path: Path, resume_world: int
) -> None:
    run_dir = tmp_path / "run"
    _run(2, run_dir, "run.steps=4")
    assert planned_world_size(run_dir) == 2
    # Two more steps at learning rate 0: the weights must be the checkpoint's, bit for bit,
    # however the new plan splits the tables over ranks and tiers.
    _run(resume_world, run_dir, "run.steps=6", "run.resume=true", "run.learning_rate=0")
    assert planned_world_size(run_dir) == resume_world
    (before_step, before), (after_step, after) = sorted(finished_checkpoints(run_dir))[-2:]
    assert (before_step, after_step) == (4, 6)
    written = checkpoint_weights(before, tmp_path)
    restored = checkpoint_weights(after, tmp_path)
    assert len(written) == 26 and written.keys() == restored.keys()
    for name, weight in written.items():
        assert torch.equal(weight, restored[name]), name


def test_a_changed_plan_at_the_same_world_size_needs_replan(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    _run(1, run_dir, "run.steps=2")
    moved = "planner.block_scm_min_bytes=100MB"  # the block-tier tables go to byte SCM
    with pytest.raises(RunDirError, match=r"plan changed.*run\.replan=true"):
        _run(1, run_dir, "run.steps=3", "run.resume=true", moved)
    _run(1, run_dir, "run.steps=3", "run.resume=true", moved, "run.replan=true")
    assert max(step for step, _ in finished_checkpoints(run_dir)) == 3
    assert not list(run_dir.glob("tiers/block_scm/*/*.rows"))  # the old plan's files are gone


@pytest.mark.slow
def test_an_incremental_chain_resumes_at_another_world_size(tmp_path: Path) -> None:
    """Checkpoints 2 (full), 4 and 6 (the rows changed since the one before) of a two-rank
    run load at one rank: its weights are those of an uninterrupted run's full checkpoint at 6."""
    chained, reference = tmp_path / "chained", tmp_path / "reference"
    every = ("run.checkpoint_every=2", "run.steps=6")
    _run(2, chained, *every, "run.full_checkpoint_every=4", "run.final_checkpoint=false")
    parents = {
        step: json.loads((path / "DONE").read_text()).get("parent")
        for step, path in finished_checkpoints(chained)
    }
    assert parents == {2: None, 4: "step_00000002", 6: "step_00000004"}
    _run(2, reference, *every, "run.full_checkpoint_every=1")
    _run(1, chained, "run.steps=7", "run.resume=true", "run.learning_rate=0")
    expected = checkpoint_weights(reference / "checkpoints" / "step_00000006", tmp_path / "a")
    restored = checkpoint_weights(chained / "checkpoints" / "step_00000007", tmp_path / "b")
    assert len(expected) == 26 and expected.keys() == restored.keys()
    for name, weight in expected.items():
        assert torch.equal(weight, restored[name]), name
