"""SIGKILL the app mid-run, resume, and get the uninterrupted run's checkpoint bit for bit.

Drives ``benchmarks/fault_injection.py``'s functions with kills placed by events rather than by
time, so each trial lands in its phase on any machine: mid-training, inside a checkpoint write,
and in start-up followed by a kill inside the final checkpoint's write (before evaluation).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
STEPS = 24
EVERY = 8  # checkpoints at 8 and 16 while training, 24 (the final one) before evaluation


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "fault_injection", REPO / "benchmarks" / "fault_injection.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fault_injection"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_killed_runs_resume_bitwise(tmp_path: Path) -> None:
    fi = _script()
    ref = fi.reference_run(tmp_path, lookahead=2, steps=STEPS, checkpoint_every=EVERY)
    assert ref.outcome.done == {"step": STEPS, "epoch": 0, "batch": STEPS}
    assert len(ref.outcome.losses) == STEPS and ref.outcome.eval_auc is not None

    Kill = fi.Kill
    cases = [
        # mid-training, past checkpoint 8: resumes from 8 and retrains steps 9-12
        (2, [Kill(step=12)], [8], ["training (step 1"]),
        # inside dcp.save of checkpoint 16: the unfinished one goes, resumes from 8
        (2, [Kill(checkpoint=16)], [8], ["checkpoint write (16)"]),
        # start-up (nothing on disk yet), then inside the final checkpoint's write (just
        # before evaluation); the plain loop must give the look-ahead reference's bits
        (0, [Kill(at_s=0.5), Kill(checkpoint=STEPS)], [None, 16], ["start-up", "final checkpoint"]),
    ]
    for number, (lookahead, kills, resumed, phases) in enumerate(cases, 1):
        trial = fi.run_trial(number, tmp_path, ref, kills, STEPS, EVERY, lookahead=lookahead)
        assert trial.outcome == "exact", (number, trial.differences, trial.runs)
        tensors = [v for v in ref.outcome.leaves.values() if isinstance(v, torch.Tensor)]
        assert trial.tensors == len(tensors) > 50
        assert len(trial.kills) == len(kills)
        for run, phase in zip(trial.kills, phases):
            assert run.phase.startswith(phase), (number, run)
        assert [r.resumed_from for r in trial.runs[1:]] == resumed


def test_a_changed_tensor_is_reported(tmp_path: Path) -> None:
    """The comparison the trials rely on sees a one-bit change and a missing entry."""
    import torch

    fi = _script()
    ref = {"/a": torch.tensor([1.0, 2.0]), "/b": torch.zeros(2, 2), "/lr": 0.05}
    same = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ref.items()}
    assert fi.compare_leaves(ref, same) == (2, [])
    flipped = dict(same, **{"/b": torch.tensor([[0.0, -0.0], [0.0, 0.0]])})
    assert fi.compare_leaves(ref, flipped)[1] == ["tensor /b differs"]
    missing = {k: v for k, v in same.items() if k != "/lr"}
    assert fi.compare_leaves(ref, missing)[1] == ["missing /lr"]
