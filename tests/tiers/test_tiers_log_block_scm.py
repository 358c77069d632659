"""The log-structured block tier: appends without read-modify-write, the index, compaction
within the space bound, crash safety at flush granularity, and its options and file checks."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import exact_rows, uring_refusal

from torchrec_mtrains.tiers import (
    TIERS,
    BlockScmOptions,
    HeaderMismatchError,
    RowStoreError,
    layouts_of,
    log_block_scm,
    open_store,
    resolve_options,
)
from torchrec_mtrains.tiers.block_scm import BlockSCMStore
from torchrec_mtrains.tiers.log_block_scm import (
    CKPT_MAGIC,
    LogBlockSCMStore,
    index_bytes_per_row,
)
from torchrec_mtrains.tiers.options import LogBlockScmOptions
from torchrec_mtrains.types import RowLayout

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# 68-byte rows, 512-byte blocks and 2 KiB segments: a small table that compacts often.
SMALL = RowLayout(3000, 16, 1)
SMALL_OPTIONS = {"block_size": 512, "segment_bytes": 2048, "engine": "threads"}


def _store(
    directory: Path, layout: RowLayout, mode: str = "open_or_create", **options: Any
) -> LogBlockSCMStore:
    opts = LogBlockScmOptions.from_mapping(options)
    return LogBlockSCMStore(directory, "t", layout, mode=mode, options=opts)


def _abandon(store: LogBlockSCMStore) -> None:
    """Drops the store as a killed process would: no flush, no checkpoint."""
    store._close()
    store._closed = True


def _file_data_bytes(store: LogBlockSCMStore) -> int:
    return store.path.stat().st_size - store.data_offset


# ------------------------------------------------------------------------ random round trips


@st.composite
def _scenario(draw: st.DrawFn) -> tuple[RowLayout, dict[str, Any], list[tuple[Any, ...]]]:
    num_rows = draw(st.integers(1, 400))
    layout = RowLayout(
        num_rows,
        draw(st.integers(1, 40)),
        draw(st.integers(0, 2)),
        draw(st.sampled_from(["fp32", "fp16"])),
    )
    block = draw(st.sampled_from([512, 4096]))
    options = {
        "block_size": block,
        "segment_bytes": block * draw(st.integers(1, 4)),
        "max_space_amplification": draw(st.sampled_from([1.2, 2.0])),
        "engine": draw(st.sampled_from(["threads", "auto"])),
        "max_io_bytes": block * draw(st.sampled_from([1, 64])),
        "max_pass_bytes": block * draw(st.sampled_from([1, 3, 1024])),
        "direct": draw(st.booleans()),
    }
    op = st.one_of(
        st.tuples(st.just("write"), st.integers(1, min(num_rows, 120)), st.integers(0, 2**31)),
        st.tuples(st.just("read"), st.integers(0, 2**31)),
        st.tuples(st.sampled_from(["flush", "reopen", "crash"])),
    )
    return layout, options, draw(st.lists(op, min_size=1, max_size=30))


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(scenario=_scenario())
def test_random_writes_reads_flushes_reopens_and_crashes_match_a_reference(
    scenario: tuple[RowLayout, dict[str, Any], list[tuple[Any, ...]]],
) -> None:
    layout, options, ops = scenario
    current = np.zeros((layout.num_rows, layout.row_width), np.float32)
    flushed = current.copy()
    with tempfile.TemporaryDirectory() as directory:
        store = _store(Path(directory), layout, **options)
        try:
            for op in ops:
                if op[0] == "write":
                    rng = np.random.default_rng(op[2])
                    ids = rng.choice(layout.num_rows, op[1], replace=False)
                    current[ids] = exact_rows(rng, op[1], layout.row_width, layout.dtype.value)
                    store.write_rows(ids, current[ids])
                elif op[0] == "read":
                    probe = np.random.default_rng(op[1]).integers(0, layout.num_rows, 64)
                    np.testing.assert_array_equal(store.read_rows(probe), current[probe])
                elif op[0] == "flush":
                    store.flush()
                    flushed = current.copy()
                elif op[0] == "reopen":
                    store.close()
                    flushed = current.copy()
                    store = _store(Path(directory), layout, mode="open", **options)
                else:  # a crash: whatever was written after the last flush is gone
                    _abandon(store)
                    current = flushed.copy()
                    store = _store(Path(directory), layout, mode="open", **options)
            np.testing.assert_array_equal(store.read_range(0, layout.num_rows), current)
        finally:
            store.close()


# --------------------------------------------------------------------------- appends, reads


def test_writes_append_whole_blocks_without_reading(tmp_path: Path) -> None:
    layout = RowLayout(100_000, 64, 1)  # 260-byte rows, as W1's with row-wise Adagrad
    rng = np.random.default_rng(1)
    with _store(tmp_path, layout, engine="threads", max_io_bytes=256 << 10) as store:
        ids = rng.choice(100_000, 4096, replace=False)
        rows = exact_rows(rng, 4096, 65, "fp32")
        store.write_rows(ids, rows)
        blocks = -(-4096 * 260 // 4096)  # 261 blocks, densely packed
        assert store.stats.bytes_written == blocks * 4096
        assert store.stats.io_calls == -(-blocks // 64)  # 256 KiB pieces: 5 writes
        assert store.stats.bytes_read == 0  # no read-modify-write
        more = rng.choice(np.setdiff1d(np.arange(100_000), ids), 3, replace=False)
        store.write_rows(more, rows[:3])  # continues the head block: rewrites it, once
        assert store.stats.bytes_written == (blocks + 1) * 4096
        assert store.stats.bytes_read == 0
        np.testing.assert_array_equal(store.read_rows(ids), rows)
        np.testing.assert_array_equal(store.read_rows(more), rows[:3])


def test_rows_written_together_are_read_in_one_io(tmp_path: Path) -> None:
    layout = RowLayout(10_000, 32)  # 128-byte rows: 32 per 4 KiB block
    with _store(tmp_path, layout, engine="threads") as store:
        ids = np.random.default_rng(2).permutation(10_000)[:96]
        store.write_rows(ids, np.ones((96, 32), np.float32))  # three adjacent blocks
        store.read_rows(ids[::-1])
        assert (store.stats.io_calls, store.stats.bytes_read) == (2, 3 * 4096)  # 1 write
        store.write_range(200, np.ones((32 * 20, 32), np.float32))
        calls = store.stats.io_calls
        store.read_rows([200, 200 + 32 * 10, 200 + 32 * 19])  # blocks 0, 10, 19 of that run
        assert store.stats.io_calls - calls == 3
        unwritten = store.read_rows([9_999, 5_000])  # never written: zeros, no I/O
        assert not unwritten.any() and store.stats.io_calls - calls == 3


def test_rows_straddle_blocks_but_not_segments(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    for width in (1, 13, 128, 1000, 3000):  # 4 .. 12000 bytes: beyond a block too
        layout = RowLayout(300, width)
        expected = exact_rows(rng, 300, width, "fp32")
        with _store(tmp_path, layout, mode="truncate", block_size=512, segment_bytes=4096) as s:
            assert s.geometry.segment_slots * s.geometry.row_bytes <= s.geometry.segment_bytes
            for ids in np.array_split(rng.permutation(300), 7):
                s.write_rows(ids, expected[ids])
            probe = rng.integers(0, 300, 500)
            np.testing.assert_array_equal(s.read_rows(probe), expected[probe])


# ----------------------------------------------------------------------------- compaction


@pytest.mark.parametrize(("amp", "flush_every"), [(1.25, 1), (2.0, 4)])
def test_compaction_keeps_the_file_within_the_bound(
    tmp_path: Path, amp: float, flush_every: int
) -> None:
    """Holds at every step while the rows rewritten between flushes fit in the free space a
    flush leaves (half the dead space the bound allows)."""
    rng = np.random.default_rng(4)
    expected = np.zeros((SMALL.num_rows, SMALL.row_width), np.float32)
    bound = amp * SMALL.total_bytes
    with _store(tmp_path, SMALL, max_space_amplification=amp, **SMALL_OPTIONS) as store:
        assert store.file_data_bytes <= bound
        for step in range(200):
            ids = rng.choice(SMALL.num_rows, 200, replace=False)
            expected[ids] = exact_rows(rng, 200, SMALL.row_width, "fp32")
            store.write_rows(ids, expected[ids])
            assert _file_data_bytes(store) == store.file_data_bytes <= bound
            if step % flush_every == flush_every - 1:
                store.flush()
        stats = store.log_stats
        assert stats.compacted_rows > 0 and stats.segments_reclaimed > 0
        assert stats.grown_segments == 0
        # 13x the table written: the only reads were compaction's, never a block to patch.
        assert store.stats.bytes_read == stats.compaction_bytes_read
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), expected)
    with _store(tmp_path, SMALL, mode="open", max_space_amplification=amp, **SMALL_OPTIONS) as s:
        np.testing.assert_array_equal(s.read_range(0, SMALL.num_rows), expected)


def test_rows_a_flush_compacted_survive_a_crash_and_later_appends(tmp_path: Path) -> None:
    """The checkpoint after a flush's compaction leaves the head sealed: appends after a
    reopen never rewrite the head block holding the rows compaction moved there."""
    rng = np.random.default_rng(8)
    expected = np.zeros((SMALL.num_rows, SMALL.row_width), np.float32)
    options = {**SMALL_OPTIONS, "max_space_amplification": 1.25}
    store = _store(tmp_path, SMALL, **options)
    for _ in range(100):  # until a flush compacts (a second checkpoint in one flush)
        ids = rng.choice(SMALL.num_rows, 211, replace=False)  # 211 * 68 B: mid-block ends
        expected[ids] = exact_rows(rng, 211, SMALL.row_width, "fp32")
        store.write_rows(ids, expected[ids])
        before = store.log_stats.checkpoints
        store.flush()
        if store.log_stats.checkpoints - before > 1:
            break
    else:
        pytest.fail("no flush compacted")
    _abandon(store)
    with _store(tmp_path, SMALL, mode="open", **options) as store:
        ids = rng.choice(SMALL.num_rows, 3, replace=False)
        expected[ids] = exact_rows(rng, 3, SMALL.row_width, "fp32")
        store.write_rows(ids, expected[ids])
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), expected)


def test_flushed_copies_pinned_by_rewrites_grow_the_file_until_a_flush(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    rng = np.random.default_rng(5)
    bound = 1.5 * SMALL.total_bytes
    with _store(tmp_path, SMALL, max_space_amplification=1.5, **SMALL_OPTIONS) as store:
        first = exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32")
        store.write_range(0, first)
        store.flush()
        second = exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32")
        for start in range(0, SMALL.num_rows, 500):  # rewrite everything before flushing
            store.write_range(start, second[start : start + 500])
        assert store.log_stats.grown_segments > 0 and store.file_data_bytes > bound
        assert "max_space_amplification" in caplog.text and str(store.path) in caplog.text
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), second)
        store.flush()  # the first copies are free now: compaction brings the file back
        assert _file_data_bytes(store) == store.file_data_bytes <= bound
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), second)


def test_a_cleared_log_takes_a_whole_rewrite_without_growing(tmp_path: Path) -> None:
    """What a full checkpoint load does: clear, then write every row. The flushed rows are
    forgotten, not pinned, so the file stays within its bound, with no compaction."""
    rng = np.random.default_rng(6)
    bound = 1.5 * SMALL.total_bytes
    with _store(tmp_path, SMALL, max_space_amplification=1.5, **SMALL_OPTIONS) as store:
        store.write_range(0, exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32"))
        store.flush()
        version = store.version
        store.clear()
        assert store.version > version  # views of the rows know they are stale
        assert store.live_rows == 0 and not store.read_range(0, SMALL.num_rows).any()
        second = exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32")
        for start in range(0, SMALL.num_rows, 500):
            store.write_range(start, second[start : start + 500])
        stats = store.log_stats
        assert stats.grown_segments == 0 and stats.compacted_rows == 0
        assert store.file_data_bytes <= bound
    with _store(tmp_path, SMALL, mode="open", **SMALL_OPTIONS) as store:
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), second)


def test_a_clear_is_durable_at_once(tmp_path: Path) -> None:
    """A kill after clear() reopens an empty table, never rows of segments it freed."""
    rng = np.random.default_rng(7)
    store = _store(tmp_path, SMALL, **SMALL_OPTIONS)
    store.write_range(0, exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32"))
    store.flush()
    store.clear()
    store.write_range(0, exact_rows(rng, 100, SMALL.row_width, "fp32"))  # never flushed
    _abandon(store)
    with _store(tmp_path, SMALL, mode="open", **SMALL_OPTIONS) as again:
        assert again.live_rows == 0 and not again.read_range(0, SMALL.num_rows).any()


def test_a_flush_with_nothing_written_since_the_last_writes_no_checkpoint(tmp_path: Path) -> None:
    """Every state dict and purge flushes; an unchanged log keeps the checkpoint it has
    rather than rewriting an index of 8 bytes a row."""
    rng = np.random.default_rng(8)
    with _store(tmp_path, SMALL, **SMALL_OPTIONS) as store:
        store.write_rows(np.arange(10), exact_rows(rng, 10, SMALL.row_width, "fp32"))
        store.flush()
        before = store.log_stats.checkpoints
        store.flush()
        store.flush()
        assert store.log_stats.checkpoints == before
        store.write_rows(np.arange(3), exact_rows(rng, 3, SMALL.row_width, "fp32"))
        store.flush()
        assert store.log_stats.checkpoints == before + 1


def test_reading_the_table_batch_by_batch_scans_the_index_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint reads a log batch after batch (ids, then rows, in any order): the rows of
    each batch come from one grouping of the index by segment, not a scan of it per batch."""
    rng = np.random.default_rng(9)
    options = {**SMALL_OPTIONS, "max_pass_bytes": 4096}  # two segments a batch
    with _store(tmp_path, SMALL, **options) as store:
        expected = exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32")
        store.write_range(0, expected)
        rewritten = rng.choice(SMALL.num_rows, 700, replace=False)
        expected[rewritten] = exact_rows(rng, 700, SMALL.row_width, "fp32")
        store.write_rows(rewritten, expected[rewritten])
        store.flush()
        scans = {"index": 0, "grouping": 0}
        scan, group = store._scan, store._group_by_segment

        def counted_scan(*args: Any) -> Any:
            scans["index"] += 1
            return scan(*args)

        def counted_group() -> Any:
            scans["grouping"] += 1
            return group()

        monkeypatch.setattr(store, "_scan", counted_scan)
        monkeypatch.setattr(store, "_group_by_segment", counted_group)
        batches = store.scan_batches()
        assert len(batches) >= 20
        seen = np.zeros(SMALL.num_rows, dtype=int)
        for batch in reversed(batches):  # in any order
            ids, rows = store.read_scan_batch(batch)
            np.testing.assert_array_equal(store.scan_batch_ids(batch), ids)
            np.testing.assert_array_equal(rows, expected[ids])
            seen[ids] += 1
        assert (seen == 1).all()
        assert scans == {"index": 0, "grouping": 1}
        store.write_rows(np.array([0]), expected[:1])  # a write: the grouping is made anew
        ids, _ = store.read_scan_batch(store.scan_batches()[0])
        assert scans["grouping"] == 2


