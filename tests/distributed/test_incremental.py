"""Incremental checkpoints of tiered tables: a full checkpoint, then ones holding only the rows
training changed; loading the chain equals the full state at that point, bitwise, for weights
and optimizer state, on every tier, at one and two ranks and across world sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.distributed.model_parallel import DistributedModelParallel

from tests.distributed.test_checkpoint import (
    TIER_NAMES,
    _tables,
    assert_same,
    build,
    full_weights,
    train,
)
from torchrec_mtrains.distributed.incremental import (
    changed_state_dict,
    clear_changes,
    load_changed_state,
    track_changes,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.pipeline.stats import tiered_groups

ROWS = 3000


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """Every test here runs on one rank (the two-rank test spawns its own)."""


def _state(model: DistributedModelParallel) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def _save(model: DistributedModelParallel, path: Path, incremental: bool) -> int:
    """Saves a full or an incremental checkpoint; returns this rank's changed rows saved."""
    groups = tiered_groups(model)
    state = _state(model)  # flushes the caches first
    rows = 0
    if incremental:
        changed = changed_state_dict(state, groups)
        dcp.save(changed.state, checkpoint_id=path, planner=changed.planner)
        rows = changed.rows
    else:
        dcp.save(state, checkpoint_id=path)
    clear_changes(groups)
    return rows


def _load_chain(model: DistributedModelParallel, chain: list[Path]) -> None:
    state = _state(model)
    dcp.load(state, checkpoint_id=chain[0])
    for path in chain[1:]:
        load_changed_state(state, path)
    model.load_state_dict(state["model"])
    model.fused_optimizer.load_state_dict(state["optim"])


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


@pytest.mark.parametrize("tier", TIER_NAMES)
@pytest.mark.parametrize("optimizer", [OptimType.EXACT_SGD, OptimType.EXACT_ROWWISE_ADAGRAD])
def test_chain_loads_as_a_full_copy(tmp_path: Path, tier: str, optimizer: OptimType) -> None:
    # 3000 rows; 2-3 steps of at most 16 ids each between checkpoints: most rows unchanged.
    src = build(tmp_path / "src", tier, optimizer=optimizer, tables=_tables(ROWS), chunk_rows=1024)
    track_changes(tiered_groups(src))
    train(src, 5, seed=1, rows=ROWS)
    _save(src, tmp_path / "c1", incremental=False)
    train(src, 3, seed=2, rows=ROWS)
    assert 0 < _save(src, tmp_path / "c2", incremental=True) <= 3 * 8 * 2
    train(src, 2, seed=3, rows=ROWS)
    assert 0 < _save(src, tmp_path / "c3", incremental=True) <= 2 * 8 * 2
    expected = full_weights(src)
    assert _bytes(tmp_path / "c2") < _bytes(tmp_path / "c1") / 4

    dst = build(tmp_path / "dst", tier, optimizer=optimizer, tables=_tables(ROWS))
    train(dst, 2, seed=9, rows=ROWS)  # other values and a warm cache, all to be overwritten
    _load_chain(dst, [tmp_path / "c1", tmp_path / "c2", tmp_path / "c3"])
    assert_same(expected, full_weights(dst))
    # Both continue identically: nothing stale in the destination's cache.
    train(src, 3, seed=4, rows=ROWS)
    train(dst, 3, seed=4, rows=ROWS)
    assert_same(full_weights(src), full_weights(dst))


def test_a_chain_without_its_last_increment_is_the_earlier_state(tmp_path: Path) -> None:
    src = build(tmp_path / "src", "block_scm")
    track_changes(tiered_groups(src))
    train(src, 4, seed=1)
    _save(src, tmp_path / "c1", incremental=False)
    train(src, 2, seed=2)
    _save(src, tmp_path / "c2", incremental=True)
    at_c2 = full_weights(src)
    train(src, 2, seed=3)
    _save(src, tmp_path / "c3", incremental=True)
    dst = build(tmp_path / "dst", "block_scm")
    _load_chain(dst, [tmp_path / "c1", tmp_path / "c2"])
    assert_same(at_c2, full_weights(dst))


def test_untracked_tables_are_named(tmp_path: Path) -> None:
    src = build(tmp_path / "src", "dram")
    train(src, 1, seed=1)
    with pytest.raises(ValueError, match=r"table 'big': its changed rows are not tracked"):
        changed_state_dict(_state(src), tiered_groups(src))


def _ws2_worker(rank: int, port: int, root: str) -> None:
    with process_group(backend="gloo", rank=rank, world_size=2, port=port):
        for big_plan in ("tw", "cw"):
            base = Path(root) / big_plan
            src = build(base / "src", "block_scm", world_size=2, big_plan=big_plan)
            track_changes(tiered_groups(src))
            train(src, 4, seed=10 + rank)
            _save(src, base / "c1", incremental=False)
            train(src, 3, seed=20 + rank)
            _save(src, base / "c2", incremental=True)
            dst = build(base / "dst", "block_scm", world_size=2, big_plan=big_plan)
            train(dst, 2, seed=30 + rank)
            _load_chain(dst, [base / "c1", base / "c2"])
            assert_same(full_weights(src), full_weights(dst))


@pytest.mark.slow
def test_world_size_two(tmp_path: Path) -> None:
    """Table-wise and column-wise at two ranks: the increments' rows come from both ranks."""
    mp.spawn(_ws2_worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
