"""Behaviour every tier shares: round trips, persistence, open modes, header checks, errors."""

from __future__ import annotations

import os
import shutil
import stat
import struct
import subprocess
import tempfile
import threading
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tier_helpers import STORE_CASES, STORE_IDS, TIER_NAMES, StoreFactory, exact_rows

from torchrec_mtrains.tiers import HeaderMismatchError, OpenMode, RowStoreError, open_store
from torchrec_mtrains.tiers.base import (
    HEADER_BYTES,
    FileHeader,
    copy_columns_to_rows,
    copy_rows_to_columns,
)
from torchrec_mtrains.types import RowLayout

DTYPES = ["fp32", "fp16"]


@st.composite
def _workload(draw: st.DrawFn) -> tuple[RowLayout, list[np.ndarray], int]:
    num_rows = draw(st.integers(1, 400))
    layout = RowLayout(
        num_rows, draw(st.integers(1, 70)), draw(st.integers(0, 3)), draw(st.sampled_from(DTYPES))
    )
    batches = draw(
        st.lists(
            st.lists(st.integers(0, num_rows - 1), min_size=1, max_size=60, unique=True),
            min_size=1,
            max_size=6,
        )
    )
    return layout, [np.array(b, dtype=np.int64) for b in batches], draw(st.integers(0, 2**31))


@pytest.mark.parametrize(("tier", "options"), STORE_CASES, ids=STORE_IDS)
@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(work=_workload())
def test_random_round_trip_matches_a_reference_array(
    tier: str, options: dict[str, Any], work: tuple[RowLayout, list[np.ndarray], int]
) -> None:
    layout, batches, seed = work
    rng = np.random.default_rng(seed)
    expected = np.zeros((layout.num_rows, layout.row_width), np.float32)
    with tempfile.TemporaryDirectory() as directory:
        store = open_store(tier, directory, "t", layout, options=options)
        try:
            for ids in batches:
                rows = exact_rows(rng, ids.size, layout.row_width, layout.dtype.value)
                store.write_rows(ids, rows)
                expected[ids] = rows
                probe = rng.integers(0, layout.num_rows, 50)  # repeats allowed on reads
                got = store.read_rows(probe)
                assert got.dtype == np.float32
                np.testing.assert_array_equal(got, expected[probe])
            np.testing.assert_array_equal(store.read_range(0, layout.num_rows), expected)
        finally:
            store.close()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_survive_flush_close_and_reopen(make_store: StoreFactory, dtype: str) -> None:
    layout = RowLayout(777, 13, 2, dtype)
    rng = np.random.default_rng(1)
    expected = np.zeros((777, 15), np.float32)
    store = make_store(layout)
    ids = rng.choice(777, 300, replace=False)
    expected[ids] = exact_rows(rng, 300, 15, dtype)
    store.write_rows(ids, expected[ids])
    store.flush()
    more = rng.choice(777, 50, replace=False)  # written after the flush, before close
    expected[more] = exact_rows(rng, 50, 15, dtype)
    store.write_rows(more, expected[more])
    store.close()

    again = make_store(layout, mode=OpenMode.OPEN)
    assert not again.created
    np.testing.assert_array_equal(again.read_range(0, 777), expected)
    bumped = exact_rows(rng, 77, 15, dtype)
    again.write_range(700, bumped)
    expected[700:] = bumped
    again.close()
    third = make_store(layout, mode="open")
    np.testing.assert_array_equal(third.read_range(0, 777), expected)


def test_clear_makes_every_row_zero_and_stays_so_after_reopen(make_store: StoreFactory) -> None:
    layout = RowLayout(300, 5, 1)
    rng = np.random.default_rng(3)
    store = make_store(layout)
    store.write_range(0, exact_rows(rng, 300, 6, "fp32"))
    store.flush()
    version = store.version
    store.clear()
    assert store.version > version
    assert not store.read_range(0, 300).any()
    rows = exact_rows(rng, 7, 6, "fp32")
    store.write_rows(np.arange(7), rows)
    store.close()
    again = make_store(layout, mode=OpenMode.OPEN)
    expected = np.zeros((300, 6), np.float32)
    expected[:7] = rows
    np.testing.assert_array_equal(again.read_range(0, 300), expected)
    again.close()