def test_the_index_is_four_bytes_a_row_and_widens_when_the_file_outgrows_int32_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert index_bytes_per_row(100_000_000, 2.0) == 4
    assert index_bytes_per_row(2**31, 2.0) == 8  # 2^32 slots: int64
    rng = np.random.default_rng(12)
    with _store(tmp_path, SMALL, max_space_amplification=1.5, **SMALL_OPTIONS) as store:
        assert store._loc.dtype == np.int32
        # Pretend int32 ends at the bound's slots, then outgrow it as the pinning test does.
        limit = store.segments * store.geometry.segment_slots
        monkeypatch.setattr(
            log_block_scm, "index_dtype", lambda slots: np.int32 if slots <= limit else np.int64
        )
        first = exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32")
        store.write_range(0, first)
        store.flush()
        second = exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32")
        for start in range(0, SMALL.num_rows, 500):
            store.write_range(start, second[start : start + 500])
        assert store.segments * store.geometry.segment_slots > limit
        assert store._loc.dtype == np.int64
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), second)
        store.flush()
    with _store(tmp_path, SMALL, mode="open", max_space_amplification=1.5, **SMALL_OPTIONS) as s:
        assert s._loc.dtype == np.int32  # back within the bound
        np.testing.assert_array_equal(s.read_range(0, SMALL.num_rows), second)


