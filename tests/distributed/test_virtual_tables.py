"""Virtual tables (``use_virtual_table=True``) on the tiers, against TorchRec's FUSED kernel.

Each case trains a virtual table over ids from a 2**40 space beside a FUSED table of the rows
those ids stand for (filled by the same id-seeded initializer) and compares every step's
outputs bit for bit (see :mod:`tests.distributed.virtual_harness`); with eviction, the
reference resets each evicted id's row and optimizer state at the step the virtual table
evicted it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

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

from tests.distributed.virtual_harness import (
    VirtualCase,
    batch,
    build_model,
    fill_reference,
    initial_weights,
    outputs,
    run_case,
    spawn_cases,
    train_steps,
    virtual_shards,
)
from tests.torchrec_releases import needs_bucketed_row_wise
from torchrec_mtrains.cache.id_map import VirtualTableFullError
from torchrec_mtrains.checkpoint import expand_for_load
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


@pytest.mark.parametrize("eviction", ["count", "ttl", "mixed", "l2", "score"])
@pytest.mark.parametrize(("trigger", "max_live_rows"), [(0, 200), (60, 220)])
def test_evicted_ids_come_back_as_new_rows_as_in_a_reset_fused_table(
    eviction: str, trigger: int, max_live_rows: int, tmp_path: Path
) -> None:
    case = VirtualCase(eviction=eviction, trigger=trigger, max_live_rows=max_live_rows, steps=20)
    stats = _check(case, tmp_path)
    assert stats["rows_evicted"] > 0 and stats["eviction_rounds"] > 0
    assert stats["rows_made"] == stats["live_rows"] + stats["rows_evicted"]
    assert stats["live_rows"] <= max_live_rows


@pytest.mark.parametrize("weighted", [False, True])
def test_feature_scores_never_reach_pooling(weighted: bool, tmp_path: Path) -> None:
    """TorchRec's auto collection would hand the kernels every value's score as its weight:
    pooled by them (fbgemm's weighted path, even at 1.0), the outputs part from FUSED at the
    first step, and a weighted EBC's input is refused. The tiers take the scores from the
    policy and turn it off."""
    _check(VirtualCase(eviction="score", weighted=weighted, max_live_rows=1000), tmp_path)


def test_the_reference_reset_is_what_makes_evictions_match(tmp_path: Path) -> None:
    """The control: without resetting evicted rows in the reference, the outputs part."""
    case = VirtualCase(eviction="count", max_live_rows=120, steps=20)
    result = run_case(case, 0, 1, tmp_path, reset_reference=False)
    assert result.mismatched_step is not None


@needs_bucketed_row_wise
def test_row_and_table_wise_on_two_ranks(tmp_path: Path) -> None:
    cases = [
        VirtualCase(sharding="rw"),
        VirtualCase(store="byte_scm", kind="ec", sharding="rw"),
        VirtualCase(store="dram", sharding="tw", weighted=True),
        # 3 buckets over 2 ranks: rank 0 takes two, its store a larger share
        VirtualCase(sharding="rw", buckets=3, num_embeddings=3 * 2**38, max_live_rows=400),
        VirtualCase(sharding="rw", eviction="count", max_live_rows=200, steps=20),
        # (TorchRec's row-wise lookup would pack the scores beside the weights: the sweep found)
        VirtualCase(sharding="rw", eviction="score", weighted=True, max_live_rows=200, steps=20),
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
            r"virtual table 't_v': FeatureScoreBasedEvictionPolicy with "
            r"enable_auto_feature_score_collection=False takes its scores from the input's weights",
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


def test_bad_ids_and_a_full_table_get_one_line_errors(tmp_path: Path) -> None:
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


@needs_bucketed_row_wise
def test_a_row_wise_plan_must_split_ids_as_torchrecs_buckets_route_them(tmp_path: Path) -> None:
    ebc = _ebc(total_num_buckets=4)
    # one rank: the plan holds every bucket, as TorchRec routes them
    _shard(ebc, tmp_path, generator=row_wise(compute_kernel=TIERED_KERNEL, num_buckets=4))
    from torchrec_mtrains.distributed.virtual_tables import bucket_rows

    assert bucket_rows(3 * 2**38, 3, 2) == [2**39, 2**38]
    assert bucket_rows(2**40, 4, 2) == [2**39, 2**39]


# ----------------------------------------------------------------------------- state


@pytest.mark.parametrize(
    ("optimizer", "eviction", "bound", "optimizer_first"),
    [
        ("rowwise_adagrad", "count", 150, False),
        ("adagrad", "ttl", 200, True),
        ("sgd", "none", 260, False),
    ],
)
def test_state_dicts_hold_live_rows_and_a_loaded_model_trains_on_exactly(
    optimizer: str, eviction: str, bound: int, optimizer_first: bool, tmp_path: Path
) -> None:
    case = VirtualCase(optimizer=optimizer, eviction=eviction, max_live_rows=bound)
    saved = build_model(case, 1, tmp_path / "a")
    train_steps(saved, case, range(8))
    state, optim = saved.state_dict(), saved.fused_optimizer.state_dict()
    key = "embedding_bags.t_virtual"
    live = int(virtual_shards(saved)[0].stats()["live_rows"])
    ids = state[f"{key}.weight_id"].local_shards()[0].tensor
    assert live < bound and tuple(state[f"{key}.weight"].size()) == (live, 8)  # live rows only
    assert tuple(ids.shape) == (live, 1) and torch.equal(ids.flatten(), ids.flatten().sort()[0])
    buckets = state[f"{key}.bucket"].local_shards()[0].tensor
    assert tuple(buckets.shape) == (4, 1) and int(buckets.sum()) == live
    columns = {"count": 2, "ttl": 2, "none": 0}[eviction]  # its statistics and batches ago
    if columns:
        assert tuple(state[f"{key}.metadata"].size()) == (live, columns)
    else:  # a table that never evicts keeps none
        assert f"{key}.metadata" not in state
    optim_state = optim["state"][f"{key}.weight"]
    assert torch.equal(optim_state["t_virtual.weight_id"].local_shards()[0].tensor, ids)
    loaded = build_model(case, 1, tmp_path / "b")
    if optimizer_first:
        loaded.fused_optimizer.load_state_dict(optim)
        loaded.load_state_dict(state)
    else:
        loaded.load_state_dict(state)
        loaded.fused_optimizer.load_state_dict(optim)
    again = loaded.state_dict()
    for part in ("weight", "weight_id", "bucket"):
        assert torch.equal(
            again[f"{key}.{part}"].local_shards()[0].tensor,
            state[f"{key}.{part}"].local_shards()[0].tensor,
        ), part
    # the loaded model goes on exactly as the one that saved it (evictions included)
    for a, b in zip(
        train_steps(saved, case, range(8, 16)), train_steps(loaded, case, range(8, 16))
    ):
        assert torch.equal(a, b)


@pytest.mark.parametrize("store", ["log_block_scm", "byte_scm", "dram"])
def test_live_rows_of_a_table_off_host_memory_map_files_and_round_trip_through_dcp(
    store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint as dcp

    from torchrec_mtrains.distributed import virtual_state

    case = VirtualCase(store=store, optimizer="adagrad", eviction="count", max_live_rows=150)
    saved = build_model(case, 1, tmp_path / "a")
    train_steps(saved, case, range(8))
    key = "embedding_bags.t_virtual"
    in_memory = saved.state_dict(), saved.fused_optimizer.state_dict()
    monkeypatch.setattr(virtual_state, "FILE_BACKED_BYTES", 0)  # every size maps a file
    state = {"model": saved.state_dict(), "optim": saved.fused_optimizer.state_dict()}
    weight = state["model"][f"{key}.weight"].local_shards()[0].tensor
    moment = state["optim"]["state"][f"{key}.weight"]["t_virtual.momentum1"]
    for tensor, before in (
        (weight, in_memory[0][f"{key}.weight"]),
        (moment, in_memory[1]["state"][f"{key}.weight"]["t_virtual.momentum1"]),
    ):
        local = tensor.local_shards()[0].tensor if hasattr(tensor, "local_shards") else tensor
        name = local.untyped_storage().filename
        if store == "dram":  # rows already in host memory: no file
            assert name is None
        else:  # a mapping of a file under the store's directory, whose name is gone
            assert name is not None and f"/{virtual_state.LIVE_ROWS_DIR}/" in name
            assert not os.path.exists(name)
        assert torch.equal(local, before.local_shards()[0].tensor)
    path = str(tmp_path / "ckpt")
    dcp.save(state, checkpoint_id=path)
    loaded = build_model(case, 1, tmp_path / "b")
    into = {"model": loaded.state_dict(), "optim": loaded.fused_optimizer.state_dict()}
    expand_for_load(into, dcp.FileSystemReader(path).read_metadata())
    dcp.load(into, checkpoint_id=path)
    loaded.load_state_dict(into["model"])
    loaded.fused_optimizer.load_state_dict(into["optim"])
    for a, b in zip(
        train_steps(saved, case, range(8, 14)), train_steps(loaded, case, range(8, 14))
    ):
        assert torch.equal(a, b)


def _save_and_load(rank: int, world: int, port: int, path: str, root: str, save: bool) -> None:
    """Spawned: saves a trained virtual table with dcp (row-wise at world 2, table-wise at 1),
    or loads the checkpoint into a new model and checks that each rank got the saved ids of
    its shard and, at world 2, read only those rows."""
    from datetime import timedelta

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    from torchrec_mtrains.distributed.runtime import process_group

    torch.set_num_threads(1)
    case = VirtualCase(sharding="rw" if world == 2 else "tw", eviction="count", max_live_rows=300)
    with process_group(
        backend="gloo", rank=rank, world_size=world, port=port, timeout=timedelta(seconds=60)
    ):
        model = build_model(case, world, Path(root) / f"{save}w{world}r{rank}")
        key = "embedding_bags.t_virtual"
        if save:
            for step in range(6):
                _, virt = batch(case, rank, step)
                outputs(case, model(virt)).square().sum().backward()
            state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
            dcp.save(state, checkpoint_id=path)
            (shard,) = state["model"][f"{key}.weight_id"].local_shards()
            torch.save(shard.tensor, os.path.join(path, f"ids{rank}.pt"))
            (rows,) = state["model"][f"{key}.weight"].local_shards()
            torch.save(rows.tensor, os.path.join(path, f"rows{rank}.pt"))
            return
        saved_ids = torch.cat(
            [torch.load(os.path.join(path, f)) for f in sorted(os.listdir(path)) if "ids" in f]
        ).flatten()
        saved_rows = torch.cat(
            [torch.load(os.path.join(path, f)) for f in sorted(os.listdir(path)) if "rows" in f]
        )
        (space,) = [v.space for v in virtual_shards(model)]
        mine = (saved_ids >= space.id_offset) & (saved_ids < space.id_offset + space.ids)
        assert 0 < int(mine.sum()) < len(saved_ids) or world == 1
        state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
        metadata = FileSystemReader(path).read_metadata()
        assert expand_for_load(state, metadata, path, model) >= 4
        read = state["model"][f"{key}.weight"]
        if world == 2:  # this rank's rows only
            assert [s.tensor.shape[0] for s in read.local_shards()] == [int(mine.sum())]
        else:
            assert read.shape[0] == len(saved_ids)
        dcp.load(state, checkpoint_id=path)
        model.load_state_dict(state["model"])
        model.fused_optimizer.load_state_dict(state["optim"])
        again = model.state_dict()
        ids = again[f"{key}.weight_id"].local_shards()[0].tensor.flatten()
        rows = again[f"{key}.weight"].local_shards()[0].tensor
        order = saved_ids[mine].argsort()
        assert torch.equal(ids, saved_ids[mine][order])
        assert torch.equal(rows, saved_rows[mine][order])


@needs_bucketed_row_wise
def test_a_dcp_checkpoint_of_two_ranks_loads_on_one(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from torchrec_mtrains.distributed.runtime import free_port

    path, root = str(tmp_path / "ckpt"), str(tmp_path / "tiers")
    mp.spawn(_save_and_load, args=(2, free_port(), path, root, True), nprocs=2, join=True)
    mp.spawn(_save_and_load, args=(1, free_port(), path, root, False), nprocs=1, join=True)


@needs_bucketed_row_wise
def test_a_dcp_checkpoint_loads_into_a_new_model_each_rank_reading_its_own_rows(
    tmp_path: Path,
) -> None:
    import torch.multiprocessing as mp

    from torchrec_mtrains.distributed.runtime import free_port

    path, root = str(tmp_path / "ckpt"), str(tmp_path / "tiers")
    mp.spawn(_save_and_load, args=(2, free_port(), path, root, True), nprocs=2, join=True)
    mp.spawn(_save_and_load, args=(2, free_port(), path, root, False), nprocs=2, join=True)


# ----------------------------------------------------------------------------- planning


def _virtual_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="t_v",
            num_embeddings=2**40,
            embedding_dim=64,
            feature_names=["f"],
            use_virtual_table=True,
            total_num_buckets=4,
        ),
        EmbeddingBagConfig(
            name="t_small", num_embeddings=1000, embedding_dim=64, feature_names=["g"]
        ),
    ]


def test_the_planner_sizes_a_virtual_table_from_its_bound_and_the_plan_trains(
    tmp_path: Path,
) -> None:
    from torchrec_mtrains.planner import plan_tables
    from torchrec_mtrains.planner.planners import PlacementError, with_budgets
    from torchrec_mtrains.planner.presets import load_topology
    from torchrec_mtrains.planner.types import PlannerConfig

    host = with_budgets(load_topology("local"), "64MB", "100MB")
    sharder = TieredEmbeddingBagCollectionSharder(
        TierStorage(root=str(tmp_path)), offer_tiered_kernel=True
    )

    def plan(bound: int | None, world: int = 1) -> Any:
        config = PlannerConfig(max_live_rows={} if bound is None else {"t_v": bound})
        return plan_tables(_virtual_configs(), host, world, 512, None, sharder, config=config).plan

    planned = plan(100_000)
    assert planned["t_v"].compute_kernel == TIERED_KERNEL
    assert planned["t_v"].tier_options.max_live_rows == 100_000
    assert planned["t_small"].compute_kernel == "fused"
    with pytest.raises(ValueError, match=r"virtual table 't_v': set planner.max_live_rows.t_v"):
        plan(None)
    with pytest.raises(ValueError, match=r"planner.max_live_rows names t_x: not a virtual table"):
        plan_tables(
            _virtual_configs(),
            host,
            1,
            512,
            None,
            sharder,
            config=PlannerConfig(max_live_rows={"t_v": 100_000, "t_x": 5}),
        )
    with pytest.raises(PlacementError, match=r"dram .* OVER"):  # its id map alone is too big
        plan(10**8)
    # without a bound, a measured profile of its ids bounds it by the distinct ids it saw
    from torchrec_mtrains.profiler import TableInfo, profile_batches

    rng = torch.Generator().manual_seed(0)
    batches = [
        KeyedJaggedTensor(
            keys=["f", "g"],
            values=torch.cat(
                [torch.randint(0, 2**40, (64,), generator=rng), torch.randint(0, 1000, (64,))]
            ),
            lengths=torch.ones(128, dtype=torch.int64),
        )
        for _ in range(4)
    ]
    tables = {"t_v": TableInfo(num_rows=2**40, dim=64), "t_small": TableInfo(num_rows=1000, dim=64)}
    profile = profile_batches(
        batches, tables, sampling_rate=1.0, feature_to_table={"f": "t_v", "g": "t_small"}
    )
    seen = profile["t_v"].distinct_rows
    assert 200 < seen <= 256
    profiled = plan_tables(_virtual_configs(), host, 1, 512, profile, sharder)
    assert profiled.plan["t_v"].tier_options.max_live_rows == seen
    assert f"virtual table t_v: max_live_rows {seen:,}, the distinct ids" in str(profiled.summary)
    # two ranks: a bound one rank cannot hold is split row-wise in whole buckets, as TorchRec's
    # input distribution routes ids
    two = plan(200_000, world=2)["t_v"]
    assert two.sharding_type == "row_wise"
    assert [s.shard_sizes[0] for s in two.sharding_spec.shards] == [2**39, 2**39]
    # the plan of one rank trains
    ebc = EmbeddingBagCollection(_virtual_configs(), device=torch.device("meta"))
    model = DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": planned}), sharders=[sharder]
    )
    out = model(
        KeyedJaggedTensor(
            keys=["f", "g"], values=torch.tensor([2**40 - 1, 5, 7]), lengths=torch.tensor([2, 1])
        )
    )
    assert out.values().shape == (1, 128)
    assert tier_stats(model)["t_v"]["live_rows"] == 2


def test_live_rows_without_room_on_disk_are_refused_naming_the_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from torchrec_mtrains.distributed import virtual_state

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(virtual_state.os, "posix_fallocate", full)
    monkeypatch.setattr(virtual_state, "FILE_BACKED_BYTES", 0)
    with pytest.raises(OSError, match=r"live_rows: no room for 4096 bytes") as e:
        virtual_state.live_row_buffer(64, 16, torch.float32, tmp_path)
    assert e.value.errno == errno.ENOSPC
    assert list((tmp_path / virtual_state.LIVE_ROWS_DIR).iterdir()) == []  # nothing left
    small = virtual_state.live_row_buffer(64, 16, torch.float32, None)  # no directory: memory
    assert small.untyped_storage().filename is None


# ------------------------------------------------------------------------------ evaluation


def _eval_batch(case: VirtualCase, step: int, unseen: bool) -> KeyedJaggedTensor:
    """An evaluated batch: feature f0 over the training batches' ids, f1 (``unseen``) over ids
    no training batch draws."""
    _, kjt = batch(case, 0, 1_000 + step)
    if not unseen:
        return kjt
    f0, f1, f2 = (kjt[f].values() for f in ("f0", "f1", "f2"))
    return KeyedJaggedTensor(
        keys=["f0", "f1", "f2"],
        values=torch.cat([f0, f1 + 10_000, f2]),
        lengths=kjt.lengths(),
        weights=kjt.weights_or_none(),
    )


def _evaluate(
    model: DistributedModelParallel, case: VirtualCase, kjt: KeyedJaggedTensor
) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        out = outputs(case, model(kjt))
    model.train()
    return out


def _virtual_state(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """The virtual table's state dict entries and its optimizer's, as local tensors."""
    out = {}
    prefix = "embedding_bags.t_virtual"
    for key, value in model.state_dict().items():
        if key.startswith(prefix):
            out[key] = value.local_shards()[0].tensor.clone()
    for key, value in model.fused_optimizer.state_dict()["state"][f"{prefix}.weight"].items():
        out[f"optim.{key}"] = value.local_shards()[0].tensor.clone()
    return out


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


STATISTICS = ("live_rows", "rows_made", "rows_evicted", "eviction_rounds")


@pytest.mark.parametrize(
    ("store", "eviction"), [("log_block_scm", "count"), ("dram", "ttl"), ("byte_scm", "mixed")]
)
def test_an_evaluation_changes_nothing_a_checkpoint_or_an_eviction_round_sees(
    store: str, eviction: str, tmp_path: Path
) -> None:
    """Evaluated batches of known and unseen ids between training steps: the run trains, evicts
    and checkpoints exactly as one that never evaluated, even while an evaluated batch holds
    provisional rows (as fbgemm's SSD kernels write nothing to their table in evaluation)."""
    case = VirtualCase(store=store, eviction=eviction, trigger=60, max_live_rows=330, steps=14)
    never = build_model(case, 1, tmp_path / "never")
    evaluated = build_model(case, 1, tmp_path / "evaluated")
    (never_rows,), (evaluated_rows,) = virtual_shards(never), virtual_shards(evaluated)
    for step in range(case.steps):
        a = train_steps(never, case, range(step, step + 1))
        b = train_steps(evaluated, case, range(step, step + 1))
        assert torch.equal(a[0], b[0]), step
        _evaluate(evaluated, case, _eval_batch(case, step, unseen=True))
        assert evaluated_rows.provisional  # the unseen ids' rows, held by the batch in flight
        assert evaluated_rows.stats() == never_rows.stats(), step
        if step == 6:  # a checkpoint taken while the evaluated batch holds them
            _assert_same_state(_virtual_state(never), _virtual_state(evaluated))
    assert never_rows.eviction.rounds > 0 and never_rows.eviction.evicted > 0
    _assert_same_state(_virtual_state(never), _virtual_state(evaluated))
    stats_never, stats_evaluated = (tier_stats(m)["t_virtual"] for m in (never, evaluated))
    for name in STATISTICS:
        assert stats_never[name] == stats_evaluated[name], name


def test_evaluated_outputs_are_the_fused_tables_and_new_ids_get_no_rows(tmp_path: Path) -> None:
    case = VirtualCase(steps=6)
    ref = build_model(case, 1, None)
    fill_reference(case, ref)
    model = build_model(case, 1, tmp_path)
    (rows,) = virtual_shards(model)
    assert torch.equal(train_steps(ref, case, range(3))[-1], train_steps(model, case, range(3))[-1])
    live, before = rows.live_count(), _virtual_state(model)
    for step in range(3):  # ids the reference has rows for, many not trained yet
        kjt = _eval_batch(case, step, unseen=False)
        assert torch.equal(_evaluate(ref, case, kjt), _evaluate(model, case, kjt)), step
    assert rows.provisional
    assert rows.live_count() == live and tier_stats(model)["t_virtual"]["live_rows"] == live
    _assert_same_state(before, _virtual_state(model))
    for a, b in zip(train_steps(ref, case, range(3, 6)), train_steps(model, case, range(3, 6))):
        assert torch.equal(a, b)
    assert not rows.provisional  # given back once no batch holds them


def test_a_batch_prefetched_for_evaluation_that_trains_keeps_its_new_rows(tmp_path: Path) -> None:
    """The module's mode changed between a prefetch and its forward: the forward trains, so
    the rows the prefetch gave as provisional become rows of their own, on the tier too."""
    case = VirtualCase(steps=4)
    plain = build_model(case, 1, tmp_path / "plain")
    switched = build_model(case, 1, tmp_path / "switched")
    train_steps(plain, case, range(2))
    train_steps(switched, case, range(2))
    (group,) = [
        g
        for m in switched.modules()
        if not isinstance(m, DistributedModelParallel)
        for g in getattr(m, "tiered_groups", list)()
    ]
    _, kjt = batch(case, 0, 2)
    group.prefetch(kjt.values(), kjt.length_per_key(), train=False)
    (rows,) = virtual_shards(switched)
    assert rows.provisional  # planned for evaluation
    for a, b in zip(
        train_steps(plain, case, range(2, 4)), train_steps(switched, case, range(2, 4))
    ):
        assert torch.equal(a, b)
    assert group.io_counters().prefetched_batches == 1  # the forward took the prefetch
    assert not rows.provisional
    (plain_rows,) = virtual_shards(plain)
    assert rows.stats() == plain_rows.stats()
    switched.state_dict()  # writes the cache back
    _assert_same_state(_virtual_state(plain), _virtual_state(switched))


def test_a_checkpoint_before_a_prefetched_batch_trains_holds_the_rows_it_took_over(
    tmp_path: Path,
) -> None:
    """A batch prefetched for training takes over the provisional rows an evaluated batch gave
    its ids: a checkpoint taken before its forward holds them at their initial values."""
    case = VirtualCase(steps=3)
    model = build_model(case, 1, tmp_path)
    train_steps(model, case, range(2))
    (group,) = [
        g
        for m in model.modules()
        if not isinstance(m, DistributedModelParallel)
        for g in getattr(m, "tiered_groups", list)()
    ]
    kjt = _eval_batch(case, 0, unseen=True)
    _evaluate(model, case, kjt)  # in flight: its unseen ids' rows are provisional
    (rows,) = virtual_shards(model)
    assert rows.provisional
    taken = rows.id_map.row_ids[sorted(rows.provisional)]
    group.prefetch(kjt.values(), kjt.length_per_key(), train=True)
    assert not rows.provisional
    state = _virtual_state(model)
    ids = state["embedding_bags.t_virtual.weight_id"].flatten()
    at = torch.searchsorted(ids, torch.from_numpy(taken))
    assert torch.equal(ids[at], torch.from_numpy(taken))
    weights = state["embedding_bags.t_virtual.weight"][at]
    assert torch.equal(weights, initial_weights(case, torch.from_numpy(taken)))
    group.cancel_prefetches()
