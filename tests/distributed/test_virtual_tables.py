"""Virtual tables (``use_virtual_table=True``) on the tiers, against TorchRec's FUSED kernel.

Each case trains a virtual table over ids from a 2**40 space beside a FUSED table of the rows
those ids stand for (filled by the same id-seeded initializer) and compares every step's
outputs bit for bit (see :mod:`tests.distributed.virtual_harness`); with eviction, the
reference resets each evicted id's row and optimizer state at the step the virtual table
evicted it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig, FeatureScoreBasedEvictionPolicy
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.distributed.virtual_harness import VirtualCase, run_case, spawn_cases, virtual_shards
from torchrec_mtrains.cache.id_map import VirtualTableFullError
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.id_bounds import OutOfRangeIdError
from torchrec_mtrains.pipeline import tier_stats

pytestmark = pytest.mark.usefixtures("one_rank_process_group", "one_thread")

STORES = ["dram", "byte_scm", "block_scm", "log_block_scm"]


def _check(case: VirtualCase, tmp_path: Path) -> dict[str, float]:
    result = run_case(case, 0, 1, tmp_path)
    assert result.mismatched_step is None, (case, result.largest_diff)
    return result.stats["t_virtual"]


@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize(("kind", "weighted"), [("ebc", False), ("ebc", True), ("ec", False)])
def test_a_virtual_table_trains_as_fused_on_every_store(
    store: str, kind: str, weighted: bool, tmp_path: Path
) -> None:
    stats = _check(VirtualCase(store=store, kind=kind, weighted=weighted), tmp_path)
    # every id trained got a row, made once; nothing was evicted
    assert stats["live_rows"] == stats["rows_made"] > 100
    assert stats["rows_evicted"] == 0 and stats["max_live_rows"] == 260


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_other_optimizers(optimizer: str, tmp_path: Path) -> None:
    _check(VirtualCase(optimizer=optimizer), tmp_path)


@pytest.mark.parametrize("eviction", ["count", "ttl", "mixed", "l2"])
@pytest.mark.parametrize(("trigger", "max_live_rows"), [(0, 120), (60, 200)])
def test_evicted_ids_come_back_as_new_rows_as_in_a_reset_fused_table(
    eviction: str, trigger: int, max_live_rows: int, tmp_path: Path
) -> None:
    case = VirtualCase(eviction=eviction, trigger=trigger, max_live_rows=max_live_rows, steps=20)
    stats = _check(case, tmp_path)
    assert stats["rows_evicted"] > 0 and stats["eviction_rounds"] > 0
    assert stats["rows_made"] == stats["live_rows"] + stats["rows_evicted"]
    assert stats["live_rows"] <= max_live_rows


def test_the_reference_reset_is_what_makes_evictions_match(tmp_path: Path) -> None:
    """The control: without resetting evicted rows in the reference, the outputs part."""
    case = VirtualCase(eviction="count", max_live_rows=120, steps=20)
    result = run_case(case, 0, 1, tmp_path, reset_reference=False)
    assert result.mismatched_step is not None


def test_row_and_table_wise_on_two_ranks(tmp_path: Path) -> None:
    cases = [
        VirtualCase(sharding="rw"),
        VirtualCase(store="byte_scm", kind="ec", sharding="rw"),
        VirtualCase(store="dram", sharding="tw", weighted=True),
        # 3 buckets over 2 ranks: rank 0 takes two, its store a larger share
        VirtualCase(sharding="rw", buckets=3, num_embeddings=3 * 2**38, max_live_rows=400),
        VirtualCase(sharding="rw", eviction="count", max_live_rows=200, steps=20),
    ]
    per_rank = spawn_cases(cases, 2, tmp_path)
    for rank, results in enumerate(per_rank):
        assert len(results) == len(cases), results[-1]["error"]
        for result in results:
            assert result["error"] is None, result["error"]
            assert result["mismatched_step"] is None, (rank, result["case"])
            if result["case"]["sharding"] == "rw":
                (stats,) = result["stats"].values()
                assert stats["live_rows"] > 0  # each rank holds its buckets' ids


# ----------------------------------------------------------------------------- refusals


def _ebc(**kwargs: object) -> EmbeddingBagCollection:
    config = EmbeddingBagConfig(
        name="t_v",
        num_embeddings=kwargs.pop("num_embeddings", 2**40),  # type: ignore[arg-type]
        embedding_dim=8,
        feature_names=["f"],
        use_virtual_table=True,
        **kwargs,  # type: ignore[arg-type]
    )
    return EmbeddingBagCollection([config], device=torch.device("meta"))


def _shard(
    ebc: EmbeddingBagCollection,
    root: Path,
    generator: object = None,
    options: TieredTableOptions | None = None,
    wrap: bool = True,
    **sharder_kwargs: object,
) -> DistributedModelParallel:
    sharder = TieredEmbeddingBagCollectionSharder(TierStorage(root=str(root)), **sharder_kwargs)
    gen = generator or table_wise(rank=0, compute_kernel=TIERED_KERNEL)
    plan = construct_module_sharding_plan(ebc, {"t_v": gen}, sharder=sharder)  # type: ignore[dict-item]
    if wrap:
        plan["t_v"] = TieredParameterSharding.wrap(
            plan["t_v"],
            options or TieredTableOptions(tier="dram", max_live_rows=10, cache_load_factor=1.0),
        )
    return DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def _kjt(ids: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(keys=["f"], values=torch.tensor(ids), lengths=torch.tensor([len(ids)]))


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (
            {"options": TieredTableOptions(tier="dram")},
            r"virtual table 't_v': set TieredTableOptions.max_live_rows",
        ),
        (
            {"ebc": {"virtual_table_eviction_policy": FeatureScoreBasedEvictionPolicy()}},
            r"virtual table 't_v': virtual_table_eviction_policy=FeatureScoreBasedEvictionPolicy",
        ),
        (
            {"generator": column_wise(ranks=[0], compute_kernel=TIERED_KERNEL)},
            r"virtual table 't_v': sharding type 'column_wise' is not supported",
        ),
        (
            {"generator": table_wise(rank=0, compute_kernel="fused"), "wrap": False},
            r"table 't_v' is a virtual table .*plan it on the tiered kernel",
        ),
        (
            {"ebc": {"total_num_buckets": 3}, "generator": row_wise(compute_kernel=TIERED_KERNEL)},
            r"virtual table 't_v': num_embeddings=1099511627776 is not a multiple of "
            r"total_num_buckets=3",
        ),
        (
            {"hot_rows": {"t_v": [1, 2]}},
            r"virtual table 't_v': hot_rows cannot pin rows",
        ),
    ],
)
def test_plans_the_tiers_cannot_run_are_refused_naming_table_and_option(
    setup: dict[str, object], message: str, tmp_path: Path
) -> None:
    setup = dict(setup)
    ebc = _ebc(**setup.pop("ebc", {}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        _shard(ebc, tmp_path, **setup)  # type: ignore[arg-type]


def test_bad_ids_a_full_table_and_state_dicts_get_one_line_errors(tmp_path: Path) -> None:
    model = _shard(_ebc(), tmp_path)
    with pytest.raises(OutOfRangeIdError, match=r"table 't_v'.*1099511627776"):
        model(_kjt([3, 2**40]))
    model(_kjt([2**40 - 1, 0, 5, 2**39]))
    (shard,) = virtual_shards(model)
    assert shard.stats()["live_rows"] == 4
    # 7 more new ids do not fit 10 rows: refused, nothing assigned
    with pytest.raises(VirtualTableFullError, match=r"virtual table 't_v'.*7 new ids.*6 of its 10"):
        model(_kjt(list(range(100, 107))))
    assert shard.stats()["live_rows"] == 4 and shard.stats()["rows_made"] == 4
    model(_kjt(list(range(100, 106))))
    assert tier_stats(model)["t_v"]["live_rows"] == 10
    with pytest.raises(NotImplementedError, match=r"virtual tables 't_v': state dicts"):
        model.state_dict()


def test_a_row_wise_plan_must_split_ids_as_torchrecs_buckets_route_them(tmp_path: Path) -> None:
    ebc = _ebc(total_num_buckets=4)
    # one rank: the plan holds every bucket, as TorchRec routes them
    _shard(ebc, tmp_path, generator=row_wise(compute_kernel=TIERED_KERNEL, num_buckets=4))
    from torchrec_mtrains.distributed.virtual_tables import bucket_rows

    assert bucket_rows(3 * 2**38, 3, 2) == [2**39, 2**38]
    assert bucket_rows(2**40, 4, 2) == [2**39, 2**39]
