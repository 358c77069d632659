"""The look-ahead train pipeline: bitwise the plain loop (world size 1 and 2), rows in flight
resident and never stale, per-step numbers, worker errors and Ctrl-C shut it down cleanly."""

from __future__ import annotations

import gc
import re
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lookahead_harness import (
    ROWS,
    Case,
    batches,
    build,
    differences,
    full_state,
    groups_of,
    io_threads,
    make_batch,
    make_optimizer,
    on_worker_reads,
    restore_reads,
    run_case,
    spawn_cases,
    train_pipelined,
    train_plain,
)
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_mtrains
from tests.torchrec_releases import BUCKETED_ROW_WISE
from torchrec_mtrains.distributed.id_bounds import OutOfRangeIdError
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup
from torchrec_mtrains.pipeline import LookaheadTrainPipeline, StepStats


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """Every in-process test here runs on one rank."""


@pytest.fixture(autouse=True)
def _one_thread(one_thread: None) -> None:
    """Every test here runs on one intra-op thread."""


def big_group(model: DistributedModelParallel) -> TieredTableGroup:
    (group,) = [g for g in groups_of(model) if g.shards[0].name == "big"]
    return group


def tier_rows(model: DistributedModelParallel) -> dict[str, np.ndarray[Any, Any]]:
    """Every tiered table's rows (weights and optimizer state) as they are on its tier."""
    out = {}
    for group in groups_of(model):
        for i, shard in enumerate(group.shards):
            out[shard.name] = shard.store.layout.decode(group.views.tier_rows(i)).copy()
    return out


def assert_same_tiers(a: DistributedModelParallel, b: DistributedModelParallel) -> None:
    rows_a, rows_b = tier_rows(a), tier_rows(b)
    assert rows_a.keys() == rows_b.keys() == {"big", "mid"}
    for name in rows_a:
        assert np.array_equal(rows_a[name], rows_b[name]), name


# ------------------------------------------------------------------------- determinism


@pytest.mark.parametrize(
    "case",
    [
        Case(big_tier="block_scm", mid_tier="byte_scm", depth=1, optimizer="keyed"),
        Case(big_tier="byte_scm", mid_tier="block_scm", depth=3, optimizer="torch", seed=1),
        # "big" virtual: rows made and evicted on the worker while batches are in flight
        Case(depth=3, optimizer="keyed", steps=24, virtual=True),
    ],
    ids=lambda c: c.id,
)
def test_pipelined_run_is_bitwise_the_plain_run(tmp_path: Path, case: Case) -> None:
    result = run_case(case, rank=0, world_size=1, root=tmp_path)
    assert result.diffs == {}
    assert result.losses_equal
    assert result.changed >= 8  # tables, dense and over arch all trained
    # Every forward of every tiered kernel was served by a prefetch, none planned late. Both
    # tiered tables share one kernel table-wise; row-wise "big" is in a lookup of its own.
    assert result.prefetched == (1 if case.sharding == "tw" else 2) * case.steps
    assert result.unprefetched == 0
    assert result.rows_fetched > 0
    assert result.io_threads == []


