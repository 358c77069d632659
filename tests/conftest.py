"""Fixtures and markers shared by the whole suite.

CUDA tests carry ``@pytest.mark.cuda``: ``pytest -m cuda`` runs just them, and without a GPU
(CI has none) they are skipped with the reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from torchrec_mtrains.distributed.runtime import process_group


def test_backend() -> str:
    """gloo for CPU tensors, and NCCL for CUDA tensors where a GPU is visible, in one group."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


test_backend.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def one_rank_process_group() -> Iterator[None]:
    """A one-rank process group for DistributedModelParallel, for a whole test module (kept if
    one already exists)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    with process_group(device, backend=test_backend()):
        yield


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test: tiny ops on a shared 2-core machine run far faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(
        reason="needs CUDA (no GPU visible); run `pytest -m cuda` on a GPU host"
    )
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