def test_a_flush_finds_the_rows_of_many_victims_in_one_scan_of_the_index(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The index keeps no slot -> row map: each scan for a segment's rows reads the whole
    row -> slot map, so a flush compacting many segments batches them."""
    rng = np.random.default_rng(13)
    expected = np.zeros((SMALL.num_rows, SMALL.row_width), np.float32)
    options = {**SMALL_OPTIONS, "max_space_amplification": 2.0}
    with _store(tmp_path, SMALL, **options) as store:
        expected[:] = exact_rows(rng, SMALL.num_rows, SMALL.row_width, "fp32")
        store.write_range(0, expected)
        store.flush()
        # Two thirds rewritten: dead rows everywhere, and fewer free segments than a flush
        # leaves (half the dead space the bound allows).
        ids = rng.choice(SMALL.num_rows, 2 * SMALL.num_rows // 3, replace=False)
        expected[ids] = exact_rows(rng, ids.size, SMALL.row_width, "fp32")
        store.write_rows(ids, expected[ids])
        scans = []
        real_scan = store._scan
        monkeypatch.setattr(store, "_scan", lambda select: scans.append(1) or real_scan(select))
        evacuated = []
        real_evacuate = store._evacuate
        monkeypatch.setattr(
            store, "_evacuate", lambda segs: evacuated.append(segs.size) or real_evacuate(segs)
        )
        store.flush()
        assert sum(evacuated) > 2 * len(scans) > 0
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), expected)
    with _store(tmp_path, SMALL, mode="open", **options) as store:
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), expected)


def test_readers_see_exact_rows_while_compaction_moves_them(tmp_path: Path) -> None:
    layout = RowLayout(4000, 8, 1)
    rng = np.random.default_rng(6)
    stable = exact_rows(rng, 2000, 9, "fp32")
    errors: list[BaseException] = []
    stop = threading.Event()
    with _store(tmp_path, layout, **SMALL_OPTIONS) as store:
        store.write_range(0, stable)  # rows 0..1999 never change; 2000.. are rewritten

        def reader(seed: int) -> None:
            local = np.random.default_rng(seed)
            try:
                while not stop.is_set():
                    ids = local.integers(0, 2000, 200)
                    np.testing.assert_array_equal(store.read_rows(ids), stable[ids])
            except BaseException as e:  # reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        try:
            for step in range(300):
                ids = 2000 + rng.choice(2000, 150, replace=False)
                store.write_rows(ids, np.full((150, 9), step, np.float32))
                if step % 10 == 0:
                    store.flush()
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not errors, errors[0]
        assert store.log_stats.compacted_rows > 0  # stable rows moved under the readers


# --------------------------------------------------------------------------- crash safety

CRASH_LAYOUT = RowLayout(3000, 16, 1)
CRASH_OPTIONS = {"block_size": 512, "segment_bytes": 2048, "max_space_amplification": 1.5}


def _crash_round(seed: int, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Round ``k`` of a crash test: one to three batches of distinct random rows."""
    rng = np.random.default_rng([seed, k])
    batches = []
    for _ in range(int(rng.integers(1, 4))):
        ids = rng.choice(CRASH_LAYOUT.num_rows, int(rng.integers(1, 600)), replace=False)
        batches.append((ids, rng.standard_normal((ids.size, CRASH_LAYOUT.row_width), np.float32)))
    return batches


def _crash_child(directory: str, seed: int, rounds: bool) -> None:
    """Runs in the child process until it is killed: flushed rounds, printing each round's
    number once its flush returned; or (``rounds`` false) one flush, its rows saved to
    expected.npy, then unflushed writes forever."""
    store = LogBlockSCMStore(
        directory, "t", CRASH_LAYOUT, options=LogBlockScmOptions.from_mapping(CRASH_OPTIONS)
    )
    print("ready", flush=True)
    expected = np.zeros((CRASH_LAYOUT.num_rows, CRASH_LAYOUT.row_width), np.float32)
    for k in itertools.count(1):
        for ids, rows in _crash_round(seed, k):
            store.write_rows(ids, rows)
            expected[ids] = rows
        if rounds or k == 5:
            store.flush()
        if not rounds and k == 5:
            np.save(Path(directory) / "expected.npy", expected)
            print("flushed", flush=True)
        elif k > 5 or rounds:
            print(k, flush=True)


def _spawn(directory: Path, seed: int, rounds: bool) -> subprocess.Popen[str]:
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); "
        "from test_tiers_log_block_scm import _crash_child; "
        f"_crash_child({str(directory)!r}, {seed}, {rounds})"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True, bufsize=1
    )