def test_an_evaluation_through_the_pipeline_leaves_virtual_tables_as_training_left_them(
    tmp_path: Path,
) -> None:
    """The model in eval mode through the look-ahead pipeline, unseen ids repeated across the
    queued batches: the plain loop's outputs, and the virtual table's rows, statistics and
    state as training left them; training then goes on as in a run that never evaluated."""
    case = Case(depth=3, optimizer="keyed", steps=12, virtual=True)
    data = batches(case, 0)
    evaluation = [make_batch(9, 0, s) for s in (0, 1, 0, 2, 1, 0)]
    names = ("never", "pipelined", "plain")
    models = {name: build(case, tmp_path / name) for name in names}
    optims = {name: make_optimizer(case, model) for name, model in models.items()}
    for name in names:
        train_pipelined(models[name], optims[name], data[:6], case.depth)
    before = {name: full_state(models[name], optims[name]) for name in names}

    def provisional(model: DistributedModelParallel) -> int:
        return sum(
            len(s.virtual.provisional)
            for g in groups_of(model)
            for s in g.shards
            if s.virtual is not None
        )

    held = []
    for name in ("pipelined", "plain"):
        models[name].eval()
    with torch.no_grad():
        expected = [models["plain"](b)[1][1] for b in evaluation]
        pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
            models["pipelined"], optims["pipelined"], torch.device("cpu"), lookahead=case.depth
        )
        it, got = iter(evaluation), []
        with pytest.raises(StopIteration):
            while True:
                got.append(pipeline.progress(it)[1])
                held.append(provisional(models["pipelined"]))
    assert max(held) > 0  # the unseen ids had provisional rows while the batches ran
    assert len(got) == len(expected)
    for a, b in zip(expected, got):
        assert torch.equal(a, b)
    for name in ("pipelined", "plain"):
        models[name].train()
        assert differences(before["never"], full_state(models[name], optims[name])) == {}, name
    for name in names:
        train_pipelined(models[name], optims[name], data[6:], case.depth)
    assert provisional(models["pipelined"]) == provisional(models["plain"]) == 0
    after = full_state(models["never"], optims["never"])
    for name in ("pipelined", "plain"):
        assert differences(after, full_state(models[name], optims[name])) == {}, name


def test_restart_with_a_new_iterator_continues_the_same_run(tmp_path: Path) -> None:
    case = Case(depth=2, steps=14)
    data = batches(case, 0)
    plain = build(case, tmp_path / "plain")
    plain_opt = make_optimizer(case, plain)
    train_plain(plain, plain_opt, data)
    ahead = build(case, tmp_path / "ahead")
    ahead_opt = make_optimizer(case, ahead)
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        ahead, ahead_opt, torch.device("cpu"), lookahead=2
    )
    for part in (data[:5], data[5:]):
        it = iter(part)
        with pytest.raises(StopIteration):
            while True:
                pipeline.progress(it)
        # Stopped: worker gone, the model's own forward back (usable directly).
        assert io_threads() == []
        assert not any(g.background_io for g in groups_of(ahead))
    assert pipeline.totals.steps == 14
    assert differences(full_state(plain, plain_opt), full_state(ahead, ahead_opt)) == {}


