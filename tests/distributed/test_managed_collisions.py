"""TorchRec's managed-collision modules (raw ids remapped into a fixed table) with this project's
sharder underneath: ``ManagedCollision{EmbeddingBag,Embedding}CollectionSharder`` over ours,
row-wise, the remapped table on a tier (see :mod:`tests.distributed.mc_harness`).

Each id the module places in a slot makes it reset that row (fbgemm's
``reset_embedding_weight_momentum`` on the kernel's module: weights and row-wise momentum to
zero) and then write the row through the table's ``weight`` (``weight[slots] =
init_fn(weight[slots])``). Parity is against the same module sharded by TorchRec's own
sharders (FUSED), whose reset on CPU is the harness's (fbgemm has none there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torchrec.datasets.utils import Batch

from tests.distributed.mc_harness import (
    DIM,
    STORES,
    TABLE,
    MCCase,
    build,
    kjt,
    local_rows,
    momentum,
    run_case,
    spawn_cases,
    train,
    weight_key,
)
from torchrec_mtrains.distributed.tier_rows_param import TierRowsParameter
from torchrec_mtrains.distributed.tiered_tables import TableIdError, TieredTableGroup
from torchrec_mtrains.pipeline import LookaheadTrainPipeline

pytestmark = pytest.mark.usefixtures("one_rank_process_group", "one_thread")

CASE = MCCase()  # 40 slots, a cache of 20, 40 steps
ROWS = CASE.zch_size


@pytest.mark.parametrize("kind", ["ebc", "ec"])
@pytest.mark.parametrize("store", STORES)
def test_evictions_reset_rows_on_the_tiers_as_on_torchrecs_fused_kernel(
    store: str, kind: str, tmp_path: Path
) -> None:
    case = MCCase(kind=kind, store=store)
    assert run_case(case, 0, tmp_path)["mismatched_step"] is None


def test_the_reference_hands_slots_to_new_ids_again_and_again(tmp_path: Path) -> None:
    """What the parity above rests on: the module resets rows often, more rows than the cache
    of ours holds."""
    reference = build(CASE, None)
    calls: list[int] = []
    ((tbe, _),) = reference.module.mc._table_to_tbe_and_index.values()
    reset = tbe.reset_embedding_weight_momentum

    def counted(*args: Any, **kwargs: Any) -> None:
        calls.append(int(kwargs["pruned_indices"].numel()))
        reset(*args, **kwargs)

    tbe.reset_embedding_weight_momentum = counted
    train(reference, CASE)
    assert len(calls) > 5 and sum(calls) > ROWS


def test_a_reset_that_keeps_the_momentum_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison can fail: with the rows' momentum left as it was, a step differs."""
    set_rows = TieredTableGroup.set_rows

    def keeps_momentum(self: TieredTableGroup, *args: Any, **kwargs: Any) -> None:
        set_rows(self, *args, **{**kwargs, "zero_states": False})

    monkeypatch.setattr(TieredTableGroup, "set_rows", keeps_momentum)
    assert run_case(CASE, 0, tmp_path)["mismatched_step"] is not None


def test_other_optimizers_reset_nothing_but_the_rows_written(tmp_path: Path) -> None:
    """Under SGD and Adagrad fbgemm's reset does nothing."""
    for optimizer in ("sgd", "adagrad"):
        case = MCCase(optimizer=optimizer, steps=30)
        assert run_case(case, 0, tmp_path / optimizer)["mismatched_step"] is None


def test_row_wise_over_two_ranks(tmp_path: Path) -> None:
    # Each rank's cache holds 30 of its 40 slots: a batch from both ranks can bring 32 ids.
    case = MCCase(store="byte_scm", cache_load_factor=0.75, steps=30, world_size=2)
    for results in spawn_cases([case], tmp_path):
        assert [r["error"] for r in results] == [None]
        assert results[0]["mismatched_step"] is None


def test_the_tables_weight_reads_and_sets_rows_where_they_live(tmp_path: Path) -> None:
    ours = build(MCCase(steps=10), tmp_path)
    train(ours, MCCase(steps=10))
    weight = ours.module.mc._embedding_module.embedding_bags.get_parameter(f"{TABLE}.weight")
    assert isinstance(weight, TierRowsParameter) and weight.shape == (ROWS, DIM)
    key = weight_key(CASE)
    everything = local_rows(ours.state_dict()[key])
    assert torch.equal(weight[torch.arange(ROWS)], everything)
    assert torch.equal(weight[3], everything[3]) and torch.equal(weight[-1], everything[-1])
    assert torch.equal(weight[5:9], everything[5:9])
    with torch.no_grad():
        weight[torch.tensor([0, 7, ROWS - 1])] = torch.full((3, DIM), 0.5)
        weight.data[[1]] = torch.ones(1, DIM)
    after = local_rows(ours.state_dict()[key])
    assert torch.equal(after[[0, 7, ROWS - 1]], torch.full((3, DIM), 0.5))
    assert torch.equal(after[1], torch.ones(DIM))
    keep = torch.ones(ROWS, dtype=torch.bool)
    keep[[0, 1, 7, ROWS - 1]] = False
    assert torch.equal(after[keep], everything[keep])
    # No optimizer, parameter list or state dict holds it.
    assert not any(isinstance(p, TierRowsParameter) for p in ours.parameters())
    with pytest.raises(TableIdError, match=r"table 't_mc': row id 40 out of range \[0, 40\)"):
        weight[torch.tensor([ROWS])]
    with pytest.raises(NotImplementedError, match=r"table 't_mc': its weight lives on a tier"):
        weight.sum()
    with (
        pytest.raises(ValueError, match=r"table 't_mc': row ids to set repeat an id"),
        torch.no_grad(),
    ):
        weight[[2, 2]] = torch.zeros(2, DIM)