def _kill(child: subprocess.Popen[str]) -> list[str]:
    child.send_signal(signal.SIGKILL)
    rest, _ = child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    return rest.split()


def _reopen_rows(directory: Path) -> np.ndarray:
    with _store(directory, CRASH_LAYOUT, mode="open", **CRASH_OPTIONS) as store:
        return store.read_range(0, CRASH_LAYOUT.num_rows)


@pytest.mark.slow
def test_kill_during_writes_after_a_flush_reopens_to_exactly_the_flushed_rows(
    tmp_path: Path,
) -> None:
    child = _spawn(tmp_path, seed=7, rounds=False)
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        assert child.stdout.readline().strip() == "flushed"
        for _ in range(20):  # well into the unflushed writes, compaction and growth
            assert child.stdout.readline().strip().isdigit()
    finally:
        _kill(child)
    expected = np.load(tmp_path / "expected.npy")
    assert expected.any()
    np.testing.assert_array_equal(_reopen_rows(tmp_path), expected)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_kill_at_a_random_moment_reopens_to_the_last_completed_flush(
    tmp_path: Path, seed: int
) -> None:
    child = _spawn(tmp_path, seed=seed, rounds=True)
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(float(np.random.default_rng(seed).uniform(0.05, 1.5)))
    finally:
        printed = _kill(child)
    done = int(printed[-1]) if printed else 0
    # The last printed round is durable; the kill may have come after the next flush
    # returned but before its number was printed.
    states = [np.zeros((CRASH_LAYOUT.num_rows, CRASH_LAYOUT.row_width), np.float32)]
    for k in range(1, done + 2):
        state = states[-1].copy()
        for ids, rows in _crash_round(seed, k):
            state[ids] = rows
        states.append(state)
    got = _reopen_rows(tmp_path)
    matches = [k for k in (done, done + 1) if np.array_equal(got, states[k])]
    assert matches, f"reopened rows match neither round {done} nor {done + 1}"