def test_one_process_runs_no_splits_exchange_and_reattaching_keeps_it_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over one process the input dists hand each batch on as TorchRec's own forward does; the
    pipeline's fused splits exchange (an identity there) is not run as a collective, on the
    first batch or after a detach and attach, and the run stays the plain one bit for bit."""
    case = Case(depth=2, steps=10)
    data = batches(case, 0)
    plain = build(case, tmp_path / "plain")
    plain_opt = make_optimizer(case, plain)
    train_plain(plain, plain_opt, data)
    exchanges: list[int] = []
    all_to_all_single = torch.distributed.all_to_all_single

    def counted(*args: Any, **kwargs: Any) -> Any:
        exchanges.append(1)
        return all_to_all_single(*args, **kwargs)

    monkeypatch.setattr(torch.distributed, "all_to_all_single", counted)
    ahead = build(case, tmp_path / "ahead")
    ahead_opt = make_optimizer(case, ahead)
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        ahead, ahead_opt, torch.device("cpu"), lookahead=2
    )
    it = iter(data)
    with pipeline:
        for _ in range(4):
            pipeline.progress(it)
        pipeline.detach()
        pipeline.attach()  # batches in flight: TorchRec rewrites the model again
        with pytest.raises(StopIteration):
            while True:
                pipeline.progress(it)
    assert pipeline.totals.steps == case.steps
    assert exchanges == []
    assert differences(full_state(plain, plain_opt), full_state(ahead, ahead_opt)) == {}

    # The counter sees the exchange where it runs: the fused one, as TorchRec's pipeline has it.
    fused = build(case, tmp_path / "fused")
    fused_opt = make_optimizer(case, fused)
    monkeypatch.setattr(
        LookaheadTrainPipeline, "_pipeline_model", TrainPipelineSparseDist._pipeline_model
    )
    train_pipelined(fused, fused_opt, data[:3], depth=2)
    assert exchanges


@pytest.mark.slow
def test_world_size_two_is_bitwise_the_plain_run(tmp_path: Path) -> None:
    cases = [
        Case(depth=2, optimizer="keyed", sharding="rw", steps=12),
        Case(
            big_tier="byte_scm",
            mid_tier="block_scm",
            depth=1,
            optimizer="torch",
            sharding="tw",
            steps=12,
            seed=3,
        ),
        Case(depth=2, optimizer="keyed", sharding="rw", steps=12, virtual=True),
    ]
    if not BUCKETED_ROW_WISE:  # TorchRec before 1.8: no bucketized row-wise plan
        cases = [c for c in cases if not c.virtual]
    per_rank = spawn_cases(cases, world_size=2, root=tmp_path)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(cases), results[-1].get("error")
        for case, result in zip(cases, results):
            assert result["error"] is None, result["error"]
            where = f"rank {rank} {case.id}"
            assert result["diffs"] == {}, where
            assert result["losses_equal"], where
            assert result["changed"] > 0, where
            assert result["unprefetched"] == 0, where
            assert result["io_threads"] == [], where
    # Row-wise "big" has a shard (and a kernel) on each rank; table-wise tiered tables live on
    # rank 1, in one kernel.
    assert per_rank[0][0]["prefetched"] == 12
    assert per_rank[1][0]["prefetched"] == 24
    assert per_rank[1][1]["prefetched"] == 12
    assert per_rank[0][1]["prefetched"] == 0


# --------------------------------------------------------------- residency and staleness


class RecordingStore:
    """Wraps a store's row I/O: keeps the last value written for each row, checks every read
    of such a row returns it, and slows writes (longer than a step) so that I/O queues up and
    a read could overtake the write-back of its row if the worker did not keep order."""

    def __init__(self, store: Any, write_delay: float) -> None:
        self.store = store
        self.write = store.write_rows
        self.delay = write_delay
        self.written: dict[int, np.ndarray[Any, Any]] = {}
        self.writes = self.rereads = self.overlaps = 0
        self.stale: list[int] = []
        self._active = 0
        self._lock = threading.Lock()
        self.write_from = store.write_rows_from
        store.write_rows = self.write_rows
        store.write_rows_from = self.write_rows_from
        on_worker_reads(store, self._read_starts, self._read_done)

    def _enter(self) -> None:
        """Counts I/O calls that run while another is running: one FIFO worker has none."""
        with self._lock:
            self._active += 1
            self.overlaps += self._active > 1

    def _leave(self) -> None:
        with self._lock:
            self._active -= 1

    def write_rows(
        self,
        ids: np.ndarray[Any, Any],
        rows: np.ndarray[Any, Any],
        then: Callable[[], Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        # Noted before the write lands, so a read overtaking it shows up as stale.
        for i, row in zip(ids.tolist(), rows):
            self.written[i] = row.copy()
        self._enter()
        try:
            self.writes += 1
            time.sleep(self.delay)
            return then() if then is not None else self.write(ids, rows, **kwargs)
        finally:
            self._leave()

    def write_rows_from(
        self, ids: np.ndarray[Any, Any], columns: Any, at: np.ndarray[Any, Any], **kwargs: Any
    ) -> Any:
        """The worker's write-backs from host slots: recorded as :meth:`write_rows` is."""
        rows = np.concatenate([c[at] for c in columns], axis=1)
        return self.write_rows(ids, rows, then=lambda: self.write_from(ids, columns, at, **kwargs))

    def _read_starts(self, ids: np.ndarray[Any, Any]) -> None:
        self._enter()

    def _read_done(self, ids: np.ndarray[Any, Any], rows: np.ndarray[Any, Any]) -> None:
        self._leave()
        for i, row in zip(ids.tolist(), rows):
            if i in self.written:
                self.rereads += 1
                if not np.array_equal(row, self.written[i]):
                    self.stale.append(i)


