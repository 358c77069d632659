"""The CUDA path: the tiered kernel's cache in HBM, its rows on a tier, beside TorchRec's FUSED
(HBM) and FUSED_UVM_CACHING tables, matches FUSED within 1e-6 after 50 steps.

Marked ``cuda``: skipped without a GPU (CI has none); ``pytest -m cuda`` on a GPU host."""

from __future__ import annotations

import itertools
from pathlib import Path

import parity_harness as h
import pytest
from test_parity import TIER_NAMES, check_result

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("one_rank_process_group")]


def _cases() -> list[h.ParityCase]:
    """EBC and EC x table- and column-wise x the three optimizers x the three tiers x next to
    FUSED and FUSED_UVM_CACHING; the cache size alternates between one batch and half way."""
    cases = []
    product = itertools.product(
        h.KINDS,
        ("table_wise", "column_wise"),
        h.OPTIMIZERS,
        TIER_NAMES,
        ("fused", "fused_uvm_caching"),
    )
    for i, (kind, sharding, optimizer, tier, other) in enumerate(product):
        cache = ("min", "mid")[i % 2]
        cases.append(
            h.ParityCase(kind, optimizer, sharding, tier, cache, device="cuda", other_kernel=other)
        )
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: c.id)
def test_hbm_cache_matches_torchrec(case: h.ParityCase, tmp_path: Path) -> None:
    result = h.run_case(case, 0, 1, tmp_path).as_dict()
    check_result(result)
    assert result["shards"], "the tiered table runs on this rank"