_EXPORT_CHILD = """
import sys, time
from pathlib import Path
import numpy as np
from torchrec_mtrains.tiers.log_block_scm import LogBlockSCMStore
from torchrec_mtrains.tiers.options import LogBlockScmOptions
from torchrec_mtrains.types import RowLayout
layout = RowLayout(3000, 16, 1)
opts = LogBlockScmOptions.from_mapping(
    {"block_size": 512, "segment_bytes": 2048, "engine": "threads", "max_pass_bytes": 4096}
)
store = LogBlockSCMStore(Path(sys.argv[1]), "t", layout, options=opts)
out = np.zeros((layout.num_rows, layout.row_width), np.float32)

def written():  # after the first id range: the spill files of the others are on disk
    print("exporting", flush=True)
    time.sleep(60)

store.export_rows(out, written=written)
"""


def test_an_export_killed_midway_leaves_spill_files_that_the_next_open_removes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An export of a table larger than one pass spills its rows next to the tier file; a
    kill leaves them there (a copy of the table), and the next open removes them."""
    rng = np.random.default_rng(5)
    options = {**SMALL_OPTIONS, "max_pass_bytes": 4096}
    expected = rng.standard_normal((SMALL.num_rows, SMALL.row_width)).astype(np.float32)
    with _store(tmp_path, SMALL, **options) as store:
        store.write_range(0, expected)
    other = tmp_path / ".other.log_block_scm.rows.export.keep"  # another table's: kept
    other.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", _EXPORT_CHILD, str(tmp_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    try:
        assert child.stdout.readline().strip() == "exporting"
    finally:
        _kill(child)
    spills = [p for p in tmp_path.glob(f".{store.path.name}.export.*") if p.is_dir()]
    assert len(spills) == 1 and any(f.stat().st_size for f in spills[0].iterdir())

    with caplog.at_level(logging.WARNING), _store(tmp_path, SMALL, mode="open", **options) as store:
        np.testing.assert_array_equal(store.read_range(0, SMALL.num_rows), expected)
    assert not spills[0].exists() and other.is_dir()
    assert f"removed {spills[0]}" in caplog.text


def test_a_torn_newest_checkpoint_falls_back_to_the_one_before(tmp_path: Path) -> None:
    layout = RowLayout(500, 4)
    store = _store(tmp_path, layout)
    store.write_range(0, np.full((500, 4), 1.0, np.float32))
    store.flush()
    store.write_rows([3, 7], np.full((2, 4), 2.0, np.float32))
    store.flush()
    newest = store.geometry.checkpoint_offset(store._generation % 2)
    _abandon(store)  # closing would checkpoint once more
    with open(store.path, "r+b") as f:  # as if the last flush died mid-checkpoint
        f.seek(newest + 100)
        f.write(b"\xff" * 64)
    with _store(tmp_path, layout, mode="open") as store:
        np.testing.assert_array_equal(store.read_range(0, 500), np.ones((500, 4), np.float32))
    with open(store.path, "r+b") as f:  # both slots torn: refused, naming the file
        for slot in (0, 1):
            f.seek(store.geometry.checkpoint_offset(slot) + 100)
            f.write(b"\xff" * 64)
    with pytest.raises(RowStoreError, match=f"{store.path}: corrupt index"):
        _store(tmp_path, layout, mode="open")


def test_a_file_killed_while_being_created_opens_empty(tmp_path: Path) -> None:
    layout = RowLayout(50, 4)
    with _store(tmp_path, layout) as store:
        store.write_range(0, np.ones((50, 4), np.float32))
    with open(store.path, "r+b") as f:  # no checkpoint completed yet
        for slot in (0, 1):
            f.seek(store.geometry.checkpoint_offset(slot))
            f.write(b"\0" * store.geometry.checkpoint_bytes)
    with _store(tmp_path, layout, mode="open") as store:
        assert not store.read_range(0, 50).any()
        # A write, so closing checkpoints again (into slot 0; opening wrote slot 1).
        store.write_rows(np.array([0]), np.zeros((1, 4), np.float32))
    with open(store.path, "r+b") as f:  # the first checkpoint torn: its magic, no checksum
        f.seek(store.geometry.checkpoint_offset(1))
        f.write(b"\0" * store.geometry.checkpoint_bytes)
        f.seek(store.geometry.checkpoint_offset(0) + 8)
        f.write((1).to_bytes(8, "little") + b"\xee" * 8)
        f.seek(store.geometry.checkpoint_offset(0))
        assert f.read(8) == CKPT_MAGIC
    with _store(tmp_path, layout, mode="open") as store:
        assert not store.read_range(0, 50).any()


# ------------------------------------------------------------------ file and option checks


def test_reopening_with_another_block_or_segment_size_is_refused(tmp_path: Path) -> None:
    with _store(tmp_path, SMALL, **SMALL_OPTIONS) as store:
        store.write_range(0, np.ones((10, 17), np.float32))
    path = re.escape(str(store.path))
    for block, message in [(4096, "made with block_size=512"), (8192, "another block size")]:
        with pytest.raises(HeaderMismatchError, match=f"{path}: .*{message}.*'block_size'"):
            _store(tmp_path, SMALL, mode="open", block_size=block, segment_bytes=8192)
    with pytest.raises(HeaderMismatchError, match=f"{path}: .*'segment_bytes'=4096"):
        _store(tmp_path, SMALL, mode="open", block_size=512, segment_bytes=4096)
    with _store(tmp_path, SMALL, mode="open", **SMALL_OPTIONS) as again:  # the file's values
        assert again.read_rows([9])[0, 0] == 1.0


def test_another_tiers_file_and_another_shape_are_refused(tmp_path: Path) -> None:
    layout = RowLayout(20, 3)
    open_store("block_scm", tmp_path, "t", layout).close()
    os.rename(tmp_path / "t.block_scm.rows", tmp_path / "t.log_block_scm.rows")
    with pytest.raises(HeaderMismatchError, match="tier: file has 'block_scm'"):
        _store(tmp_path, layout, mode="open")
    _store(tmp_path, layout, mode="truncate").close()
    with pytest.raises(HeaderMismatchError, match="num_rows: file has 20, expected 21"):
        _store(tmp_path, RowLayout(21, 3), mode="open")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"block_size": 1000}, "'block_size' must be a power of two >= 512, got 1000"),
        ({"queue_depth": 0}, "'queue_depth' must be >= 1, got 0"),
        ({"max_io_bytes": 512}, r"'max_io_bytes' \(512\) must be >= block_size \(4096\)"),
        ({"max_pass_bytes": 0}, "'max_pass_bytes' must be >= 1, got 0"),
        ({"segment_bytes": 6000}, r"'segment_bytes' must be a positive multiple of block_size"),
        ({"segment_bytes": 0}, "'segment_bytes' must be a positive multiple"),
        ({"max_space_amplification": 1.0}, "'max_space_amplification' must be a finite number"),
        ({"max_space_amplification": float("inf")}, "'max_space_amplification' must be a fin"),
        ({"max_space_amplification": "2"}, "'max_space_amplification' must be a number, got '2'"),
        (
            {"engine": "spdk"},
            "'engine' must be one of 'auto', 'uring', 'aio', 'threads', got 'spdk'",
        ),
    ],
)
def test_bad_options_name_the_tier_and_the_option(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=f"^tier 'log_block_scm' option {message}"):
        LogBlockScmOptions.from_mapping(values)


def test_options_are_registered_and_reach_the_store(tmp_path: Path) -> None:
    assert TIERS["log_block_scm"] is LogBlockSCMStore
    assert LogBlockSCMStore.options_type is LogBlockScmOptions
    assert set(LogBlockScmOptions.hardware_fields) <= set(LogBlockScmOptions.option_names())
    with pytest.raises(dataclasses.FrozenInstanceError):
        LogBlockScmOptions().segment_bytes = 1  # type: ignore[misc]
    assert resolve_options("log_block_scm", {"max_space_amplification": 3}) == LogBlockScmOptions(
        max_space_amplification=3.0
    )
    with pytest.raises(ValueError, match="unknown option 'amp'; allowed: block_size, "):
        resolve_options("log_block_scm", {"amp": 2})
    options = {"engine": "threads", "block_size": 8192, "queue_depth": 4}
    with open_store("log_block_scm", tmp_path, "t", SMALL, options=options) as store:
        assert isinstance(store, LogBlockSCMStore)
        assert (store.block_size, store.queue_depth, store.engine) == (8192, 4, "threads")
        assert store._engine.depth == 4
        assert store.data_offset % 8192 == 0 and store.mapped_rows() is None


def test_space_is_preallocated_and_a_full_device_is_reported(tmpfs_mount: Any) -> None:
    small = tmpfs_mount("size=1m")
    with pytest.raises(RowStoreError, match=r"big\.log_block_scm\.rows: device full"):
        open_store("log_block_scm", small, "big", RowLayout(2000, 64))  # 1 MB of rows, 2x
    assert list(small.iterdir()) == []
    with open_store("log_block_scm", small, "fits", RowLayout(100, 8)) as store:
        st = store.path.stat()
        assert st.st_blocks * 512 >= st.st_size  # no holes: a full disk fails at create
        store.write_range(0, np.ones((100, 8), np.float32))


def test_o_direct_is_used_where_supported(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    with LogBlockSCMStore(tmp_path, "t", RowLayout(10, 4)) as store:
        if not store.direct:
            pytest.skip(f"{tmp_path} does not support O_DIRECT")
        assert store.engine == ("aio" if uring_refusal() else "uring")
        store.write_range(0, np.ones((10, 4), np.float32))
        assert store.read_rows([9]).sum() == 4
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# ------------------------------------------------------------- the block tier's log layout


def test_the_block_tier_opens_in_its_log_layout_when_its_options_say_so(tmp_path: Path) -> None:
    assert layouts_of("block_scm") == {"flat": BlockSCMStore, "log": LogBlockSCMStore}
    assert LogBlockSCMStore.serves_tier == "block_scm" and BlockSCMStore.serves_tier == "block_scm"
    by_key = resolve_options("block_scm", {"layout": "log", "queue_depth": 4})
    assert by_key == LogBlockScmOptions(queue_depth=4)
    assert resolve_options("block_scm", LogBlockScmOptions()) == LogBlockScmOptions()
    assert resolve_options("block_scm", {"layout": "flat"}) == BlockScmOptions()
    with pytest.raises(ValueError, match="option 'layout' must be one of flat, log, got 'lsm'"):
        resolve_options("block_scm", {"layout": "lsm"})
    with pytest.raises(ValueError, match="takes DramOptions, got LogBlockScmOptions"):
        resolve_options("dram", LogBlockScmOptions())  # another device's store
    options = {"layout": "log", "engine": "threads", "block_size": 512, "segment_bytes": 2048}
    with open_store("block_scm", tmp_path, "t", SMALL, options=options) as store:
        assert isinstance(store, LogBlockSCMStore)
        assert store.path.name == "t.log_block_scm.rows"


@pytest.mark.parametrize("name", ["block_scm", "log_block_scm"])
def test_file_bytes_is_the_size_of_a_new_file(tmp_path: Path, name: str) -> None:
    options = resolve_options(name, {"block_size": 512, "engine": "threads"})
    with open_store(name, tmp_path, "t", SMALL, options=options) as store:
        assert store.path.stat().st_size == type(store).file_bytes(SMALL, options)
    assert LogBlockSCMStore.file_bytes(SMALL) > 2 * SMALL.total_bytes  # the default bound: 2x


class _RecordingTarget:
    """An export target that records the id ranges written into it, in order."""

    def __init__(self, shape: tuple[int, int]) -> None:
        self.array = np.zeros(shape, np.float32)
        self.shape, self.dtype = shape, self.array.dtype
        self.writes: list[tuple[int, int] | None] = []

    def __setitem__(self, key: Any, value: Any) -> None:
        self.writes.append((key.start, key.stop) if isinstance(key, slice) else None)
        self.array[key] = value


@pytest.mark.parametrize("max_pass_bytes", [64 << 20, 4096], ids=["one-pass", "by-id-range"])
def test_export_scans_the_log_into_the_flat_row_array(tmp_path: Path, max_pass_bytes: int) -> None:
    """After rewrites, compaction and a reopen, an export holds every row as read by id
    (zeros for rows never written), one sequential read per run of segments. A table larger
    than one pass is written to the target range by range, in id order, through spill files
    that are gone afterwards."""
    rng = np.random.default_rng(3)
    options = {**SMALL_OPTIONS, "max_space_amplification": 1.5, "max_pass_bytes": max_pass_bytes}
    store = _store(tmp_path, SMALL, **options)
    for step in range(30):
        ids = np.unique(rng.integers(0, 2500, 300))
        store.write_rows(ids, rng.standard_normal((ids.size, SMALL.row_width)))
        if step % 9 == 8:
            store.flush()
    store.close()
    store = _store(tmp_path, SMALL, **options)
    assert store.live_rows < SMALL.num_rows
    out = _RecordingTarget((SMALL.num_rows, SMALL.row_width))
    calls: list[int] = []
    before = store.stats.bytes_read
    store.export_rows(out, written=lambda: calls.append(1))  # type: ignore[arg-type]
    assert np.array_equal(out.array, store.read_range(0, SMALL.num_rows))
    assert not out.array[2500:].any()  # never written
    assert calls and store.stats.bytes_read > before
    if max_pass_bytes < SMALL.total_bytes:
        assert all(w is not None for w in out.writes) and len(out.writes) > 10
        starts = [w[0] for w in out.writes if w is not None]
        assert starts == sorted(starts) and len(calls) == len(out.writes)
        assert sorted(p.name for p in tmp_path.iterdir()) == [store.path.name]
    with pytest.raises(ValueError, match="export target of shape"):
        store.export_rows(out.array[:10])
    store.close()
