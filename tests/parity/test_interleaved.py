"""Regression: a module whose tables switch between tiered and resident (FUSED) more than once
(T F T, F T F, ...) returns its output in TorchRec's order and trains exactly as TorchRec's FUSED
kernel does.

The tiered sharded modules once left TorchRec's groups as TorchRec made them with the tiered
tables on their own kernel: the tiered group and the FUSED group, each in one block. Features
and output columns then came in group order (T, T, F for a module T, F, T) where the FUSED model
returns module order, and a model reading the ``KeyedTensor``'s ``values()`` by position (every
loss here does) trained each table's columns against another table's weights. Orders that switch
at most once (T F, T T F F, ...) were exact, which is why the earlier parity suite missed it.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.parity.cases import SweepCase, TableDraw
from tests.parity.sweep import run_case

TIER_CYCLE = ("block_scm", "byte_scm", "dram")


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """One rank."""


def _case(
    pattern: str,
    kind: str = "ebc",
    sharding: str = "table_wise",
    rows: tuple[int, ...] = (),
    **kwargs: object,
) -> SweepCase:
    """Tables in ``pattern``'s order (``T`` tiered, cycling tiers; ``F`` FUSED), dim 16 (8 for
    column-wise shards), one feature each, small caches."""
    tables = []
    for i, kind_of in enumerate(pattern):
        tables.append(
            TableDraw(
                name=f"t_{chr(ord('a') + i)}",
                rows=rows[i] if rows else 200 + 100 * i,
                dim=16,
                features=(f"f_{i}",),
                placement=TIER_CYCLE[i % 3] if kind_of == "T" else "fused",
                sharding=sharding,
                cache=0.2,
            )
        )
    defaults: dict[str, object] = {"batch": 16, "max_ids": 6, "steps": 12, "seed": 7}
    defaults.update(kwargs)
    return SweepCase(kind=kind, tables=tuple(tables), **defaults)  # type: ignore[arg-type]


def _assert_exact(case: SweepCase, tmp_path: Path) -> None:
    outcome = run_case(case, 0, tmp_path / "tiers")
    assert outcome.status == "ok", "\n".join([case.describe(), *outcome.details])


ALL_PATTERNS = [
    "".join(p) for n in range(1, 5) for p in itertools.product("TF", repeat=n) if "T" in p
]
SWITCHING = ["FTF", "TFT", "FTFT", "TFTF"]


@pytest.mark.parametrize("pattern", ALL_PATTERNS)
def test_every_placement_order_of_one_to_four_tables(pattern: str, tmp_path: Path) -> None:
    _assert_exact(_case(pattern), tmp_path)


@pytest.mark.parametrize("pattern", SWITCHING)
@pytest.mark.parametrize(
    "variant",
    [
        {"weighted": True},
        {"vbe": True},
        {"pooling": "mean"},
        {"kind": "ec"},
        {"sharding": "column_wise"},
        {"sharding": "row_wise"},
        {"optimizer": "sgd", "loop": "lookahead"},
        {"optimizer": "adagrad", "loop": "torchrec"},
    ],
    ids=lambda v: "-".join(f"{k}={val}" for k, val in v.items()),
)
def test_switching_orders_in_every_module_kind(
    pattern: str, variant: dict[str, object], tmp_path: Path
) -> None:
    _assert_exact(_case(pattern, **variant), tmp_path)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "rows"),
    [
        ("TFT", (1000, 500, 800)),  # t_a block, t_m FUSED, t_b block
        ("FTFTF", (300, 1000, 500, 800, 50)),  # t_n, t_a byte, t_m, t_b block, t_z
    ],
)
def test_the_reported_models(pattern: str, rows: tuple[int, ...], tmp_path: Path) -> None:
    """The two models the bug was reported with: 30 steps of batch 16, 2-6 ids a sample."""
    _assert_exact(_case(pattern, rows=rows, steps=30), tmp_path)


def test_a_one_row_fused_table_between_tiered_ones_with_sgd(tmp_path: Path) -> None:
    _assert_exact(_case("TFT", rows=(1000, 1, 800), optimizer="sgd", steps=30), tmp_path)


def test_the_apps_placement_pattern(tmp_path: Path) -> None:
    """The DLRM app's default plan: 26 tables, t_cat_2, 3, 11, 15, 20 and 23 tiered."""
    tiered = {2, 3, 11, 15, 20, 23}
    pattern = "".join("T" if i in tiered else "F" for i in range(26))
    _assert_exact(_case(pattern, rows=tuple(50 + 7 * i for i in range(26))), tmp_path)
