"""Look-ahead prefetch, hot-row pinning and in-flight rows of the tiered kernel."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import _process_group, assert_same, build, full_weights  # noqa: F401
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.cache.table_cache import CacheTooSmallError
from torchrec_mtrains.distributed import tiered_tables
from torchrec_mtrains.distributed.tiered_tables import TableIdError, TieredTableGroup

ROWS = 300


def batches(seed: int, count: int) -> list[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, 3, (2 * 8,), generator=g)
        n0, n1 = int(lengths[:8].sum()), int(lengths[8:].sum())
        values = torch.cat(
            [torch.randint(0, ROWS, (n0,), generator=g), torch.randint(0, 40, (n1,), generator=g)]
        )
        out.append(KeyedJaggedTensor(keys=["f0", "f1"], values=values, lengths=lengths))
    return out


def step(model: DistributedModelParallel, kjt: KeyedJaggedTensor) -> None:
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    (out.values() * torch.linspace(-1, 1, out.values().shape[1])).sum().backward()


_STARTED: list[TieredTableGroup] = []


@pytest.fixture(autouse=True)
def _stop_workers() -> Iterator[None]:
    """Ends every tier I/O worker a test started, so no thread outlives its test."""
    yield
    while _STARTED:
        _STARTED.pop().stop_background_io()


def tiered_group(model: DistributedModelParallel) -> TieredTableGroup:
    groups = list(model.module.tiered_groups())
    assert len(groups) == 1
    _STARTED.append(groups[0])
    return groups[0]


def kernel_features(kjt: KeyedJaggedTensor) -> KeyedJaggedTensor:
    """The features the tiered kernel sees at world size 1, table-wise: those of table big
    (tiered) and of table small (FUSED, computed by the same kernel), in that order."""
    return KeyedJaggedTensor.from_jt_dict({"f0": kjt["f0"], "f1": kjt["f1"]})


def train_with_lookahead(
    model: DistributedModelParallel, data: list[KeyedJaggedTensor], depth: int
) -> None:
    group = tiered_group(model)
    group.background_io = True
    for i in range(min(depth, len(data))):
        group.prefetch(kernel_features(data[i]).values(), kernel_features(data[i]).length_per_key())
    for i, kjt in enumerate(data):
        step(model, kjt)
        ahead = i + depth
        if ahead < len(data):
            f = kernel_features(data[ahead])
            group.prefetch(f.values(), f.length_per_key())


def copy_into(dst: DistributedModelParallel, src: DistributedModelParallel) -> None:
    dst.load_state_dict(src.state_dict())
    dst.fused_optimizer.load_state_dict(src.fused_optimizer.state_dict())


def trained_plainly(
    tmp_path: Path, tier: str, seed: int, count: int
) -> tuple[DistributedModelParallel, DistributedModelParallel, list[KeyedJaggedTensor]]:
    """A model trained by the plain loop on ``count`` batches, an untrained copy of its
    starting point (to train otherwise and compare), and the batches."""
    plain = build(tmp_path / "a", tier)
    other = build(tmp_path / "b", tier)
    copy_into(other, plain)
    data = batches(seed=seed, count=count)
    for kjt in data:
        step(plain, kjt)
    return plain, other, data


@pytest.mark.parametrize("tier", ["byte_scm", "block_scm"])
@pytest.mark.parametrize("depth", [1, 3])
def test_lookahead_is_bitwise_identical(tmp_path: Path, tier: str, depth: int) -> None:
    plain, ahead, data = trained_plainly(tmp_path, tier, seed=5, count=30)
    train_with_lookahead(ahead, data, depth)
    assert_same(full_weights(plain), full_weights(ahead))
    group = tiered_group(ahead)
    assert not group._pending  # every prefetch was consumed by its forward
    stats = group.shards[0].cache.stats
    assert stats.misses > 0 and stats.evictions > 0


def test_worker_error_surfaces_in_forward(tmp_path: Path, monkeypatch: Any) -> None:
    model = build(tmp_path, "block_scm")
    group = tiered_group(model)
    group.background_io = True
    store = group.shards[0].store

    def broken(ids: Any, out: Any) -> Any:
        raise OSError(5, "Input/output error (injected)")

    # The worker reads a block store's misses as passes of I/O (read_rows_together).
    monkeypatch.setattr(store, "read_passes", broken)
    data = batches(seed=1, count=2)
    f = kernel_features(data[0])
    group.prefetch(f.values(), f.length_per_key())  # returns at once; the read fails later
    with pytest.raises(OSError, match="injected") as info:
        step(model, data[0])
    assert any("broken" in str(entry.name) for entry in info.traceback)


def test_lookahead_needs_room_for_batches_in_flight(tmp_path: Path) -> None:
    model = build(tmp_path, "byte_scm")
    group = tiered_group(model)
    cache = group.shards[0].cache
    data = batches(seed=2, count=40)
    with pytest.raises(CacheTooSmallError, match="held by batches in flight"):
        for kjt in data:  # prefetching everything at once cannot fit a 150-row cache
            f = kernel_features(kjt)
            group.prefetch(f.values(), f.length_per_key())
    assert int(cache.holds.sum()) > 0
    group.cancel_prefetches()
    assert int(cache.holds.sum()) == 0


def test_background_planning_refuses_in_the_forward_and_training_goes_on(tmp_path: Path) -> None:
    plain = build(tmp_path / "a", "byte_scm")
    ahead = build(tmp_path / "b", "byte_scm")
    copy_into(ahead, plain)
    group = tiered_group(ahead)
    group.background_io = True
    cache = group.shards[0].cache
    data = batches(seed=2, count=40)
    for kjt in data:  # planned on the worker: prefetching returns at once, even when unfit
        f = kernel_features(kjt)
        group.prefetch(f.values(), f.length_per_key())
    # The worker plans every batch before the first forward, so the holds pile up and the
    # cache refuses one on a loaded machine too (training used to catch up with the worker).
    futures.wait([b.io for b in group._pending if b.io is not None])
    ran = 0
    with pytest.raises(CacheTooSmallError, match="held by batches in flight"):
        for kjt in data:
            step(ahead, kjt)
            ran += 1
    assert 0 < ran < len(data)
    group.stop_background_io()
    assert int(cache.holds.sum()) == 0
    for kjt in data[ran:]:  # the refused batch never ran: train on from it, without look-ahead
        step(ahead, kjt)
    for kjt in data:
        step(plain, kjt)
    assert_same(full_weights(plain), full_weights(ahead))


def test_background_prefetch_checks_ids_at_once(tmp_path: Path) -> None:
    model = build(tmp_path, "block_scm")
    group = tiered_group(model)
    group.background_io = True
    with pytest.raises(TableIdError, match=rf"table 'big'.*row id {ROWS + 5}\b"):
        group.prefetch(torch.tensor([1, ROWS + 5]), [2])
    assert not group._pending
    assert int(group.shards[0].cache.holds.sum()) == 0


def test_hot_rows_stay_resident(tmp_path: Path) -> None:
    hot = list(range(0, 300, 10))
    plain = build(tmp_path / "a", "block_scm")
    pinned = build(tmp_path / "b", "block_scm", hot_rows={"big": hot})
    copy_into(pinned, plain)
    cache = tiered_group(pinned).shards[0].cache
    data = batches(seed=3, count=25)
    for kjt in data:
        step(plain, kjt)
        step(pinned, kjt)
        assert bool((cache.lookup(torch.tensor(hot)) >= 0).all())
    assert int(cache.pinned.sum()) == len(hot)
    assert cache.stats.evictions > 0
    assert_same(full_weights(plain), full_weights(pinned))


def test_hot_rows_must_name_tiered_tables(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'small'"):
        build(tmp_path, "byte_scm", hot_rows={"small": [1]})


def test_flush_between_forward_and_backward_keeps_updates(tmp_path: Path) -> None:
    plain = build(tmp_path / "a", "byte_scm")
    other = build(tmp_path / "b", "byte_scm")
    copy_into(other, plain)
    for kjt in batches(seed=4, count=12):
        step(plain, kjt)
        out = other(kjt)
        out = out.wait() if hasattr(out, "wait") else out
        other.state_dict()  # flushes between forward and backward
        (out.values() * torch.linspace(-1, 1, out.values().shape[1])).sum().backward()
    assert_same(full_weights(plain), full_weights(other))


def test_flush_in_chunks_writes_every_dirty_row(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setattr(tiered_tables, "FLUSH_CHUNK_ROWS", 7)
    model = build(tmp_path, "block_scm")
    group = tiered_group(model)
    shard = group.shards[0]
    for kjt in batches(seed=6, count=10):
        step(model, kjt)
    dirty_ids, _ = shard.cache.dirty_rows()
    assert dirty_ids.numel() > 3 * 7
    group.flush()
    assert shard.cache.dirty_rows()[0].numel() == 0
    ids, slots = shard.cache.resident()
    on_tier = group.views.weight_view(0)[ids]
    assert torch.equal(on_tier, shard.weight_slots[slots].to(on_tier.dtype))


@pytest.mark.parametrize("tier", ["byte_scm", "block_scm"])
def test_the_training_thread_never_waits_for_the_workers_planning(
    tmp_path: Path, tier: str
) -> None:
    """While the worker holds the cache lock (planning a later batch), a training step whose
    rows were prefetched runs to its end: the release of the batch before it and the marks of
    its own rows wait for the lock, not the step. Whoever takes the lock next carries them out
    (a flush here), and training is bitwise the plain loop's."""
    plain, ahead, data = trained_plainly(tmp_path, tier, seed=6, count=12)
    group = tiered_group(ahead)
    group.background_io = True
    cache = group.shards[0].cache
    for i, kjt in enumerate(data):
        f = kernel_features(kjt)
        group.prefetch(f.values(), f.length_per_key())
        group.drain()  # its rows are in: the step needs nothing more from the worker
        if i % 3 != 2:
            step(ahead, kjt)
            continue
        held_before = int(cache.holds.sum())
        group._cache_lock.acquire()  # the worker, planning a later batch
        try:
            done = futures.ThreadPoolExecutor(1).submit(step, ahead, kjt)
            done.result(timeout=30)  # without waiting for the lock
            assert len(group._deferred) == 2  # the release, then the marks
            assert int(cache.holds.sum()) == held_before  # the release is still to come
        finally:
            group._cache_lock.release()
        ahead.state_dict()  # its flush takes the lock: the deferred updates first
        assert not group._deferred
        assert int(cache.holds.sum()) < held_before  # only the step's own rows are held
    assert_same(full_weights(plain), full_weights(ahead))
