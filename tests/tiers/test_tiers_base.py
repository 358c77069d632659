"""The registry, the file header and the error helpers of ``tiers.base``."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import ClassVar

import numpy as np
import pytest

from torchrec_mtrains.tiers import TIERS, FileHeader, HeaderMismatchError, open_store, register_tier
from torchrec_mtrains.tiers.base import contiguous_start, os_error
from torchrec_mtrains.tiers.dram import DramStore
from torchrec_mtrains.types import RowLayout, StorageDType


def test_builtin_tiers_are_registered() -> None:
    assert {"dram", "byte_scm", "block_scm"} <= set(TIERS)
    for name, cls in TIERS.items():
        assert cls.name == name


def test_registry_view_is_read_only() -> None:
    with pytest.raises(TypeError):
        TIERS["mine"] = DramStore  # type: ignore[index]


def test_register_refuses_duplicates_unless_clobber() -> None:
    class Impostor(DramStore):
        name: ClassVar[str] = "dram"

    with pytest.raises(ValueError, match="'dram' is already registered to DramStore"):
        register_tier(Impostor)
    assert TIERS["dram"] is DramStore
    register_tier(DramStore)  # the same class again is harmless
    try:
        assert register_tier(Impostor, clobber=True) is Impostor
        assert TIERS["dram"] is Impostor
    finally:
        register_tier(DramStore, clobber=True)
    assert TIERS["dram"] is DramStore


def test_register_needs_a_name() -> None:
    class Nameless(DramStore):
        name: ClassVar[str] = ""

    with pytest.raises(ValueError, match="non-empty class attribute 'name'"):
        register_tier(Nameless)
    assert "" not in TIERS


def test_open_store_names_the_known_tiers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown tier 'tape'.*block_scm, byte_scm, dram"):
        open_store("tape", tmp_path, "t", RowLayout(4, 2))
    store = open_store("dram", tmp_path, "t", RowLayout(4, 2))
    assert isinstance(store, DramStore)
    store.close()


def test_header_round_trip_and_mismatch_listing(tmp_path: Path) -> None:
    layout = RowLayout(10, 3, 1, StorageDType.FP16)
    header = FileHeader.for_layout("byte_scm", layout, 8192)
    raw = header.pack()
    assert len(raw) == 4096  # its block; the file's zeros lie between it and the data
    assert FileHeader.unpack(raw, tmp_path / "f") == header
    other = FileHeader.for_layout("byte_scm", RowLayout(11, 3, 1, "fp32"), 8192)
    with pytest.raises(HeaderMismatchError, match=r"num_rows: file has 10, expected 11.*dtype"):
        header.check_matches(other, tmp_path / "f")
    with pytest.raises(ValueError, match="longer than 16 bytes"):
        FileHeader.for_layout("x" * 17, layout).pack()


def test_os_errors_say_what_happened(tmp_path: Path) -> None:
    path = tmp_path / "t.rows"
    full = os_error(path, OSError(errno.ENOSPC, "No space"), "writing")
    assert str(full) == f"{path}: device full while writing: no space left on the device"
    assert "read-only file system" in str(os_error(path, OSError(errno.EROFS, "x"), "creating"))
    assert str(os_error(path, OSError(errno.EIO, "I/O error"), "reading")).endswith(
        "reading failed: I/O error"
    )


def test_contiguous_start_detects_ranges_only() -> None:
    def ids(*values: int) -> np.ndarray:
        return np.array(values, dtype=np.int64)

    assert contiguous_start(ids(4, 5, 6)) == 4
    assert contiguous_start(ids(9)) == 9
    assert contiguous_start(ids()) is None
    assert contiguous_start(ids(4, 6, 6)) is None  # same span, not a range
    assert contiguous_start(ids(6, 5, 4)) is None
    assert contiguous_start(ids(1, 3, 2)) is None
