"""Fixtures for the tier tests: a store factory per tier variant, small tmpfs mounts (root)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tier_helpers import STORE_CASES, STORE_IDS, StoreFactory, uring_refusal

from torchrec_mtrains.tiers import OpenMode, RowStore, open_store
from torchrec_mtrains.types import RowLayout

# The log-structured tier runs the shared tests too (tests/tiers/test_tiers_log_block_scm.py
# covers what is its own), with a small block and segment variant that compacts sooner.
LOG_CASES: list[tuple[str, dict[str, Any]]] = [
    ("log_block_scm", {}),
    ("log_block_scm", {"engine": "threads", "block_size": 512, "segment_bytes": 2048}),
    ("log_block_scm", {"engine": "aio", "queue_depth": 5}),
]
LOG_IDS = ["log_block_scm", "log_block_scm-threads-512", "log_block_scm-aio"]
# Shared tests of a contract the log tier does not offer: its rows live in segments, not at
# data_offset + i * row_bytes (reads go through the store; mapped_rows() is None).
FLAT_FILE_TESTS = {"test_file_is_the_flat_row_array_after_close"}


@pytest.fixture(params=STORE_CASES + LOG_CASES, ids=STORE_IDS + LOG_IDS)
def store_case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    tier, options = request.param
    if options.get("engine") == "uring" and uring_refusal():
        pytest.skip(uring_refusal())
    if tier == "log_block_scm":
        # Registered here, when a test runs, not at collection: tests elsewhere parametrize
        # over the registry as the tiers the distributed layer can use, which it is not yet.
        import torchrec_mtrains.tiers.log_block_scm  # noqa: F401

        if request.node.originalname in FLAT_FILE_TESTS:
            pytest.skip("log_block_scm files are a log of segments, not the flat row array")
    return tier, dict(options)


@pytest.fixture
def make_store(tmp_path: Path, store_case: tuple[str, dict[str, Any]]) -> Iterator[StoreFactory]:
    """Opens stores of the case's tier in ``tmp_path``; closes whatever is left open."""
    tier, base_options = store_case
    opened: list[RowStore] = []

    def factory(
        layout: RowLayout, table: str = "t", mode: OpenMode | str = OpenMode.OPEN_OR_CREATE
    ) -> RowStore:
        store = open_store(tier, tmp_path, table, layout, mode=mode, options=base_options)
        opened.append(store)
        return store

    yield factory
    for store in opened:
        store.close()


def _mount(target: Path, options: str) -> str | None:
    """Mounts a tmpfs at ``target``; returns why not, or ``None`` on success."""
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    target.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        return f"mount -t tmpfs -o {options} failed: {done.stderr.strip()}"
    return None


@pytest.fixture
def tmpfs_mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mounts small tmpfs file systems under ``tmp_path`` (skips the test where it cannot)."""
    mounted: list[Path] = []

    def mount(options: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        reason = _mount(target, options)
        if reason is not None:
            pytest.skip(reason)
        mounted.append(target)
        return target

    yield mount
    for target in reversed(mounted):
        subprocess.run(["umount", "-l", str(target)], check=False, capture_output=True)
