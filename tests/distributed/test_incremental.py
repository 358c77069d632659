"""Incremental checkpoints of tiered tables: a full checkpoint, then ones holding only the rows
training changed; loading the chain equals the full state at that point, bitwise, for weights
and optimizer state, on every tier, at one and two ranks and across world sizes."""

from __future__ import annotations

import dataclasses
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from tests.distributed.test_checkpoint import (
    TIER_NAMES,
    _tables,
    assert_same,
    build,
    full_weights,
    train,
)
from torchrec_mtrains.distributed import checkpoint_load
from torchrec_mtrains.distributed.checkpoint_views import VIEW_DIR
from torchrec_mtrains.distributed.incremental import (
    changed_state_dict,
    clear_changes,
    deferred_views,
    full_state_dict,
    load_tier_checkpoint,
    track_changes,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.pipeline import tiered_groups
from torchrec_mtrains.tiers.log_block_scm import LogBlockSCMStore

ROWS = 3000


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """Every test here runs on one rank (the two-rank test spawns its own)."""


def _state(model: DistributedModelParallel) -> dict[str, Any]:
    return {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}


def _save(model: DistributedModelParallel, path: Path, incremental: bool) -> int:
    """Saves a full or an incremental checkpoint as the app does (log-structured tables
    streamed from their tiers); returns this rank's tiered rows saved."""
    groups = tiered_groups(model)
    with deferred_views(groups):
        state = _state(model)  # flushes the caches first
        saved = changed_state_dict(state, groups) if incremental else full_state_dict(state, groups)
        dcp.save(saved.state, checkpoint_id=path, planner=saved.planner)
    clear_changes(groups)
    return saved.rows


def _load_chain(model: DistributedModelParallel, chain: list[Path]) -> None:
    groups = tiered_groups(model)
    with deferred_views(groups):
        state = _state(model)
        for i, path in enumerate(chain):
            load_tier_checkpoint(state, path, groups, incremental=i > 0)
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


def _stats(model: DistributedModelParallel) -> dict[str, float]:
    (group,) = tiered_groups(model)
    (shard,) = group.shards
    return shard.store.stats.as_dict()


def test_a_log_table_is_saved_from_its_log_and_restored_by_appends(tmp_path: Path) -> None:
    """A full checkpoint streams a log-structured table's live rows in the log's order (never
    exporting its view's copy), and a restore appends whole rows without reading one back
    (only the log's compaction reads, to make room)."""
    src = build(tmp_path / "src", "log_block_scm", tables=_tables(ROWS), chunk_rows=512)
    train(src, 6, seed=1, rows=ROWS)
    (group,) = tiered_groups(src)
    before = _stats(src)
    rows = _save(src, tmp_path / "c1", incremental=False)
    read = _stats(src)["bytes_read"] - before["bytes_read"]
    store = group.shards[0].store
    assert rows == ROWS  # every row, once
    assert 0 < read <= store.file_data_bytes  # one sequential pass at most
    assert not group.views.is_current(0)  # the copy was never exported
    keys = set(dcp.FileSystemReader(str(tmp_path / "c1")).read_metadata().state_dict_metadata)
    assert any(k.startswith("tier_rows::") for k in keys)
    assert not any("big.weight" in k and not k.startswith("tier_rows::") for k in keys)
    expected = full_weights(src)

    dst = build(tmp_path / "dst", "log_block_scm", tables=_tables(ROWS), chunk_rows=512)
    before = _stats(dst)
    _load_chain(dst, [tmp_path / "c1"])
    after = _stats(dst)
    assert after["rows_read"] == before["rows_read"]  # whole rows: none read back
    assert after["rows_written"] - before["rows_written"] == ROWS
    # The initial rows, flushed, were forgotten before the load rather than pinned beside it.
    log = tiered_groups(dst)[0].shards[0].store.log_stats
    assert log.grown_segments == 0 and log.compacted_rows == 0
    assert_same(expected, full_weights(dst))
    train(src, 3, seed=4, rows=ROWS)
    train(dst, 3, seed=4, rows=ROWS)
    assert_same(full_weights(src), full_weights(dst))


def test_building_over_an_existing_log_exports_no_copy_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TorchRec's optimizer lists its state's keys when built: that must not export the view's
    copy of a log-structured table (a full extra pass over it at every start of a run)."""
    src = build(tmp_path / "t", "log_block_scm", tables=_tables(ROWS), chunk_rows=512)
    train(src, 2, seed=1, rows=ROWS)
    expected = full_weights(src)["embedding_bags.big.weight"]
    tiered_groups(src)[0].close()  # a tier file has one user at a time
    exports: list[str] = []
    original = LogBlockSCMStore.export_rows

    def counted(self: LogBlockSCMStore, *args: Any, **kwargs: Any) -> None:
        exports.append(self.table)
        original(self, *args, **kwargs)

    monkeypatch.setattr(LogBlockSCMStore, "export_rows", counted)
    again = build(
        tmp_path / "t", "log_block_scm", tables=_tables(ROWS), chunk_rows=512, open_mode="open"
    )
    assert not exports
    # The copy takes no disk until exported: a table's worth per run otherwise.
    (copy,) = (tmp_path / "t" / "block_scm" / "rank0" / VIEW_DIR).iterdir()
    table_bytes = tiered_groups(again)[0].shards[0].store.layout.total_bytes
    assert copy.stat().st_blocks * 512 < table_bytes / 10
    # The reopened table holds the trained rows; reading the state exports them, as it must.
    assert torch.equal(expected, full_weights(again)["embedding_bags.big.weight"])
    assert exports
    assert copy.stat().st_blocks * 512 >= table_bytes


def test_a_restore_selects_each_saved_batch_once_per_tiered_shard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiered table's tensors are hundreds of row chunks at scale; rows bound for its log are
    selected once per saved batch, not once per chunk (W2's restore spent ~20 minutes so)."""
    src = build(tmp_path / "src", "log_block_scm", tables=_tables(ROWS), chunk_rows=512)
    train(src, 2, seed=1, rows=ROWS)
    _save(src, tmp_path / "c1", incremental=False)
    calls: dict[int, int] = {}
    original = checkpoint_load._DirectRows.add

    def counted(self: Any, *args: Any, **kwargs: Any) -> None:
        calls[chunk] = calls.get(chunk, 0) + 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(checkpoint_load._DirectRows, "add", counted)
    for chunk in (64, 1024):  # 47 and 3 chunks of the table's tensors
        dst = build(
            tmp_path / f"dst{chunk}", "log_block_scm", tables=_tables(ROWS), chunk_rows=chunk
        )
        _load_chain(dst, [tmp_path / "c1"])
        assert_same(full_weights(src), full_weights(dst))
    assert calls[64] == calls[1024] > 0


def test_a_full_checkpoint_holds_one_batch_of_a_logs_rows_at_a_time(tmp_path: Path) -> None:
    """dcp's file writer keeps every tensor of a file referenced until the file closes: with a
    file per tensor (as the app writes checkpoints) a save holds about one batch of a log's rows
    in memory; with one file per rank it held them all.

    The rows a save holds are counted by the batches read from the log that are still alive
    (not by ``tracemalloc``: stopping it while other threads allocate crashes CPython before
    3.12, python/cpython#128679, and numba's compiled cache kernels allocate without the GIL)."""
    rows = 200_000
    src = build(tmp_path / "src", "log_block_scm", tables=_tables(rows), chunk_rows=4096)
    train(src, 2, seed=1, rows=rows)
    groups = tiered_groups(src)
    store = groups[0].shards[0].store
    # One segment per scan batch, so the table streams in many batches.
    passes = store.geometry.segment_bytes
    store.options = dataclasses.replace(store.options, max_pass_bytes=passes)
    batches = len(store.scan_batches())
    assert batches >= 8
    live = {"now": 0, "peak": 0}
    read = store.read_scan_batch

    def released() -> None:
        live["now"] -= 1

    def tracked_read(batch: Any) -> Any:
        ids, batch_rows = read(batch)
        live["now"] += 1
        live["peak"] = max(live["peak"], live["now"])
        weakref.finalize(batch_rows, released)
        return ids, batch_rows

    store.read_scan_batch = tracked_read
    peaks = {}
    for one_file_per_rank in (True, False):
        with deferred_views(groups):
            saved = full_state_dict(_state(src), groups)
            writer = dcp.FileSystemWriter(
                tmp_path / f"c_{one_file_per_rank}", single_file_per_rank=one_file_per_rank
            )
            live["peak"] = live["now"]
            dcp.save(saved.state, storage_writer=writer, planner=saved.planner)
            peaks[one_file_per_rank] = live["peak"]
            del saved, writer
        gc.collect()
    assert peaks[True] == batches, peaks  # every batch's rows at once
    assert peaks[False] <= 2, peaks  # the batch being written, and the one read last


@pytest.mark.parametrize(
    ("saved_on", "loaded_on"),
    [("log_block_scm", "block_scm"), ("block_scm", "log_block_scm"), ("log_block_scm", "dram")],
)
def test_a_chain_loads_across_layouts(tmp_path: Path, saved_on: str, loaded_on: str) -> None:
    src = build(tmp_path / "src", saved_on, tables=_tables(ROWS), chunk_rows=512)
    track_changes(tiered_groups(src))
    train(src, 4, seed=1, rows=ROWS)
    _save(src, tmp_path / "c1", incremental=False)
    train(src, 2, seed=2, rows=ROWS)
    _save(src, tmp_path / "c2", incremental=True)
    dst = build(tmp_path / "dst", loaded_on, tables=_tables(ROWS), chunk_rows=512)
    train(dst, 2, seed=9, rows=ROWS)
    _load_chain(dst, [tmp_path / "c1", tmp_path / "c2"])
    assert_same(full_weights(src), full_weights(dst))


def test_a_full_checkpoint_lacking_a_tensor_is_refused(tmp_path: Path) -> None:
    src = build(tmp_path / "src", "log_block_scm")
    groups = tiered_groups(src)
    with deferred_views(groups):
        saved = full_state_dict(_state(src), groups)
        del saved.state["model"]["embedding_bags.small.weight"]
        dcp.save(saved.state, checkpoint_id=tmp_path / "c1", planner=saved.planner)
    dst = build(tmp_path / "dst", "log_block_scm")
    with (
        deferred_views(tiered_groups(dst)),
        pytest.raises(ValueError, match=r"c1: holds no model\.embedding_bags\.small\.weight"),
    ):
        load_tier_checkpoint(_state(dst), tmp_path / "c1", tiered_groups(dst))


def test_a_resident_table_beside_tiered_ones_saves_only_its_changed_rows(tmp_path: Path) -> None:
    """The FUSED table the tiered kernel computes (``small``, 40 rows, ids < 40) is saved as
    the rows training looked up once few of them change, and the chain still loads exactly."""
    tables = [
        EmbeddingBagConfig(name="big", embedding_dim=8, num_embeddings=ROWS, feature_names=["f0"]),
        EmbeddingBagConfig(name="small", embedding_dim=64, num_embeddings=40, feature_names=["f1"]),
    ]
    src = build(tmp_path / "src", "log_block_scm", tables=tables)
    track_changes(tiered_groups(src))
    train(src, 3, seed=1, rows=ROWS)
    _save(src, tmp_path / "c1", incremental=False)
    (group,) = tiered_groups(src)
    (small,) = group.resident
    assert small.name == "small" and not small.changed.any()
    train(src, 1, seed=2, rows=ROWS)
    changed = int(small.changed.sum())
    assert 0 < changed <= 16
    _save(src, tmp_path / "c2", incremental=True)
    keys = set(dcp.FileSystemReader(str(tmp_path / "c2")).read_metadata().state_dict_metadata)
    assert not any(k.endswith("embedding_bags.small.weight") for k in keys)  # not whole
    saved_ids = [k for k in keys if "small.weight" in k and k.endswith("::ids")]
    assert saved_ids  # its changed rows, weights and optimizer state
    dst = build(tmp_path / "dst", "log_block_scm", tables=tables)
    train(dst, 2, seed=9, rows=ROWS)
    _load_chain(dst, [tmp_path / "c1", tmp_path / "c2"])
    assert_same(full_weights(src), full_weights(dst))