def test_file_is_the_flat_row_array_after_close(make_store: StoreFactory, tmp_path: Path) -> None:
    """Checkpoints may map any tier's file as (rows, row_words) stored words from data_offset:
    fp16 weights two to a word, then the optimizer state in fp32."""
    layout = RowLayout(301, 7, 1, "fp16")
    rng = np.random.default_rng(2)
    rows = exact_rows(rng, 301, 8, "fp16")
    rows[:, 7] = rng.standard_normal(301).astype(np.float32)  # fp32 state: any float32 value
    store = make_store(layout)
    store.write_range(0, rows)
    store.close()
    header = FileHeader.unpack(store.path.read_bytes()[:HEADER_BYTES], store.path)
    assert header.data_offset == store.data_offset
    assert (header.dtype, header.state_dtype, header.row_bytes) == ("fp16", "fp32", 20)
    flat = np.fromfile(store.path, np.uint32, 301 * 5, offset=header.data_offset)
    np.testing.assert_array_equal(layout.decode(flat.reshape(301, 5)), rows)


def test_new_table_is_zero_filled_and_private(make_store: StoreFactory, tmp_path: Path) -> None:
    store = make_store(RowLayout(100, 4))
    assert store.created
    np.testing.assert_array_equal(store.read_range(0, 100), np.zeros((100, 4), np.float32))
    assert store.path.parent == tmp_path
    assert stat.S_IMODE(store.path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [store.path.name]


def test_open_modes(make_store: StoreFactory) -> None:
    layout = RowLayout(50, 4)
    with pytest.raises(RowStoreError, match="no such row file") as missing:
        make_store(layout, mode=OpenMode.OPEN)
    assert "t." in str(missing.value)
    store = make_store(layout, mode=OpenMode.CREATE)
    store.write_rows([3], np.full((1, 4), 2.0, np.float32))
    store.close()
    with pytest.raises(RowStoreError, match="already exists"):
        make_store(layout, mode=OpenMode.CREATE)
    kept = make_store(layout, mode=OpenMode.OPEN_OR_CREATE)
    assert kept.read_rows([3])[0, 0] == 2.0
    kept.close()
    replaced = make_store(layout, mode=OpenMode.TRUNCATE)
    assert replaced.created
    assert replaced.read_rows([3])[0, 0] == 0.0
    with pytest.raises(ValueError, match="'sometimes'"):
        make_store(layout, mode="sometimes")


@pytest.mark.parametrize(
    "other",
    [
        RowLayout(51, 4),
        RowLayout(50, 5),
        RowLayout(50, 4, 1),
        RowLayout(50, 4, 0, "fp16"),
    ],
    ids=["num_rows", "dim", "state_width", "dtype"],
)
def test_refuses_a_file_made_for_another_shape(make_store: StoreFactory, other: RowLayout) -> None:
    made = make_store(RowLayout(50, 4))
    made.close()
    with pytest.raises(HeaderMismatchError, match="made for another table, dtype or tier") as err:
        make_store(other, mode=OpenMode.OPEN)
    assert str(made.path) in str(err.value)


_HEADER_V2 = "<8sI16sQIIBBIQ"
_HEADER_V1 = "<8sI16sQIIBIQ"
_FIELDS = ["magic", "version", "tier", "num_rows", "dim", "state_width", "dtype", "state", "rb"]


def _rewrite_header(path: Path, v1: bool = False, **changes: Any) -> None:
    """Rewrites the header's fields (``v1``: in the version 1 format, which had no state
    dtype: it was the weights')."""
    raw = bytearray(path.read_bytes())
    fields = list(struct.unpack_from(_HEADER_V2, raw))
    names = [*_FIELDS, "off"]
    for key, value in changes.items():
        fields[names.index(key)] = value
    if v1:
        del fields[names.index("state")]
        fields[1] = 1
    body = struct.pack(_HEADER_V1 if v1 else _HEADER_V2, *fields)
    raw[: len(body) + 4] = body + struct.pack("<I", zlib.crc32(body))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"version": 99}, "layout version 99"),
        ({"magic": b"NOTROWS!"}, "bad magic"),
        ({"dtype": 7}, "corrupt header"),
        ({"state": 7}, "corrupt header"),
        ({"state": 2}, "state_dtype: file has"),
        ({"tier": b"elsewhere"}, "tier: file has 'elsewhere'"),
    ],
    ids=["version", "magic", "dtype-code", "state-dtype-code", "fp16-state", "tier"],
)
def test_refuses_wrong_version_tier_or_magic(
    make_store: StoreFactory, change: dict[str, Any], message: str
) -> None:
    store = make_store(RowLayout(20, 3))
    store.close()
    _rewrite_header(store.path, **change)
    with pytest.raises(HeaderMismatchError, match=message) as err:
        make_store(RowLayout(20, 3), mode=OpenMode.OPEN)
    assert str(store.path) in str(err.value)


