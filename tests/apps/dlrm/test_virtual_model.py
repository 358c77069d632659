"""The app with virtual tables (``model.virtual``): raw ids from a 2**40 space train, evict,
report, and a run stopped at a checkpoint of a chain resumes to the uninterrupted run's bits."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from dlrm_helpers import compose_app
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from apps.dlrm.checkpoints import finished_checkpoints
from apps.dlrm.config import to_app_config
from apps.dlrm.errors import ConfigError
from apps.dlrm.train import main

SPACE = 2**40
# Two virtual tables over 2**40 ids (features 0 and 1) beside 24 small ones, all planned by
# the tiered planner; a round once a table holds more than 600 of its 800 rows.
VIRTUAL = (
    f"model.num_embeddings_per_feature=[{SPACE},{SPACE}{',100' * 24}]",
    "model.virtual.features=[0,1]",
    "model.virtual.max_live_rows=[800]",
    "model.virtual.trigger_count=600",
    "data.batch_size=64",
    "run.progress=false",
    "run.eval_batches=2",
)


def _run(run_dir: Path, *overrides: str) -> None:
    main(compose_app(*VIRTUAL, f"run.dir={run_dir}", *overrides))


def _leaves(checkpoint: Path, scratch: Path) -> dict[str, Any]:
    flat = scratch / f"{checkpoint.parent.parent.name}-{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, flat)
    saved = torch.load(flat, weights_only=False)
    out: dict[str, Any] = {}

    def walk(node: Any, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}" if path else str(key))
        else:
            out[path] = node

    walk(saved, "")
    return out


def test_a_virtual_model_trains_on_raw_ids_evicts_and_reports(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(tmp_path / "run", "run.steps=40")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for name in ("t_cat_0", "t_cat_1"):
        table = metrics["tables"][name]
        assert table["max_live_rows"] == 800 and 0 < table["live_rows"] <= 800
        assert table["rows_evicted"] > 0 and table["rows_made"] > 800  # ids came and went
    assert "live_rows" not in metrics["tables"].get("t_cat_5", {})
    out = capsys.readouterr().out
    assert "virtual table   live rows" in out and "t_cat_0" in out
    assert metrics["eval_auc"] is not None


def test_the_score_policy_keeps_the_tables_near_full(tmp_path: Path) -> None:
    """``model.virtual.eviction=score``: TorchRec's FeatureScoreBasedEvictionPolicy, a round
    keeping the 400 ids scored highest once a table holds more than 600."""
    score = ("model.virtual.eviction=score", "model.virtual.keep_count=400")
    _run(tmp_path / "run", "run.steps=40", *score, "model.virtual.decay_rate=0.9")
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    for name in ("t_cat_0", "t_cat_1"):
        table = metrics["tables"][name]
        assert table["rows_evicted"] > 0 and table["eviction_rounds"] > 0
        # (a round keeps 400; at most one batch of 64 new ids past the trigger of 600 waits)
        assert 400 <= table["live_rows"] <= 600 + 64


@pytest.mark.cuda
def test_a_virtual_model_trains_on_cuda_and_resumes_on_the_cpu(tmp_path: Path) -> None:
    """On a GPU: the virtual tables' caches in HBM, rows made and evicted on the host's tiers,
    look-ahead 2, a checkpoint chain; the run then resumed on the CPU from it."""
    run_dir = tmp_path / "run"
    every = ("run.checkpoint_every=10", "pipeline.lookahead=2")
    _run(run_dir, "run.device=cuda", "run.steps=40", *every)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    for name in ("t_cat_0", "t_cat_1"):
        table = metrics["tables"][name]
        assert 0 < table["live_rows"] <= 800 and table["rows_evicted"] > 0
    assert "hbm" in (run_dir / "plan.txt").read_text()
    resumed = main(
        compose_app(
            *VIRTUAL, f"run.dir={run_dir}", "run.device=cpu", "run.resume=true", "run.steps=48"
        )
    )
    assert resumed["resumed_from_step"] == 40 and resumed["steps"] == 48


def test_a_run_resumed_from_a_chain_is_bitwise_the_uninterrupted_run(tmp_path: Path) -> None:
    every = ("run.checkpoint_every=4", "run.full_checkpoint_every=3")
    _run(tmp_path / "whole", "run.steps=12", *every, "run.final_checkpoint=false")
    stopped = tmp_path / "stopped"
    _run(stopped, "run.steps=8", *every, "run.final_checkpoint=false")
    parents = {
        step: json.loads((path / "DONE").read_text()).get("parent")
        for step, path in finished_checkpoints(stopped)
    }
    assert parents == {4: None, 8: "step_00000004"}  # the resume restores a chain
    _run(stopped, "run.steps=12", *every, "run.final_checkpoint=false", "run.resume=true")
    want = _leaves(tmp_path / "whole" / "checkpoints" / "step_00000012", tmp_path)
    got = _leaves(stopped / "checkpoints" / "step_00000012", tmp_path)
    assert sorted(got) == sorted(want)
    virtual = [k for k in want if ".t_cat_0." in k or ".t_cat_1." in k]
    assert any(k.endswith("t_cat_0.evicted_id") for k in virtual)  # 12 builds on 8
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def test_a_profile_of_raw_ids_plans_the_virtual_tables(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from apps.dlrm import profile

    out = tmp_path / "profile"
    assert profile.main(["--out", str(out), "--max-batches", "8", *VIRTUAL]) == 0
    _run(tmp_path / "run", "run.steps=4", f"planner.profile={out}.json")
    plan = (tmp_path / "run" / "plan.txt").read_text().splitlines()
    rows = [line.split() for line in plan if line.startswith(("t_cat_0 ", "t_cat_1 "))]
    assert len(rows) == 2 and all(r[-1] == "measured" and "tiered" in r for r in rows), rows


def _criteo_day(path: Path, rows: int) -> Path:
    """Criteo-shaped TSV rows: 32-bit hexadecimal categorical values."""
    rng = random.Random(0)
    lines = []
    for _ in range(rows):
        dense = [str(rng.randint(0, 50)) for _ in range(13)]
        cats = [f"{rng.getrandbits(32):08x}" for _ in range(26)]
        lines.append("\t".join([str(rng.randint(0, 1)), *dense, *cats]) + "\n")
    path.write_text("".join(lines))
    return path


def test_criteo_values_are_a_virtual_tables_ids_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    day = _criteo_day(tmp_path / "day_0.tsv", 160)
    criteo = ("data=criteo_tsv", f"data.paths=[{day}]", "data.batch_size=32", "run.steps=3")
    _run(tmp_path / "run", *criteo)
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics["tables"]["t_cat_0"]["live_rows"] >= 3 * 32 - 3  # raw ids barely repeat
    # in an id space too small for them, raw values are refused by name, never folded in
    small = (f"model.num_embeddings_per_feature=[{2**20},{SPACE}{',100' * 24}]",)
    with pytest.raises(ConfigError, match=r"feature 'cat_0'.*t_cat_0's 1048576 rows"):
        _run(tmp_path / "small", *criteo, *small)


def test_bad_virtual_settings_are_refused_naming_the_option() -> None:
    cases = [
        (("model.virtual.features=[0,0]",), r"model\.virtual\.features=\[0, 0\]"),
        (("model.virtual.features=[0]", "model.virtual.max_live_rows=[]"), "max_live_rows"),
        (("model.virtual.eviction=lru",), r"model\.virtual\.eviction='lru'"),
        (("model.virtual.eviction=score",), r"model\.virtual\.keep_count=0"),
        (("model.virtual.total_num_buckets=3",), "total_num_buckets=3 must divide"),
        (("model.virtual.features=[0,2]",), r"800 for t_cat_2 exceeds its id space"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            to_app_config(compose_app(*VIRTUAL, *overrides))


def test_virtual_tables_need_the_tiered_planner(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"virtual tables are placed by the tiered planner"):
        _run(tmp_path / "run", "planner=size_rule", "run.steps=1")
