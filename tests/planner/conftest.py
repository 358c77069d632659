"""Fixtures of the planner tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture
def process_group(one_rank_process_group: None) -> Iterator[None]:
    """A one-rank group for DistributedModelParallel (the suite's shared fixture)."""
    yield
