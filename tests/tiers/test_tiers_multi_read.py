"""Several tables' reads issued together (``read_rows_together``): the same rows and counters as
reading each store alone, in shared passes no larger than one pass's buffer, and an I/O error
names the file it belongs to."""

from __future__ import annotations

import dataclasses
import errno
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import uring_refusal

from torchrec_mtrains.tiers import OpenMode, RowStore, RowStoreError, open_store
from torchrec_mtrains.tiers._blockio import (
    AioEngine,
    BlockIOError,
    BufferPool,
    IOEngine,
    ThreadEngine,
    UringEngine,
)
from torchrec_mtrains.tiers.multi_read import read_rows_together
from torchrec_mtrains.types import RowLayout

# Mixed stores of one worker: log and flat block layouts on every engine, and a memory tier.
ENGINES: dict[str, type[IOEngine]] = {"aio": AioEngine, "threads": ThreadEngine}
if not uring_refusal():
    ENGINES["uring"] = UringEngine
LOG = {"layout": "log", "block_size": 512, "segment_bytes": 4096, "max_pass_bytes": 8192}
FLAT = {"layout": "flat", "block_size": 512, "max_pass_bytes": 8192}


def _stores(root: Path, engine: str, sizes: list[int]) -> list[RowStore]:
    stores = []
    shared = BufferPool()
    for i, rows in enumerate(sizes):
        layout = RowLayout(num_rows=rows, dim=4 + i, state_width=1)
        tier, options = ("dram", {}) if i == 3 else ("block_scm", LOG if i % 2 else FLAT)
        if tier == "block_scm":
            options = {**options, "engine": engine, "queue_depth": 8}
        directory = root / f"t{i}"
        directory.mkdir()
        store = open_store(
            tier, directory, f"t{i}", layout, mode=OpenMode.TRUNCATE, options=options
        )
        if hasattr(store, "use_buffers"):
            store.use_buffers(shared)  # as a tier worker's stores do
        stores.append(store)
    return stores


def _fill(stores: list[RowStore], rng: np.random.Generator, skip: int = 0) -> None:
    """Writes random rows to every store (in a shuffled order; the first ``skip`` ids of the
    log stores are left unwritten, so they read as zeros)."""
    for store in stores:
        n = store.layout.num_rows
        ids = rng.permutation(n)[: n - skip] if skip else rng.permutation(n)
        for chunk in np.array_split(ids, 3):
            rows = rng.standard_normal((chunk.size, store.layout.row_width)).astype(np.float32)
            store.write_rows(chunk, rows)
        store.flush()


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(seed=st.integers(0, 2**31), engine=st.sampled_from(sorted(ENGINES)))
def test_reading_together_returns_what_each_store_reads_alone(
    tmp_path_factory: pytest.TempPathFactory, seed: int, engine: str
) -> None:
    rng = np.random.default_rng(seed)
    root = tmp_path_factory.mktemp("together")
    stores = _stores(root, engine, [int(n) for n in rng.integers(1, 400, size=5)])
    try:
        _fill(stores, rng, skip=int(rng.integers(0, 2)))
        requests = [
            (s, rng.integers(0, s.layout.num_rows, size=int(rng.integers(0, 300)))) for s in stores
        ]
        alone = [s.read_rows(ids) for s, ids in requests]
        before = [dataclasses.replace(s.stats) for s in stores]
        together = read_rows_together(requests)
        for store, a, t, b in zip(stores, alone, together, before):
            np.testing.assert_array_equal(t, a)
            after = store.stats
            assert after.rows_read - b.rows_read == a.shape[0]
            assert after.read_calls - b.read_calls == (1 if a.shape[0] else 0)
    finally:
        for s in stores:
            s.close()


class _Recording:
    """Wraps an engine's ``run``: the files and bytes of each list of I/Os it is given."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cls: type[Any]) -> None:
        self.runs: list[tuple[set[int], int]] = []
        original = cls.run

        def run(engine: Any, fd: Any, write: bool, buf: Any, bo: Any, fo: Any, ln: Any) -> int:
            if not write:
                fds = {fd} if isinstance(fd, int) else set(np.asarray(fd).tolist())
                self.runs.append((fds, int((bo + ln).max()) if len(ln) else 0))
            return int(original(engine, fd, write, buf, bo, fo, ln))

        monkeypatch.setattr(cls, "run", run)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_tables_share_passes_of_at_most_one_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Four block tables' misses go out in lists spanning several files, each within the
    smallest ``max_pass_bytes``; read alone, each table makes at least one list of its own."""
    rng = np.random.default_rng(0)
    stores = _stores(tmp_path, engine, [300, 300, 300, 10, 300, 300])
    block_stores = [s for i, s in enumerate(stores) if i != 3]
    try:
        _fill(stores, rng)
        requests = [(s, rng.choice(s.layout.num_rows, 12, replace=False)) for s in block_stores]
        recording = _Recording(monkeypatch, ENGINES[engine])
        for s, ids in requests:
            s.read_rows(ids)
        alone = len(recording.runs)
        recording.runs.clear()
        read_rows_together(requests)
        assert alone >= len(block_stores)
        assert len(recording.runs) < alone
        assert max(len(fds) for fds, _ in recording.runs) > 1
        assert all(nbytes <= 8192 for _, nbytes in recording.runs)
    finally:
        for s in stores:
            s.close()


def test_a_failed_read_names_its_file_and_releases_every_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = np.random.default_rng(1)
    stores = _stores(tmp_path, "aio", [200, 200, 200])
    try:
        _fill(stores, rng)
        requests = [(s, np.arange(0, 200, 7)) for s in stores]
        fd_of_second = stores[1]._fd  # type: ignore[attr-defined]

        def failing(engine: Any, fd: Any, write: bool, buf: Any, bo: Any, fo: Any, ln: Any) -> int:
            index = int(np.flatnonzero(np.asarray(fd) == fd_of_second)[0])
            raise BlockIOError(errno.EIO, "read at offset 0: Input/output error", index)

        monkeypatch.setattr(AioEngine, "run", failing)
        with pytest.raises(RowStoreError, match=r"t1\.log_block_scm\.rows") as err:
            read_rows_together(requests)
        assert "reading blocks" in str(err.value)
        assert not stores[1]._gate._active  # type: ignore[attr-defined]  # read gate left
    finally:
        monkeypatch.undo()
        for s in stores:
            s.close()