def check_in_flight(pipeline: LookaheadTrainPipeline[Batch, Any], depth: int) -> int:
    """After a step: every batch still to run (prefetched) and the one just run have their rows
    at their planned slots, and the prefetched ones are held. Returns the batches checked."""
    checked = 0
    for group in pipeline.groups:
        queued = list(group._pending)
        assert len(queued) <= depth
        in_flight = [group._in_flight] if group._in_flight is not None else []
        for batch in queued + in_flight:
            is_queued = any(batch is q for q in queued)
            for shard, plan, features in zip(group.shards, batch.plans, batch.per_table):
                ids = torch.cat([batch.segments[f] for f in features])
                assert torch.equal(shard.cache.slot_to_id[plan.slots], torch.unique(ids))
                if is_queued:
                    assert bool((shard.cache.holds[plan.slots] > 0).all())
            checked += 1
    return checked


def test_rows_in_flight_stay_resident_and_are_never_read_stale(tmp_path: Path) -> None:
    case = Case(depth=3, steps=30, seed=2)
    data = batches(case, 0)
    plain = build(case, tmp_path / "plain")
    plain_opt = make_optimizer(case, plain)
    train_plain(plain, plain_opt, data)

    ahead = build(case, tmp_path / "ahead")
    ahead_opt = make_optimizer(case, ahead)
    recorder = RecordingStore(big_group(ahead).shards[0].store, write_delay=0.02)
    checked: list[int] = []
    train_pipelined(
        ahead, ahead_opt, data, depth=3, on_step=lambda p: checked.append(check_in_flight(p, 3))
    )
    assert sum(checked) >= 3 * len(data)  # batches ahead were really queued
    stats = big_group(ahead).shards[0].cache.stats
    assert stats.evictions > 100 and stats.writebacks > 50
    assert recorder.writes > 10
    assert recorder.rereads > 20  # rows written back were read again ...
    assert recorder.stale == []  # ... and always with their written value,
    assert recorder.overlaps == 0  # as reads never overtake write-backs (one ordered worker)
    assert differences(full_state(plain, plain_opt), full_state(ahead, ahead_opt)) == {}


# ------------------------------------------------------------------------ per-step numbers


def slow_store(group: TieredTableGroup, delay: float, table: str = "big") -> None:
    """Makes every read of ``table``'s tier take ``delay`` seconds more (sleep: no GIL)."""
    for shard in group.shards:
        if shard.name != table:
            continue
        on_worker_reads(shard.store, lambda ids: time.sleep(delay))


def slow_compute(model: DistributedModelParallel, delay: float) -> None:
    model.module.model.over_arch.register_forward_hook(lambda *_: time.sleep(delay))


def test_per_step_numbers_show_the_io_hidden(tmp_path: Path) -> None:
    case = Case(depth=2, steps=10, seed=4)
    data = batches(case, 0)

    plain = build(case, tmp_path / "plain")
    slow_store(big_group(plain), 0.03)
    slow_compute(plain, 0.04)
    before = big_group(plain).io_counters()
    train_plain(plain, make_optimizer(case, plain), data)
    plain_io = big_group(plain).io_counters() - before
    # Without look-ahead every row read is on the training thread's path.
    assert plain_io.stall_seconds >= plain_io.io_seconds >= 0.03 * case.steps

    ahead = build(case, tmp_path / "ahead")
    group = big_group(ahead)
    slow_store(group, 0.03)
    slow_compute(ahead, 0.04)
    reads_before = sum(shard.store.stats.rows_read for shard in group.shards)
    steps: list[StepStats] = []
    _, pipeline = train_pipelined(
        ahead,
        make_optimizer(case, ahead),
        data,
        depth=2,
        on_step=lambda p: steps.append(p.last_step),
    )
    totals = pipeline.totals
    assert len(steps) == totals.steps == case.steps
    assert sum(s.rows_fetched for s in steps) == totals.rows_fetched
    assert sum(s.seconds for s in steps) == pytest.approx(totals.seconds)
    assert sum(s.stall_seconds for s in steps) == pytest.approx(totals.stall_seconds)
    # Rows fetched counts both tiered tables (one kernel): their tiers' reads.
    ahead_io = group.io_counters()
    reads = sum(shard.store.stats.rows_read for shard in group.shards) - reads_before
    assert ahead_io.rows_fetched == reads
    assert 0 < totals.hit_rate < 1
    assert all(0 <= s.hit_rate <= 1 and s.seconds > 0 for s in steps)
    # The reads (0.03 s a batch) hide behind 0.04 s of compute: little stall left, most of it
    # the first step's (nothing ran before it to hide its rows' read).
    assert totals.prefetch_io_seconds >= 0.03 * case.steps
    assert totals.stall_seconds < 0.3 * totals.prefetch_io_seconds
    # (The first step's stall is ~5% of the run; the rest is scheduling noise on a busy host.)
    assert totals.stall_share < 0.15
    assert steps[0].stall_seconds > 0.005


