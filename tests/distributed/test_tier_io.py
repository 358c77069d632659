"""The tier worker's row copies between a cache's slots and tier rows: the compiled copies
(float32 slots in host memory) give what torch's ``index_select`` / ``index_copy_`` give, and a
slot out of range is refused with nothing written."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from torchrec_mtrains.cache import kernels
from torchrec_mtrains.distributed.tier_io import TierIOWorker

pytestmark = pytest.mark.skipif(not kernels.NUMBA_AVAILABLE, reason="compares numba's copies")


def _shard(dtype: torch.dtype = torch.float32, slots: int = 50, cols: int = 8) -> Any:
    g = torch.Generator().manual_seed(0)
    weights = torch.rand(slots, cols, generator=g).to(dtype)
    states = [torch.rand(slots, 1, generator=g), torch.rand(slots, 3, generator=g)]
    return SimpleNamespace(name="t", weight_slots=weights, state_slots=states, cols=cols)


def _copy(shard: Any) -> Any:
    return SimpleNamespace(
        name=shard.name,
        weight_slots=shard.weight_slots.clone(),
        state_slots=[s.clone() for s in shard.state_slots],
        cols=shard.cols,
    )


def _tensors(shard: Any) -> list[torch.Tensor]:
    return [shard.weight_slots, *shard.state_slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_compiled_copies_are_torchs(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    compiled = _shard(dtype)
    reference = _copy(compiled)
    for _ in range(20):
        slots = torch.from_numpy(rng.permutation(50)[: int(rng.integers(0, 50))].astype(np.int64))
        rows = torch.from_numpy(rng.random((len(slots), 12), dtype=np.float32))
        TierIOWorker.scatter(compiled, slots, rows)
        got = TierIOWorker.gather(compiled, slots)
        with monkeypatch.context() as m:
            m.setattr(kernels, "NUMBA_AVAILABLE", False)
            TierIOWorker.scatter(reference, slots, rows)
            want = TierIOWorker.gather(reference, slots)
        assert got.dtype == want.dtype == np.float32 and np.array_equal(got, want)
        for a, b in zip(_tensors(compiled), _tensors(reference)):
            assert torch.equal(a, b)
    assert dtype != torch.float32 or np.array_equal(got[:, :8], rows.numpy()[:, :8])


def test_a_slot_out_of_range_is_refused_with_nothing_written() -> None:
    shard = _shard()
    before = [t.clone() for t in _tensors(shard)]
    rows = torch.ones(3, 12)
    for bad in ([1, 2, 50], [-1, 0, 3]):
        with pytest.raises(IndexError, match=r"table 't': slot out of range \[0, 50\)"):
            TierIOWorker.scatter(shard, torch.tensor(bad), rows)
        with pytest.raises(IndexError, match="slot out of range"):
            TierIOWorker.gather(shard, torch.tensor(bad))
    for a, b in zip(_tensors(shard), before):
        assert torch.equal(a, b)
