"""Virtual tables on CUDA: the cache in HBM and the rows on each tier, beside TorchRec's FUSED
table in HBM, within 1e-6 of it at every step (:mod:`tests.distributed.virtual_harness`),
with each of TorchRec's eviction policies, evaluation, reloads and checkpoint chains.

Marked ``cuda``: skipped without a GPU (CI has none); ``pytest -m cuda`` on a GPU host. The
same cases run on the CPU in ``test_virtual_tables.py`` and ``test_virtual_checkpoints.py``.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from tests.distributed.virtual_harness import VirtualCase, run_case
from tests.torchrec_releases import needs_bucketed_row_wise

pytestmark = [pytest.mark.cuda, pytest.mark.usefixtures("one_rank_process_group")]

STORES = ["dram", "byte_scm", "block_scm", "log_block_scm"]
EVICTIONS = ["none", "count", "ttl", "mixed", "l2", "score"]
# (TorchRec's trigger count, max_live_rows): rounds when full, and rounds TorchRec's trigger
# starts; both evict within 20 steps (as on the CPU)
BOUNDS = [(0, 200), (60, 220)]


def cases(device: str = "cuda") -> list[VirtualCase]:
    """EBC (weighted or not) and EC x every eviction policy, the store and the bound turning
    with them; then a reload from state dicts, one from a checkpoint chain and evaluations
    between the steps."""
    out = []
    kinds = [("ebc", False), ("ebc", True), ("ec", False)]
    for i, ((kind, weighted), eviction) in enumerate(itertools.product(kinds, EVICTIONS)):
        trigger, bound = BOUNDS[i % 2] if eviction != "none" else (0, 260)
        out.append(
            VirtualCase(
                store=STORES[i % len(STORES)],
                kind=kind,
                weighted=weighted,
                eviction=eviction,
                trigger=trigger,
                max_live_rows=bound,
                steps=20 if eviction != "none" else 12,
                device=device,
            )
        )
    evicting = VirtualCase(eviction="count", trigger=60, max_live_rows=220, steps=20, device=device)
    out += [
        dataclasses.replace(evicting, reload_at=10),
        dataclasses.replace(evicting, reload_at=10, reload_from="chain"),
        dataclasses.replace(evicting, evaluate_every=4, store="byte_scm"),
    ]
    return out


def _check(case: VirtualCase, tmp_path: Path) -> None:
    result = run_case(case, 0, 1, tmp_path)
    assert result.mismatched_step is None, (case.id, result.largest_diff)
    (stats,) = result.stats.values()
    assert stats["live_rows"] <= case.max_live_rows, stats
    if not case.reload_at:  # (a reloaded model counts from its load)
        assert stats["rows_made"] == stats["live_rows"] + stats["rows_evicted"], stats
    if case.eviction == "none":
        assert stats["rows_evicted"] == 0 and stats["live_rows"] > 100, stats
    else:
        assert stats["rows_evicted"] > 0 and stats["eviction_rounds"] > 0, stats
    assert result.untrained_live == 0  # evaluations made no rows


@pytest.mark.parametrize("case", cases(), ids=lambda c: c.id)
def test_a_virtual_table_on_cuda_trains_as_fused(case: VirtualCase, tmp_path: Path) -> None:
    _check(case, tmp_path)


@needs_bucketed_row_wise
@pytest.mark.parametrize(
    "case",
    [
        VirtualCase(sharding="rw", device="cuda"),
        VirtualCase(
            sharding="rw",
            eviction="score",
            weighted=True,
            max_live_rows=200,
            steps=20,
            device="cuda",
        ),
    ],
    ids=lambda c: c.id,
)
def test_row_wise_with_torchrecs_buckets_on_cuda(case: VirtualCase, tmp_path: Path) -> None:
    _check(case, tmp_path)