@pytest.mark.parametrize("freeze", [True, False])
def test_the_collector_skips_the_model_while_training_and_not_after(
    tmp_path: Path, freeze: bool
) -> None:
    """The objects that exist when training starts are frozen (``gc.freeze``) until the
    pipeline closes, unless asked not to; training is the same either way."""
    case = Case(depth=2, steps=6)
    model = build(case, tmp_path / "m")
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        model, make_optimizer(case, model), torch.device("cpu"), lookahead=2, freeze_gc=freeze
    )
    assert gc.get_freeze_count() == 0
    frozen = []
    it = iter(batches(case, 0))
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(it)
            frozen.append(gc.get_freeze_count())
    assert all(count > 0 for count in frozen) if freeze else frozen == [0] * 6
    assert gc.get_freeze_count() == 0


def test_lookahead_must_be_a_positive_int(tmp_path: Path) -> None:
    model = build(Case(), tmp_path)
    optimizer = make_optimizer(Case(), model)
    bad: Any
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="lookahead="):
            LookaheadTrainPipeline(model, optimizer, torch.device("cpu"), lookahead=bad)


# ---------------------------------------------------------------------- errors, Ctrl-C


def failing_read(ids: Any) -> Any:
    raise OSError(5, "Input/output error (injected)")


def run_until_error(
    pipeline: LookaheadTrainPipeline[Batch, Any], data: Iterator[Batch]
) -> tuple[int, pytest.ExceptionInfo[BaseException]]:
    done = 0
    with pytest.raises(BaseException) as info:
        while True:
            pipeline.progress(data)
            done += 1
    return done, info


def assert_clean_shutdown(model: DistributedModelParallel) -> None:
    assert io_threads() == []
    for group in groups_of(model):
        assert not group.background_io
        assert not group._pending
        for shard in group.shards:
            # Nothing held but the batch whose forward ran last (released by the next one).
            in_flight = group._in_flight
            held = int(shard.cache.holds.sum())
            assert held == 0 or in_flight is not None


def finish_plainly_and_compare(
    tmp_path: Path,
    case: Case,
    model: DistributedModelParallel,
    optimizer: torch.optim.Optimizer,
    data: list[Batch],
    done: int,
) -> None:
    """``model`` stopped after ``done`` batches: its tiers must hold exactly what the plain
    loop's do after ``done`` batches (all flushed, nothing half written), and training the rest
    plainly must end bitwise where the plain run of all batches ends."""
    ref = build(case, tmp_path / "ref")
    ref_opt = make_optimizer(case, ref)
    train_plain(ref, ref_opt, data[:done])
    for group in groups_of(ref):
        group.flush()
    assert_same_tiers(ref, model)
    train_plain(ref, ref_opt, data[done:])
    train_plain(model, optimizer, data[done:])
    assert differences(full_state(ref, ref_opt), full_state(model, optimizer)) == {}