def test_reads_a_version_1_file_of_an_fp32_table(make_store: StoreFactory) -> None:
    """Version 1 stored the state at the weights' type: for fp32 tables the same bytes."""
    layout = RowLayout(40, 3, 1)
    rows = exact_rows(np.random.default_rng(5), 40, 4, "fp32")
    store = make_store(layout)
    store.write_range(0, rows)
    store.close()
    _rewrite_header(store.path, v1=True)
    again = make_store(layout, mode=OpenMode.OPEN)
    np.testing.assert_array_equal(again.read_range(0, 40), rows)
    again.close()


def test_refuses_a_version_1_file_of_an_fp16_table(make_store: StoreFactory) -> None:
    """Its optimizer state was fp16: refused with what to do, never read as fp32 state."""
    layout = RowLayout(40, 4, 1, "fp16")
    store = make_store(layout)
    store.close()
    _rewrite_header(store.path, v1=True, rb=10)  # (4 + 1) fp16 values a row
    with pytest.raises(HeaderMismatchError, match=r"version 1 file of a fp16 table.*rebuild"):
        make_store(layout, mode=OpenMode.OPEN)


def test_refuses_a_corrupt_or_truncated_file(make_store: StoreFactory) -> None:
    store = make_store(RowLayout(20, 3))
    store.close()
    raw = bytearray(store.path.read_bytes())
    raw[20] ^= 0xFF  # inside num_rows: only the checksum notices
    store.path.write_bytes(bytes(raw))
    with pytest.raises(HeaderMismatchError, match="checksum") as err:
        make_store(RowLayout(20, 3), mode=OpenMode.OPEN)
    assert str(store.path) in str(err.value)

    raw[20] ^= 0xFF
    store.path.write_bytes(bytes(raw[: store.data_offset + 10]))
    with pytest.raises(HeaderMismatchError, match="truncated"):
        make_store(RowLayout(20, 3), mode=OpenMode.OPEN)
    store.path.write_bytes(b"short")
    with pytest.raises(HeaderMismatchError, match="too short"):
        make_store(RowLayout(20, 3), mode=OpenMode.OPEN)


def test_a_file_of_another_tier_is_refused(tmp_path: Path) -> None:
    layout = RowLayout(20, 3)
    originals = tmp_path / "originals"
    originals.mkdir()
    for tier in TIER_NAMES:
        open_store(tier, originals, "t", layout).close()
    for tier in TIER_NAMES:
        other = TIER_NAMES[(TIER_NAMES.index(tier) + 1) % len(TIER_NAMES)]
        shutil.copyfile(originals / f"t.{other}.rows", tmp_path / f"t.{tier}.rows")
        with pytest.raises(HeaderMismatchError, match=f"tier: file has '{other}'"):
            open_store(tier, tmp_path, "t", layout, mode=OpenMode.OPEN)


def test_out_of_range_and_malformed_ids(make_store: StoreFactory) -> None:
    store = make_store(RowLayout(10, 2), table="emb_user")
    for bad in ([10], [-1], [0, 3, 12]):
        with pytest.raises(IndexError, match=r"'emb_user'.*row id -?\d+ out of range \[0, 10\)"):
            store.read_rows(bad)
        with pytest.raises(IndexError, match="'emb_user'"):
            store.write_rows(bad, np.zeros((len(bad), 2), np.float32))
    with pytest.raises(IndexError, match=r"row id 12 out"):
        store.read_rows([0, 12])
    with pytest.raises(IndexError, match=r"rows \[8, 11\)"):
        store.read_range(8, 3)
    with pytest.raises(IndexError, match="emb_user"):
        store.write_range(9, np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="unique"):
        store.write_rows([1, 1], np.zeros((2, 2), np.float32))
    with pytest.raises(ValueError, match="do not match"):
        store.write_rows([1, 2], np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="integers"):
        store.read_rows(np.array([1.5]))
    assert store.read_rows(np.array([], dtype=np.int64)).shape == (0, 2)
    assert store.stats.read_calls == 0  # failed and empty calls count nothing