def test_rows_set_whole_on_the_tier_are_written_without_being_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reset under row-wise Adagrad sets every column of a row (weights and momentum): rows
    on the tier are written without a read; a row set in part is still read first."""
    case = MCCase(store="block_scm", steps=6)
    ours = build(case, tmp_path)
    train(ours, case)
    (group,) = list(ours.module.mc._embedding_module.tiered_groups())
    shard = group.shards[0]
    ids = torch.arange(shard.local_rows)
    _, slots = group._rows_by_id(0, ids)
    on_tier = ids[slots < 0][:3]
    assert on_tier.numel() == 3, "the case leaves rows outside the cache"
    reads: list[int] = []
    read_rows = shard.store.read_rows

    def counted(ids_: Any) -> Any:
        reads.append(len(ids_))
        return read_rows(ids_)

    monkeypatch.setattr(shard.store, "read_rows", counted)
    rows = torch.arange(3 * DIM, dtype=torch.float32).reshape(3, DIM) / 7
    group.set_rows(0, on_tier, rows, zero_states=True)
    assert reads == []
    key = weight_key(case)
    local = local_rows(ours.state_dict()[key])
    assert torch.equal(local[on_tier], rows) and torch.equal(
        momentum(ours)[on_tier], torch.zeros(3)
    )
    group.set_rows(0, on_tier[:1], torch.ones(1, DIM))  # the weights alone: the state is kept
    assert reads == [1]


def test_rows_set_through_the_weight_count_as_changed(tmp_path: Path) -> None:
    """Rows set through the weight (one cached, one on the tier) are rows an incremental
    checkpoint must save."""
    case = MCCase(store="flat", steps=6)
    ours = build(case, tmp_path)
    train(ours, case)
    (group,) = list(ours.module.mc._embedding_module.tiered_groups())
    group.track_changes()
    group.clear_changes()
    weight = ours.module.mc._embedding_module.embedding_bags.get_parameter(f"{TABLE}.weight")
    with torch.no_grad():
        weight[[4, 30]] = torch.zeros(2, DIM)
    changed = group.changed_rows(0)
    assert changed is not None and torch.nonzero(changed).flatten().tolist() == [4, 30]


def test_the_look_ahead_pipeline_trains_them_as_the_plain_loop(tmp_path: Path) -> None:
    """It reads no row ahead for them (the module remaps ids in its forward), and changes
    nothing."""
    case = MCCase(steps=25)
    plain = build(case, tmp_path / "plain", batches=True)
    piped = build(case, tmp_path / "piped", batches=True)
    g = torch.Generator().manual_seed(5)
    batches = [
        Batch(dense_features=torch.zeros(8, 1), sparse_features=kjt(case, g), labels=torch.zeros(8))
        for _ in range(case.steps)
    ]
    expected = []
    for batch in batches:
        loss, _ = plain(batch)
        loss.backward()
        expected.append(loss.detach())
    unused = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    got = []
    pipeline: LookaheadTrainPipeline[Batch, Any] = LookaheadTrainPipeline(
        piped, unused, torch.device("cpu"), lookahead=2
    )
    with pipeline:
        batch_iter = iter(batches)
        for _ in batches:
            got.append(pipeline.progress(batch_iter))
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    key = weight_key(case)
    assert torch.equal(local_rows(plain.state_dict()[key]), local_rows(piped.state_dict()[key]))


def test_a_checkpoint_chain_holds_the_rows_the_module_reset(tmp_path: Path) -> None:
    """A full link, steps in which the module hands slots to new ids (rows reset on the tier
    and in the cache), an incremental link: the chain restores the same rows, momentum and
    remapping, and training goes on bit for bit."""
    from torchrec_mtrains.checkpoint import CheckpointManager, CheckpointOptions

    case = MCCase(store="block_scm", steps=12)
    ours = build(case, tmp_path / "ours")
    options = CheckpointOptions(full_every=3, keep=None)
    manager = CheckpointManager(tmp_path / "chain", ours, ours.fused_optimizer, options)
    train(ours, case)
    manager.save(12)
    train(ours, MCCase(store="block_scm", steps=12, seed=2))
    link = manager.save(24)
    assert link.parent is not None  # incremental: the rows changed since the full link
    restored = build(case, tmp_path / "restored")
    CheckpointManager(tmp_path / "chain", restored, restored.fused_optimizer, options).restore()
    mine, theirs = ours.state_dict(), restored.state_dict()
    assert mine.keys() == theirs.keys()
    for key, value in mine.items():
        if isinstance(value, torch.Tensor) and not hasattr(value, "local_shards"):
            assert torch.equal(value, theirs[key]), key
    assert torch.equal(local_rows(mine[weight_key(case)]), local_rows(theirs[weight_key(case)]))
    assert torch.equal(momentum(ours), momentum(restored))
    later = MCCase(store="block_scm", steps=10, seed=3)
    assert all(
        torch.equal(a, b) for a, b in zip(train(ours, later), train(restored, later), strict=True)
    )