def test_worker_error_surfaces_with_its_traceback_and_shuts_down(tmp_path: Path) -> None:
    case = Case(depth=2, steps=12, seed=5)
    data = batches(case, 0)
    model = build(case, tmp_path / "ahead")
    optimizer = make_optimizer(case, model)
    store = big_group(model).shards[0].store
    calls = 0

    def read(ids: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 6:
            failing_read(ids)

    on_worker_reads(store, read)
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        model, optimizer, torch.device("cpu"), lookahead=2
    )
    done, info = run_until_error(pipeline, iter(data))
    assert info.type is OSError and "injected" in str(info.value)
    assert any(entry.name == "failing_read" for entry in info.traceback)
    assert 3 <= done < case.steps
    assert_clean_shutdown(model)
    restore_reads(store)
    finish_plainly_and_compare(tmp_path, case, model, optimizer, data, done)


def with_bad_id(batch: Batch, row_id: int) -> Batch:
    """``batch`` with its first id (feature ``f_big``) replaced by ``row_id``."""
    sparse = batch.sparse_features
    values = sparse.values().clone()
    values[0] = row_id
    features = KeyedJaggedTensor(keys=sparse.keys(), values=values, lengths=sparse.lengths())
    return Batch(batch.dense_features, features, batch.labels)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_ids_are_checked_on_the_host_and_a_bad_one_still_stops_in_its_module(
    tmp_path: Path, device: str
) -> None:
    """The pipeline checks each batch's ids before copying it to the device: the sharded
    module lets the good ones in on that word (on a GPU its own check would wait for the
    device). The batch with an id past ``big`` is not vouched for: the module checks it and
    raises, naming the table, when the batch is input-distributed (``k`` steps ahead), with
    nothing of it written: the tiers hold what the plain loop's hold after the same batches."""
    case = Case(depth=2, steps=10)
    data = batches(case, 0)
    bad = 5
    fed = [*data[:bad], with_bad_id(data[bad], ROWS["big"]), *data[bad + 1 :]]
    target = torch.device(device, torch.cuda.current_device()) if device == "cuda" else None
    model = build(case, tmp_path / "ahead", device=target)
    optimizer = make_optimizer(case, model)
    (check,) = [m.id_bounds_check() for m in model.modules() if hasattr(m, "id_bounds_check")]
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        model, optimizer, target or torch.device("cpu"), lookahead=case.depth
    )
    done, info = run_until_error(pipeline, iter(fed))
    assert info.type is OutOfRangeIdError, info
    assert re.search(rf"table 'big': row id {ROWS['big']} \(feature 'f_big'\)", str(info.value))
    assert done == bad - case.depth
    assert (check.vouched_batches, check.checked_batches) == (bad, 1)
    assert_clean_shutdown(model)
    if target is None:
        finish_plainly_and_compare(tmp_path, case, model, optimizer, data, done)


class Interrupt:
    """Raises KeyboardInterrupt (as Ctrl-C would) at the ``at``-th call, noting whether tier
    I/O was still queued or running at that moment."""

    def __init__(self, at: int, model: DistributedModelParallel) -> None:
        self.at, self.calls, self.model = at, 0, model
        self.io_in_flight = False

    def __call__(self, *_: Any) -> None:
        self.calls += 1
        if self.calls == self.at:
            self.io_in_flight = any(
                b.io is not None and not b.io.done()
                for g in groups_of(self.model)
                for b in g._pending
            )
            raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["data_iterator", "forward_hook"])