def test_concurrent_readers_see_consistent_rows(make_store: StoreFactory) -> None:
    layout = RowLayout(5000, 16, 1)
    rng = np.random.default_rng(3)
    expected = exact_rows(rng, 5000, 17, "fp32")
    store = make_store(layout)
    store.write_range(0, expected)
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def reader(seed: int) -> None:
        local = np.random.default_rng(seed)
        try:
            start.wait()
            for _ in range(20):
                ids = local.integers(0, 5000, 257)
                np.testing.assert_array_equal(store.read_rows(ids), expected[ids])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert store.stats.rows_read == 4 * 20 * 257


def test_counters(make_store: StoreFactory) -> None:
    layout = RowLayout(1000, 8)
    store = make_store(layout)
    store.write_rows([1, 500], np.ones((2, 8), np.float32))
    store.read_rows([1, 2, 999])
    store.flush()
    s = store.stats
    assert (s.write_calls, s.rows_written, s.read_calls, s.rows_read) == (1, 2, 1, 3)
    # At least the payload moved; block tiers move whole blocks.
    assert s.bytes_read >= 3 * layout.row_bytes
    assert s.bytes_written >= 2 * layout.row_bytes
    block = getattr(store, "block_size", None)
    if block:
        assert s.bytes_written % block == 0 and s.io_calls >= 3
    else:
        assert (s.bytes_read, s.bytes_written) == (3 * 32, 2 * 32)
    assert set(s.as_dict()) >= {"rows_read", "bytes_read", "io_calls"}


def test_closed_store_refuses_use(make_store: StoreFactory) -> None:
    store = make_store(RowLayout(10, 2))
    with store:
        store.write_rows([0], np.ones((1, 2), np.float32))
    assert store.closed
    store.close()  # twice is fine
    with pytest.raises(RowStoreError, match="closed"):
        store.read_rows([0])
    with pytest.raises(RowStoreError, match="closed"):
        store.write_range(0, np.ones((1, 2), np.float32))
    with pytest.raises(RowStoreError, match="closed"):
        store.flush()


def test_missing_directory_is_named(tmp_path: Path, store_case: tuple[str, Any]) -> None:
    missing = tmp_path / "nope" / "deeper"
    with pytest.raises(RowStoreError, match=f"{missing} does not exist"):
        open_store(store_case[0], missing, "t", RowLayout(4, 2))
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(RowStoreError, match="is not a directory"):
        open_store(store_case[0], afile, "t", RowLayout(4, 2))
    with pytest.raises(ValueError, match="invalid table name"):
        open_store(store_case[0], tmp_path, "../escape", RowLayout(4, 2))


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_read_only_directory_is_named(tier: str, tmpfs_mount: Any) -> None:
    read_only = tmpfs_mount("ro,size=1m")
    with pytest.raises(RowStoreError, match=f"{read_only} is not writable.*read-only"):
        open_store(tier, read_only, "t", RowLayout(4, 2))


