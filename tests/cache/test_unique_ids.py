"""A batch's distinct ids, as the tier worker finds them: exactly ``np.unique``'s, with the
inverse, whatever the ids (few or many distinct, near 2**63, repeated, out of order)."""

from __future__ import annotations

import numpy as np
import pytest

from torchrec_mtrains.cache import kernels

needs_numba = pytest.mark.skipif(not kernels.NUMBA_AVAILABLE, reason="numba is not installed")


def _assert_numpys(ids: np.ndarray) -> None:
    uniq, inverse = kernels.unique_with_inverse(ids)
    want_uniq, want_inverse = np.unique(ids, return_inverse=True)
    assert uniq.dtype == inverse.dtype == np.int64
    np.testing.assert_array_equal(uniq, want_uniq)
    np.testing.assert_array_equal(inverse, want_inverse)
    np.testing.assert_array_equal(uniq[inverse], ids)


@needs_numba
@pytest.mark.parametrize("seed", range(40))
def test_distinct_ids_and_inverse_are_numpys(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.choice([1, 2, 7, 100, 4096, 16384, 40000]))
    top = int(rng.choice([2, 50, 2**11, 2**22, 2**40, 2**50, 2**63 - 1]))
    # every third seed skewed (most positions repeat a few ids), the others uniform
    skewed = seed % 3 == 0
    ids = ((rng.zipf(1.2, n) * 2654435761) % top if skewed else rng.integers(0, top, n)).astype(
        np.int64
    )
    if seed % 5 == 0:  # digit boundaries of the radix sort, and the largest id
        ids[: min(n, 4)] = [top, 2**11 - 1, 2**11, 2**63 - 1][: min(n, 4)]
    _assert_numpys(ids)


@needs_numba
def test_empty_negative_and_strided_ids_are_numpys() -> None:
    _assert_numpys(np.empty(0, dtype=np.int64))
    _assert_numpys(np.array([5, -3, 5, 0, -3], dtype=np.int64))  # numpy's, for a negative id
    _assert_numpys(np.arange(100, dtype=np.int64)[::-3])  # not contiguous
    _assert_numpys(np.full(1000, 2**40 + 1, dtype=np.int64))  # one id repeated


def test_without_numba_it_is_numpys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "NUMBA_AVAILABLE", False)
    _assert_numpys(np.array([9, 2, 9, 2**45, 0], dtype=np.int64))
