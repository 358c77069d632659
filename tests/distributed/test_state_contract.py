"""The tensors a tiered model's ``state_dict()`` and fused optimizer hand out behave as TorchRec's
FUSED kernel's do, which alias its weights: what users write into them in place reaches the
table (tier and cache) before the next forward, state dict or checkpoint.

Each row of the table users met (one rank, one 1,000-row table beside a FUSED one, its cache
the smallest that trains) is a schedule the parity sweep runs on TorchRec's FUSED kernel and on
the tiered model, compared bit for bit (losses of every step, then weights and optimizer state),
on every tier and block layout; see :data:`tests.parity.cases.OPS` for what each op does.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import pytest
import torch

from tests.parity.cases import SweepCase, TableDraw
from tests.parity.sweep import Outcome, build, run_case, set_weights, train, write_state
from torchrec_mtrains.pipeline import tiered_groups
from torchrec_mtrains.tiers import FileHeader
from torchrec_mtrains.tiers.base import HEADER_BYTES

# (tier, block layout)
STORES = [("dram", "flat"), ("byte_scm", "flat"), ("block_scm", "flat"), ("block_scm", "log")]
STORE_IDS = ["dram", "byte_scm", "block_flat", "block_log"]

ROWS_OF_THE_TABLE = {
    # a fresh model: write into the local shards of state_dict() in place, then train
    "fresh_write": ("write:11:weights", "train:3"),
    # the same, every part: weights and optimizer state, and a quarter of the rows only
    "fresh_write_all": ("write:12:all", "train:2", "write:13:some", "train:2"),
    # a fresh model: dcp.load into its state dicts, nothing after
    "fresh_dcp_in_place": ("train:2", "save:dcp", "load:fresh:1:inplace", "train:3"),
    # a trained model (its rows in the cache): the same
    "trained_dcp_in_place": ("train:3", "save:dcp", "train:3", "load:same:1:inplace", "train:3"),
    # either, then load_state_dict
    "fresh_dcp_then_load": ("train:2", "save:dcp", "load:fresh:1:load_state_dict", "train:2"),
    "trained_dcp_then_load": (
        "train:3",
        "save:dcp",
        "train:2",
        "load:same:1:load_state_dict",
        "train:2",
    ),
    # a trained model: write in place, change the learning rate, train on
    "trained_write": ("train:3", "write:14:all", "lr:0.02", "train:3"),
    # this package's checkpoints, loaded into the same and into a fresh model
    "incremental_chain": (
        "train:2",
        "save:full",
        "train:2",
        "write:15:some",
        "save:inc",
        "train:2",
        "load:fresh:1:inplace",
        "train:2",
    ),
}


def _case(tier: str, layout: str, ops: tuple[str, ...], **kwargs: object) -> SweepCase:
    return SweepCase(
        optimizer=str(kwargs.pop("optimizer", "rowwise_adagrad")),
        block_layout=layout,
        batch=8,
        max_ids=3,
        seed=37,
        ops=ops,
        tables=(
            TableDraw("t_tier", 1000, 8, ("f0", "f1"), placement=tier, cache=0.0),
            TableDraw("t_fused", 200, 8, ("f2",)),
        ),
        **kwargs,  # type: ignore[arg-type]
    )


def _assert_exact(outcome: Outcome) -> None:
    assert outcome.status == "ok", "\n".join([outcome.status, *outcome.details])


@pytest.fixture(scope="module", autouse=True)
def _process_group(one_rank_process_group: None) -> None:
    """One rank, in this process."""


@pytest.mark.parametrize("row", sorted(ROWS_OF_THE_TABLE))
@pytest.mark.parametrize(("tier", "layout"), STORES, ids=STORE_IDS)
def test_writes_into_state_dicts_reach_the_table(
    tmp_path: Path, tier: str, layout: str, row: str
) -> None:
    _assert_exact(run_case(_case(tier, layout, ROWS_OF_THE_TABLE[row]), 0, tmp_path))


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("sharding", ["column_wise", "row_wise"])
@pytest.mark.parametrize(("tier", "layout"), STORES, ids=STORE_IDS)
def test_checkpoints_of_a_table_in_shards_on_one_rank(
    tmp_path: Path, tier: str, layout: str, sharding: str, optimizer: str
) -> None:
    """A column-wise table puts two shards on the one rank (a full checkpoint of a log kept
    the first alone), and TorchRec lists a row-wise state's rows once per column shard (a
    log's checkpoints put them all at the first shard's rows)."""
    case = _case(tier, layout, ROWS_OF_THE_TABLE["incremental_chain"], optimizer=optimizer)
    tables = (dataclasses.replace(case.tables[0], sharding=sharding, dim=16), case.tables[1])
    _assert_exact(run_case(dataclasses.replace(case, tables=tables), 0, tmp_path))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize(("tier", "layout"), STORES, ids=STORE_IDS)
def test_fp16_tables_train_as_fused_does(
    tmp_path: Path, tier: str, layout: str, optimizer: str
) -> None:
    """fp16 weights, fp32 optimizer state (as fbgemm keeps it), through a checkpoint too."""
    ops = ("train:4", "save:full", "train:2", "load:fresh:1:inplace", "train:4")
    _assert_exact(
        run_case(_case(tier, layout, ops, dtype="fp16", optimizer=optimizer), 0, tmp_path)
    )


@pytest.mark.parametrize(("tier", "layout"), STORES, ids=STORE_IDS)
def test_an_fp16_tables_file_says_fp16_weights_and_fp32_state(
    tmp_path: Path, tier: str, layout: str
) -> None:
    case = _case(tier, layout, (), dtype="fp16", optimizer="adagrad")
    model = build(case, tmp_path / "tiers")
    (shard,) = tiered_groups(model)[0].shards
    header = FileHeader.unpack(shard.store.path.read_bytes()[:HEADER_BYTES], shard.store.path)
    assert (header.dtype, header.state_dtype) == ("fp16", "fp32")
    assert header.row_bytes == 8 * 2 + 8 * 4  # 8 fp16 weights, 8 fp32 Adagrad sums


@pytest.mark.parametrize(("tier", "layout"), STORES, ids=STORE_IDS)
def test_a_state_dict_taken_before_training_is_written_with_a_warning(
    tmp_path: Path, tier: str, layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A whole table written through tensors taken before later steps: the write wins, as
    with FUSED, and the user is told the rows those steps trained cannot be told apart."""
    case = _case(tier, layout, ())
    ref, tie = build(case, None), build(case, tmp_path / "tiers")
    set_weights(ref, case)
    tie.load_state_dict(ref.state_dict())
    held = [model.state_dict() for model in (ref, tie)]
    for model in (ref, tie):
        train(model, case, 0, "plain", range(3))
    caplog.set_level(logging.WARNING)
    for model in (ref, tie):
        write_state(model, case, 21, "weights", state=held.pop(0))
    losses = [train(model, case, 0, "plain", range(3, 6)) for model in (ref, tie)]
    assert losses[0] == losses[1]
    # Said as the next step took the write in.
    assert "table 't_tier': its weights were written through tensors" in caplog.text


def test_writes_through_data_are_not_seen_but_load_state_dict_stores_them(
    tmp_path: Path,
) -> None:
    """``.data`` (and numpy views) bypass the version counters the tier watches: documented;
    ``load_state_dict`` of the same state dict afterwards stores them."""
    case = _case("block_scm", "log", ())
    tie = build(case, tmp_path / "tiers")
    state = tie.state_dict()
    weights = state["emb.embedding_bags.t_tier.weight"]
    with torch.no_grad():
        for shard in weights.local_shards():
            shard.tensor.data.fill_(0.5)
    group = tiered_groups(tie)[0]
    assert group.views.written(0) == []
    tie.load_state_dict(state)
    shard = group.shards[0]
    assert float(shard.store.read_rows([7])[0, 0]) == 0.5
