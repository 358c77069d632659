"""Fixtures for the tier tests: a store factory per tier variant, small tmpfs mounts (root)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from tier_helpers import STORE_CASES, STORE_IDS, StoreFactory

from torchrec_mtrains.tiers import OpenMode, RowStore, open_store
from torchrec_mtrains.types import RowLayout


@pytest.fixture(params=STORE_CASES, ids=STORE_IDS)
def store_case(request: pytest.FixtureRequest) -> tuple[str, dict[str, Any]]:
    tier, options = request.param
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
