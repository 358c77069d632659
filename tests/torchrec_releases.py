"""What the installed TorchRec offers, for tests that also run on the GPU host's older release
(TorchRec 1.6.1: CONTRIBUTING.md)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from torchrec.distributed.sharding_plan import row_wise

# TorchRec 1.8 added row_wise(num_buckets=...): shards of whole buckets of a virtual table.
BUCKETED_ROW_WISE = "num_buckets" in inspect.signature(row_wise).parameters

needs_bucketed_row_wise = pytest.mark.skipif(
    not BUCKETED_ROW_WISE,
    reason="a bucketized row-wise plan needs TorchRec's row_wise(num_buckets=...), new in 1.8",
)


def row_wise_plan(compute_kernel: str, num_buckets: int | None = None) -> Any:
    """TorchRec's ``row_wise`` generator, bucketized when ``num_buckets`` is given (which only
    TorchRec 1.8 and later accept)."""
    if num_buckets is None:
        return row_wise(compute_kernel=compute_kernel)
    return row_wise(compute_kernel=compute_kernel, num_buckets=num_buckets)