def test_ctrl_c_stops_the_worker_and_leaves_the_tiers_flushed(tmp_path: Path, where: str) -> None:
    case = Case(depth=3, steps=14, seed=6)
    data = batches(case, 0)
    model = build(case, tmp_path / "ahead")
    optimizer = make_optimizer(case, model)
    slow_store(big_group(model), 0.02)  # keep the worker busy when the interrupt comes
    interrupt = Interrupt(at=8, model=model)
    if where == "data_iterator":

        def source() -> Iterator[Batch]:
            for batch in data:
                interrupt()
                yield batch

        it: Iterator[Batch] = source()
    else:
        hook = model.module.model.dense_arch.register_forward_pre_hook(interrupt)
        it = iter(data)
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        model, optimizer, torch.device("cpu"), lookahead=3
    )
    done, info = run_until_error(pipeline, it)
    assert info.type is KeyboardInterrupt
    assert interrupt.io_in_flight
    # The 8th batch read is batch 7, read after the forward of batch 7 - 3; the 8th forward is
    # batch 7's. Either way the steps before it completed.
    assert done == (4 if where == "data_iterator" else 7)
    assert_clean_shutdown(model)
    if where == "forward_hook":
        hook.remove()
    for group in groups_of(model):
        for shard in group.shards:
            restore_reads(shard.store)
    finish_plainly_and_compare(tmp_path, case, model, optimizer, data, done)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize(
    "case",
    [
        Case(big_tier="block_scm", mid_tier="byte_scm", depth=2, optimizer="keyed", steps=16),
        Case(big_tier="byte_scm", mid_tier="block_scm", depth=3, optimizer="torch", steps=16),
    ],
    ids=lambda c: c.id,
)
def test_lookahead_pipeline_on_cuda_matches_the_plain_loop(tmp_path: Path, case: Case) -> None:
    """Our pipeline on CUDA: batches copied and input-distributed on TorchRec's side streams,
    rows copied into the HBM caches on the tier worker's stream k batches ahead; the result
    is the plain loop's."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    data = batches(case, 0)
    plain = build(case, tmp_path / "plain", device=cuda)
    plain_opt = make_optimizer(case, plain)
    plain_losses = train_plain(plain, plain_opt, [b.to(cuda) for b in data])

    model = build(case, tmp_path / "ahead", device=cuda)
    optimizer = make_optimizer(case, model)
    losses, pipeline = train_pipelined(model, optimizer, data, case.depth, device=cuda)
    assert len(losses) == case.steps
    assert pipeline.totals.steps == case.steps
    counters = [g.io_counters() for g in groups_of(model)]
    assert sum(c.unprefetched_batches for c in counters) == 0
    assert all(g.device.type == "cuda" for g in groups_of(model))
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(plain_losses), rtol=1e-5, atol=1e-6
    )
    a, b = full_state(plain, plain_opt), full_state(model, optimizer)
    for key in a:
        torch.testing.assert_close(a[key].cpu(), b[key].cpu(), rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.cuda
def test_tiered_kernel_runs_in_torchrec_prefetch_pipeline(tmp_path: Path) -> None:
    """On CUDA, TorchRec's own PrefetchTrainPipelineSparseDist drives the tiered kernels'
    prefetch through the grouped lookups; training matches the plain loop."""
    from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist

    cuda = torch.device("cuda", torch.cuda.current_device())
    case = Case(depth=1, steps=12)
    data = batches(case, 0)
    plain = build(case, tmp_path / "plain", device=cuda)
    plain_opt = make_optimizer(case, plain)
    train_plain(plain, plain_opt, [b.to(cuda) for b in data])

    model = build(case, tmp_path / "ahead", device=cuda)
    optimizer = make_optimizer(case, model)
    for group in groups_of(model):
        group.background_io = True
    pipeline = PrefetchTrainPipelineSparseDist(model, optimizer, cuda)
    it = iter(data)
    with pytest.raises(StopIteration):
        while True:
            pipeline.progress(it)
    counters = [g.io_counters() for g in groups_of(model)]
    assert sum(c.prefetched_batches for c in counters) == case.steps  # one tiered kernel
    assert sum(c.unprefetched_batches for c in counters) == 0
    for group in groups_of(model):
        group.stop_background_io()
    a, b = full_state(plain, plain_opt), full_state(model, optimizer)
    for key in a:
        torch.testing.assert_close(a[key].cpu(), b[key].cpu(), rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_prefetch_and_remap_on_cuda_never_block_the_host(tmp_path: Path, device: str) -> None:
    """The tiered kernel's part of a look-ahead step on CUDA runs without a host sync: a
    prefetched batch's ids reach the host by an asynchronous copy the tier worker waits for,
    the worker's row copies wait on events of their own, and the forward's slot ids come from
    pinned memory. torch's sync debug mode (process-wide) makes any synchronizing CUDA call an
    error, on the training thread and on the worker alike. (On the CPU: the same calls give
    the same slots.)"""
    on_cuda = device == "cuda"
    cuda = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    case = Case(depth=2, steps=12)
    model = build(case, tmp_path, device=cuda)
    group = big_group(model)
    group.background_io = True
    g = torch.Generator().manual_seed(0)

    def ids() -> torch.Tensor:
        parts = []
        for table in group.feature_table_map:  # -1: a feature of a resident table
            rows = group.shards[table].local_rows if table >= 0 else 1
            parts.append(torch.randint(0, rows, (16,), generator=g))
        return torch.cat(parts).to(cuda)

    lengths = [16] * len(group.feature_table_map)
    data = [ids() for _ in range(case.steps)]
    slots = []
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
    try:
        for values in data[: case.depth]:
            group.prefetch(values, lengths)
        for i, values in enumerate(data):
            slots.append(group.remap(values, lengths, train=True))
            if i + case.depth < len(data):
                group.prefetch(data[i + case.depth], lengths)
    finally:
        if on_cuda:
            torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
    counters = group.io_counters()
    assert counters.prefetched_batches == case.steps and counters.unprefetched_batches == 0
    # The last batch's rows are held: each id of a tiered table went to its row's slot.
    last, got = data[-1].cpu(), slots[-1].cpu()
    start = 0
    for table in group.feature_table_map:
        if table >= 0:
            want = group.shards[table].cache.lookup(last[start : start + 16])
            assert torch.equal(got[start : start + 16], want.to(got.dtype))
        start += 16
    group.stop_background_io()


@pytest.mark.cuda
def test_a_lookahead_step_on_cuda_never_syncs_the_host_in_this_projects_code(
    tmp_path: Path,
) -> None:
    """Whole steps of the look-ahead pipeline under sync debug mode ``warn``: no synchronizing
    call is left in this project's code (the bounds check reads ids on the host, before the
    copy); TorchRec's own are listed. A sync made here on purpose must be seen, which shows
    the warnings name where they happen."""
    import warnings

    cuda = torch.device("cuda", torch.cuda.current_device())
    case = Case(depth=2, steps=10)
    model = build(case, tmp_path, device=cuda)
    optimizer = make_optimizer(case, model)
    (check,) = [m.id_bounds_check() for m in model.modules() if hasattr(m, "id_bounds_check")]
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        model, optimizer, cuda, lookahead=case.depth
    )
    it = iter(batches(case, 0))
    for _ in range(3):  # warm up: tracing, first allocations, the worker's start
        pipeline.progress(it)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(4):
                pipeline.progress(it)
            torch.ones(1, device=cuda).item()  # the control: a sync in this file
        finally:
            torch.cuda.set_sync_debug_mode("default")
    pipeline.close()
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = sorted({f"{w.filename}:{w.lineno}" for w in syncs})
    assert any(w.startswith(__file__) for w in where), where
    package = str(Path(torchrec_mtrains.__file__).parent)
    ours = [w for w in where if w.startswith(package)]
    assert ours == [], where
    assert check.checked_batches == 0 and check.vouched_batches == 3 + 4 + case.depth


@pytest.mark.cuda
def test_an_id_out_of_range_on_cuda_raises_in_its_batchs_forward(tmp_path: Path) -> None:
    """On CUDA the worker checks a prefetched batch's ids once they reach the host: an id past
    its table raises in that batch's forward (remap), naming the table, and nothing of the
    batch was planned."""
    from torchrec_mtrains.distributed.tiered_tables import TableIdError

    cuda = torch.device("cuda", torch.cuda.current_device())
    model = build(Case(depth=1, steps=2), tmp_path, device=cuda)
    group = big_group(model)
    group.background_io = True
    rows = group.shards[0].local_rows
    first = list(group.feature_table_map).index(0)  # the first feature of table big
    lengths = [int(f == first) for f in range(len(group.feature_table_map))]
    values = torch.tensor([rows + 5], device=cuda)
    group.prefetch(values, lengths)  # returns at once: the ids are still on their way
    with pytest.raises(TableIdError, match=rf"table 'big'.*row id {rows + 5}\b"):
        group.remap(values, lengths, train=True)
    assert int(group.shards[0].cache.holds.sum()) == 0
    group.stop_background_io()