def test_immutable_directory_is_refused(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("chattr") is None:
        pytest.skip("needs root and chattr to make a directory root cannot write")
    target = tmp_path / "frozen"
    target.mkdir()
    if subprocess.run(["chattr", "+i", str(target)], capture_output=True).returncode != 0:
        pytest.skip("file system does not support the immutable attribute")
    try:
        with pytest.raises(RowStoreError, match=f"{target} is not writable"):
            open_store("dram", target, "t", RowLayout(4, 2))
    finally:
        subprocess.run(["chattr", "-i", str(target)], check=True)


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_full_device_is_reported_at_create(tier: str, tmpfs_mount: Any) -> None:
    small = tmpfs_mount("size=1m")
    layout = RowLayout(5000, 64)  # 1.28 MB of rows on a 1 MiB file system
    with pytest.raises(RowStoreError, match="device full") as err:
        open_store(tier, small, "big", layout)
    assert f"big.{tier}.rows" in str(err.value)
    assert list(small.iterdir()) == []  # the partial file is removed
    with open_store(tier, small, "fits", RowLayout(100, 8)) as store:  # space left is usable
        store.write_range(0, np.ones((100, 8), np.float32))


def _column_blocks(rng: np.random.Generator, slots: int, widths: list[int]) -> list[np.ndarray]:
    """Column blocks as a cache holds them: weights, then optimizer state; the first a strided
    view of a wider array (the compiled copies must not assume C order)."""
    wide = rng.standard_normal((slots, widths[0] + 3)).astype(np.float32)
    return [wide[:, 1 : 1 + widths[0]], *(np.zeros((slots, w), np.float32) for w in widths[1:])]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("blocks", [1, 2, 3], ids=["weights", "weights+state", "three-blocks"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "numpy"])
def test_rows_from_and_into_columns_are_write_rows_and_read_rows(
    make_store: StoreFactory,
    monkeypatch: pytest.MonkeyPatch,
    dtype: str,
    blocks: int,
    compiled: bool,
) -> None:
    if not compiled:
        monkeypatch.setattr("torchrec_mtrains.tiers.base.NUMBA_AVAILABLE", False)
    widths = {1: [7], 2: [5, 2], 3: [4, 2, 1]}[blocks]
    layout = RowLayout(300, widths[0], sum(widths[1:]), dtype)
    rng = np.random.default_rng(blocks)
    columns = _column_blocks(rng, 40, widths)
    for column in columns:
        column[...] = exact_rows(rng, 40, column.shape[1], dtype)
    ours, reference = make_store(layout, table="ours"), make_store(layout, table="reference")
    ids = rng.choice(300, 25, replace=False)
    at = rng.choice(40, 25, replace=False)
    ours.write_rows_from(ids, columns, at, distinct=True)
    reference.write_rows(ids, np.concatenate([c[at] for c in columns], axis=1))
    np.testing.assert_array_equal(ours.read_range(0, 300), reference.read_range(0, 300))
    assert (ours.stats.write_calls, ours.stats.rows_written) == (1, 25)
    assert ours.version == reference.version == 1

    back = [np.full_like(c, -1.0) for c in columns]
    into = rng.choice(40, 25, replace=False)
    ours.read_rows_into(ids, back, into)
    expected = [np.full_like(c, -1.0) for c in columns]
    for column, source in zip(expected, columns):
        column[into] = source[at]
    for got, want in zip(back, expected):
        np.testing.assert_array_equal(got, want)
    assert (ours.stats.read_calls, ours.stats.rows_read) == (2, 325)  # read_range and this

    ours.flush()
    ours.close()
    again = make_store(layout, table="ours", mode=OpenMode.OPEN)
    np.testing.assert_array_equal(again.read_range(0, 300), reference.read_range(0, 300))


def test_rows_from_columns_refuse_bad_input_naming_the_table(make_store: StoreFactory) -> None:
    layout = RowLayout(10, 3, 1)
    store = make_store(layout, table="emb_item")
    columns = [np.ones((4, 3), np.float32), np.ones((4, 1), np.float32)]
    with pytest.raises(ValueError, match=r"'emb_item'.*width 4"):
        store.write_rows_from([1], [columns[0]], [0])
    with pytest.raises(IndexError, match=r"'emb_item': column row 4 out of range \[0, 4\)"):
        store.write_rows_from([1, 2], columns, [0, 4])
    with pytest.raises(IndexError, match=r"'emb_item'.*column row -1"):
        store.read_rows_into([1], columns, [-1])
    with pytest.raises(IndexError, match=r"'emb_item': row id 10 out of range"):
        store.write_rows_from([10], columns, [0])
    with pytest.raises(ValueError, match=r"'emb_item'.*2 ids need as many"):
        store.write_rows_from([1, 2], columns, [0])
    with pytest.raises(ValueError, match="unique"):
        store.write_rows_from([1, 1], columns, [0, 1])
    assert store.stats.write_calls == store.stats.read_calls == 0
    np.testing.assert_array_equal(store.read_range(0, 10), np.zeros((10, 4), np.float32))


def test_the_compiled_copies_refuse_columns_that_do_not_fill_the_rows() -> None:
    rows, ids = np.zeros((4, 5), np.float32), np.arange(2, dtype=np.int64)
    narrow = [np.ones((3, 3), np.float32), np.ones((3, 1), np.float32)]  # 4 of 5 values
    assert not copy_rows_to_columns(rows, ids, narrow, ids)
    assert not copy_columns_to_rows(narrow, ids, rows, ids)
    assert not rows.any() and narrow[0].all()  # nothing copied either way
