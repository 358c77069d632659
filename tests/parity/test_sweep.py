"""A fixed-seed slice of the randomized parity sweep, and checks of the sweep itself.

``python -m tests.parity.sweep --sweep N --seed S`` runs more (see :mod:`tests.parity.sweep`)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.parity.cases import SweepCase, TableDraw, draw_case
from tests.parity.sweep import (
    Outcome,
    build,
    draw_cases,
    regions,
    report,
    run_in_process,
    run_spawned,
    set_weights,
    state_differences,
)

SEED = 2026


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """World-size-1 cases run in this process."""


def _assert_all_exact(outcomes: list[Outcome]) -> None:
    summary, failures = report(outcomes)
    assert not failures, "\n".join([summary, *failures])
    refused = [o for o in outcomes if o.status == "refused"]
    # The draw offers only what TorchRec's FUSED kernel runs: a refusal is a bad draw.
    assert not refused, "\n".join(o.details[0] for o in refused)


def test_a_slice_at_world_size_1(tmp_path: Path) -> None:
    cases = draw_cases(120, SEED, world_sizes=(1,))
    _assert_all_exact(run_in_process(cases, tmp_path))


@pytest.mark.slow
def test_a_slice_at_world_size_2(tmp_path: Path) -> None:
    cases = draw_cases(30, SEED + 1, world_sizes=(2,))
    outcomes = run_spawned(cases, tmp_path)
    assert len(outcomes) == len(cases)
    _assert_all_exact(outcomes)


def test_the_draw_covers_every_axis() -> None:
    rng = random.Random(SEED)
    cases = [draw_case(rng, i, world_size=1 + i % 2) for i in range(300)]
    tables = [t for c in cases for t in c.tables]
    seen = {
        "kind": {c.kind for c in cases},
        "weighted": {c.weighted for c in cases},
        "pooling": {c.pooling for c in cases},
        "vbe": {c.vbe for c in cases},
        "optimizer": {c.optimizer for c in cases},
        "loop": {c.loop for c in cases},
        "world": {c.world_size for c in cases},
        "layout": {c.block_layout for c in cases},
        "placement": {t.placement for t in tables},
        "sharding": {t.sharding for t in tables},
        "policy": {t.policy for t in tables},
        "tables": {len(c.tables) for c in cases},
    }
    assert seen["kind"] == {"ebc", "ec"} and seen["weighted"] == {True, False}
    assert seen["pooling"] == {"sum", "mean"} and seen["vbe"] == {True, False}
    assert seen["optimizer"] == {"sgd", "adagrad", "rowwise_adagrad"}
    assert seen["loop"] == {"plain", "lookahead", "torchrec"} and seen["world"] == {1, 2}
    assert seen["layout"] == {"flat", "log"} and seen["policy"] == {"lru", "lfu"}
    assert seen["placement"] == {"fused", "dram", "byte_scm", "block_scm"}
    assert seen["sharding"] == {"table_wise", "column_wise", "row_wise"}
    assert seen["tables"] == set(range(1, 9))
    assert {t.cache for t in tables} >= {0.0, 1.0} and any(t.hot_rows for t in tables)
    assert min(t.rows for t in tables) == 1 and max(t.rows for t in tables) > 10_000
    assert any(len({t.dim for t in c.tables}) > 1 for c in cases)  # dims differ per table
    assert any(len(t.features) > 1 for t in tables)  # several features per table
    shared = [c for c in cases if sum(len(t.features) for t in c.tables) > len(c.features)]
    assert shared  # a feature read by two tables
    assert {c.batch for c in cases} >= {1} and {c.max_ids for c in cases} >= {0}
    switching = [c for c in cases if c.pattern.count("TF") + c.pattern.count("FT") >= 2]
    assert len(switching) > 50  # tiered and resident tables interleave
    assert {c.dtype for c in cases} == {"fp32", "fp16"}
    ops = [op for c in cases for op in c.ops]
    assert {op.split(":")[0] for op in ops} == {"train", "write", "lr", "save", "load"}
    assert {op.split(":")[2] for op in ops if op.startswith("write:")} == {
        "all",
        "some",
        "weights",
        "state",
    }
    assert {op for op in ops if op.startswith("save:")} == {"save:dcp", "save:full", "save:inc"}
    loads = {tuple(op.split(":")[1:]) for op in ops if op.startswith("load:")}
    assert {(target, how) for target, _, how in loads} == {
        (target, how) for target in ("same", "fresh") for how in ("inplace", "load_state_dict")
    }
    assert {len(c.worlds) for c in cases} == {1, 2}  # some move to the other world size
    assert any(not c.ops for c in cases)  # and some only train


def test_a_case_reruns_from_its_line() -> None:
    case = draw_case(random.Random(5), 5, world_size=2)
    assert case.ops  # its schedule too
    assert SweepCase.from_line(case.to_line()) == case
    outcome = Outcome(case.to_line(), 0, "mismatch", ["step 3: loss 1.0, TorchRec 2.0"])
    summary, (failure,) = report([outcome])
    assert "1 mismatched" in summary
    rerun = failure.splitlines()[-1].strip()
    assert rerun == f"rerun: python -m tests.parity.sweep --case '{case.to_line()}'"


def test_the_comparison_sees_one_changed_value(tmp_path: Path) -> None:
    """One value of one tiered row, changed by the smallest step a float takes, is reported
    (so "bit for bit" is what the sweep checks)."""
    case = SweepCase(
        tables=(
            TableDraw("t_a", 50, 8, ("f0",), placement="block_scm", cache=0.5),
            TableDraw("t_b", 30, 8, ("f1",)),
        )
    )
    ref = build(case, None)
    set_weights(ref, case)
    tie = build(case, tmp_path / "tiers")
    tie.load_state_dict(ref.state_dict())
    assert state_differences(ref, tie) == []
    state = tie.state_dict()
    (_, _, rows), *_ = regions(state["emb.embedding_bags.t_a.weight"])
    with torch.no_grad():
        rows[7, 3] = torch.nextafter(rows[7, 3], torch.tensor(1.0))
    tie.load_state_dict(state)
    assert state_differences(ref, tie) == ["emb.embedding_bags.t_a.weight"]


def test_a_fixed_seed_slice_of_the_virtual_table_axis_is_exact(tmp_path: Path) -> None:
    """40 drawn virtual-table configurations (a third at world size 2), bit for bit."""
    from tests.parity.virtual_sweep import draw_virtual_cases, run_virtual, virtual_report

    cases = draw_virtual_cases(40, SEED)
    assert {c.world_size for c in cases} == {1, 2}
    assert {c.eviction for c in cases} >= {"none", "count", "ttl", "mixed", "l2"}
    assert {c.evaluate_every > 0 for c in cases} == {True, False}
    outcomes = run_virtual(cases, tmp_path)
    summary, failures = virtual_report(outcomes)
    assert not failures, "\n".join([summary, *failures])
    assert sum(status == "refused" for _, status, _ in outcomes) <= 4, summary


def test_a_fixed_seed_slice_of_the_managed_collision_axis_is_exact(tmp_path: Path) -> None:
    """20 drawn managed-collision configurations (some at world size 2), bit for bit."""
    from tests.parity.mc_sweep import draw_mc_cases, mc_report, run_mc

    cases = draw_mc_cases(20, SEED)
    assert {c.world_size for c in cases} == {1, 2}
    assert {c.store for c in cases} == {"dram", "byte_scm", "block_scm", "flat"}
    assert {c.dtype for c in cases} == {"fp32", "fp16"}
    summary, failures = mc_report(run_mc(cases, tmp_path))
    assert not failures, "\n".join([summary, *failures])


@pytest.mark.slow
def test_ranks_agree_on_saving_a_resident_table_whole_in_an_incremental_checkpoint(
    tmp_path: Path,
) -> None:
    """Found by ``--sweep 500 --seed 70``: ``t0`` (FUSED, row-wise over two ranks, computed by
    the tiered kernel) changed on most rows of one rank's shard and few of the other's, so one
    rank saved it whole and the other its changed rows, and dcp refused the plan ("invalid
    fill"). The ranks now agree: whole on both."""
    case = SweepCase.from_line(json.dumps(CASE_RESIDENT_SAVED_WHOLE_ON_ONE_RANK))
    outcomes = run_spawned([case], tmp_path)
    assert len(outcomes) == 1
    _assert_all_exact(outcomes)


CASE_RESIDENT_SAVED_WHOLE_ON_ONE_RANK: dict[str, Any] = {
    "batch": 1,
    "block_layout": "flat",
    "dtype": "fp32",
    "kind": "ec",
    "loop": "torchrec",
    "max_ids": 1,
    "ops": ["train:1", "save:full", "train:2", "save:inc"],
    "optimizer": "sgd",
    "pooling": "sum",
    "seed": 70000512,
    "steps": 6,
    "tables": [
        {
            "cache": 0.0,
            "dim": 8,
            "features": ["f0"],
            "hot_rows": 0,
            "name": "t3",
            "placement": "fused",
            "policy": "lru",
            "rank": 0,
            "rows": 107,
            "sharding": "column_wise",
        },
        {
            "cache": 1.0,
            "dim": 8,
            "features": ["f1"],
            "hot_rows": 4,
            "name": "t4",
            "placement": "block_scm",
            "policy": "lru",
            "rank": 0,
            "rows": 409,
            "sharding": "column_wise",
        },
        {
            "cache": 1.0,
            "dim": 8,
            "features": ["f2", "f3"],
            "hot_rows": 0,
            "name": "t2",
            "placement": "byte_scm",
            "policy": "lru",
            "rank": 1,
            "rows": 4,
            "sharding": "row_wise",
        },
        {
            "cache": 0.782307207715952,
            "dim": 8,
            "features": ["f4"],
            "hot_rows": 10,
            "name": "t1",
            "placement": "fused",
            "policy": "lfu",
            "rank": 0,
            "rows": 63,
            "sharding": "row_wise",
        },
        {
            "cache": 0.0,
            "dim": 8,
            "features": ["f5", "f6", "f7"],
            "hot_rows": 2,
            "name": "t0",
            "placement": "fused",
            "policy": "lru",
            "rank": 1,
            "rows": 7,
            "sharding": "row_wise",
        },
        {
            "cache": 0.0,
            "dim": 8,
            "features": ["f8", "f4", "f9"],
            "hot_rows": 0,
            "name": "t5",
            "placement": "fused",
            "policy": "lfu",
            "rank": 0,
            "rows": 49648,
            "sharding": "table_wise",
        },
    ],
    "vbe": False,
    "weighted": False,
    "world_size": 2,
}
