"""The tier worker's row copies between a cache's slots and tier rows: host float32 slots move
by the stores' compiled copies, other slots by torch's; both put and take the same values."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from torchrec_mtrains.distributed.tier_io import TierIOWorker
from torchrec_mtrains.tiers import open_store
from torchrec_mtrains.types import RowLayout


def _shard(tmp_path: Path, dtype: torch.dtype, tier: str = "byte_scm") -> Any:
    g = torch.Generator().manual_seed(0)
    slots, dim = 30, 6
    weights = torch.rand(slots, dim + 2, generator=g).to(dtype)[:, 1 : 1 + dim]  # strided
    state = torch.rand(slots, 1, generator=g)
    store = open_store(tier, tmp_path, f"t_{tier}_{str(dtype)[6:]}", RowLayout(100, dim, 1))
    return SimpleNamespace(
        name="t", weight_slots=weights, state_slots=[state], cols=dim, store=store
    )


@pytest.mark.parametrize("tier", ["dram", "byte_scm", "block_scm"])
def test_host_float32_slots_move_as_torch_moves_other_slots(tmp_path: Path, tier: str) -> None:
    fast, slow = _shard(tmp_path, torch.float32, tier), _shard(tmp_path, torch.float64, tier)
    rows = torch.rand(5, 7, generator=torch.Generator().manual_seed(1))
    slots = torch.tensor([3, 0, 29, 7, 12])
    for shard in (fast, slow):
        TierIOWorker.scatter(shard, slots, rows)
        np.testing.assert_array_equal(shard.weight_slots[slots].float().numpy(), rows[:, :6])
        np.testing.assert_array_equal(shard.state_slots[0][slots].numpy(), rows[:, 6:])
    ids = torch.tensor([99, 4, 50, 0, 61])
    for shard in (fast, slow):
        TierIOWorker.write_back(shard, ids, slots)
        np.testing.assert_array_equal(shard.store.read_rows(ids.numpy()), rows.numpy())
        shard.store.close()


def test_a_slot_out_of_range_is_refused_naming_the_table(tmp_path: Path) -> None:
    shard = _shard(tmp_path, torch.float32)
    before = shard.weight_slots.clone()
    with pytest.raises(IndexError, match=r"'t': a slot outside \[0, 30\)"):
        TierIOWorker.scatter(shard, torch.tensor([1, 30]), torch.ones(2, 7))
    assert torch.equal(shard.weight_slots, before)  # nothing written
    shard.store.close()
    assert not shard.store.rows_in_memory  # a closed store reads through its own error
