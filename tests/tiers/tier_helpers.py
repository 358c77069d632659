"""Helpers shared by the tier tests (a plain module: conftest.py is not meant for imports)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import numpy as np

from torchrec_mtrains.tiers import RowStore, _uring

# (tier, options): every backend, plus block variants covering every engine (the default is
# io_uring where the kernel offers it), a small block and a block larger than the 4 KiB header.
STORE_CASES: list[tuple[str, dict[str, Any]]] = [
    ("dram", {}),
    ("byte_scm", {}),
    ("block_scm", {}),
    ("block_scm", {"engine": "threads", "block_size": 512}),
    ("block_scm", {"engine": "aio", "block_size": 8192, "queue_depth": 4}),
    ("block_scm", {"engine": "uring", "block_size": 1024, "queue_depth": 3}),
]
STORE_IDS = [
    "dram",
    "byte_scm",
    "block_scm",
    "block_scm-threads-512",
    "block_scm-aio-8192",
    "block_scm-uring-1024",
]
TIER_NAMES = ["dram", "byte_scm", "block_scm"]


@cache
def uring_refusal() -> str | None:
    """Why this kernel refuses io_uring (a reason to skip a test that names it), or None."""
    try:
        _uring.Ring(1).close()
    except OSError as e:
        return f"io_uring unavailable here: {e}"
    return None


StoreFactory = Callable[..., RowStore]


def exact_rows(rng: np.random.Generator, n: int, width: int, dtype: str) -> np.ndarray:
    """Random float32 rows exactly representable in ``dtype``, so round trips compare equal."""
    rows = rng.standard_normal((n, width)).astype(np.float32)
    return rows.astype(np.float16).astype(np.float32) if dtype == "fp16" else rows
