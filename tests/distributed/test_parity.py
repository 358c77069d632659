"""Quality parity: a table on a storage tier behind a row cache trains exactly like TorchRec's
FUSED kernel, and the tiered kernel's failure modes are loud and leave the tiers untouched.

World size 1 runs in process (one gloo group for the module); world size 2 runs every case in
one spawned pair of gloo ranks (see ``parity_harness.spawn_cases``) and checks each rank's shards.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import parity_harness as h
import pytest
import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.cache.table_cache import CacheTooSmallError
from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.sharders import (
    TieredEmbeddingBagCollectionSharder,
)
from torchrec_mtrains.distributed.tiered_tables import TableIdError
from torchrec_mtrains.tiers import TIERS, RowStoreError

TIER_NAMES = sorted(TIERS)
UNSHARDED_TOLERANCE = 1e-5  # FUSED vs nn.EmbeddingBag: same values, other summation order


def test_registry_holds_the_three_tiers_and_the_block_tiers_log_layout() -> None:
    assert TIER_NAMES == ["block_scm", "byte_scm", "dram", "log_block_scm"]
    assert {TIERS[name].serves_tier for name in TIER_NAMES} == {"block_scm", "byte_scm", "dram"}


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module", autouse=True)
def world_size_1(one_rank_process_group: None) -> Iterator[None]:
    """One single-rank group for every in-process test of this module, on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert dist.get_world_size() == 1
    yield
    torch.set_num_threads(threads)


# ----------------------------------------------------------------------------- checking


def check_result(result: dict[str, Any]) -> None:
    """Everything one rank's run of a parity case must satisfy."""
    case, rank = h.ParityCase(**result["case"]), result["rank"]
    where = f"{case.id} rank {rank}"
    assert result["error"] is None, f"{where} failed:\n{result['error']}"
    diffs: dict[str, float] = result["diffs"]
    for key in ("first_output_reference_vs_unsharded", "first_output_tiered_vs_unsharded"):
        assert diffs.pop(key) <= UNSHARDED_TOLERANCE, f"{where}: {key}"
    # Weights and optimizer state of both tables on this rank, tiered and FUSED side by side.
    assert any(k.endswith(f"{h.TIERED_TABLE}.weight") for k in diffs), where
    assert any(k.endswith(f"{h.FUSED_TABLE}.weight") for k in diffs), where
    if case.optimizer != "sgd":  # SGD keeps no state
        assert any(k.startswith("optim:") for k in diffs), where
    worst = max(diffs, key=lambda k: diffs[k])
    assert diffs[worst] <= h.TOLERANCE, f"{where}: {worst} differs by {diffs[worst]:.3g}"

    shards: dict[str, dict[str, int]] = result["shards"]
    stats: dict[str, dict[str, float]] = result["stats"]
    assert set(stats) == set(shards), where
    kernels = set(result["kernels"])
    if shards:  # the tiered table is local: a tiered kernel runs it
        assert kernels & {"TieredEmbeddingBag", "TieredEmbedding"}, where
    for key, shard in shards.items():
        st, what = stats[key], f"{where} shard {key}"
        assert shard["slots"] == shard["planned_slots"], what
        assert shard["need"] <= shard["slots"], what
        assert st["hits"] + st["misses"] == st["lookups"], what
        assert st["lookups"] == shard["lookups"], what
        assert st["tier_rows_read"] == st["misses"], what
        assert st["tier_bytes_read"] > 0, what
        assert st["writebacks"] <= st["evictions"], what
        if shard["distinct"] > shard["slots"]:
            assert st["evictions"] > 0, what
            assert st["misses"] > shard["distinct"], what
        else:
            assert st["evictions"] == 0, what
            assert st["misses"] == shard["distinct"], what
        if case.cache == "full":
            assert shard["slots"] == shard["rows"], what
        if case.cache == "min":
            assert shard["slots"] < shard["rows"], what


# ------------------------------------------------------------------------ world size 1


def _ws1_cases() -> list[h.ParityCase]:
    """Every kind x sharding x optimizer x tier at the smallest and the whole cache, plus the
    middle cache size with the tier rotating over the optimizers, and LFU caches."""
    cases = [
        h.ParityCase(kind=k, sharding=s, optimizer=o, tier=t, cache=c)
        for k, s, o, t, c in itertools.product(
            h.KINDS, h.SHARDINGS, h.OPTIMIZERS, TIER_NAMES, ("min", "full")
        )
    ]
    for kind, (s_idx, sharding), (o_idx, optimizer) in itertools.product(
        h.KINDS, enumerate(h.SHARDINGS), enumerate(h.OPTIMIZERS)
    ):
        tier = TIER_NAMES[(o_idx + s_idx) % len(TIER_NAMES)]
        cases.append(h.ParityCase(kind, optimizer, sharding, tier, "mid"))
    # LFU evicts other rows than LRU: the same results, through other write-backs.
    for kind, (s_idx, sharding) in itertools.product(h.KINDS, enumerate(h.SHARDINGS)):
        tier = TIER_NAMES[s_idx % len(TIER_NAMES)]
        for cache in ("min", "mid"):
            cases.append(h.ParityCase(kind, "rowwise_adagrad", sharding, tier, cache, policy="lfu"))
    return cases


WS1_CASES = _ws1_cases()


@pytest.mark.parametrize("case", WS1_CASES, ids=lambda c: c.id)
def test_parity_world_size_1(case: h.ParityCase, tmp_path: Path) -> None:
    result = h.run_case(case, 0, 1, tmp_path).as_dict()
    check_result(result)
    # A mixed plan whose FUSED table the tiered kernel computes too (one fbgemm module per
    # lookup), with results equal to TorchRec's own kernel's.
    assert set(result["kernels"]) <= {"TieredEmbeddingBag", "TieredEmbedding"}
    if case.cache == "min":  # the smallest cache that holds one batch, on every shard
        assert all(s["slots"] == s["need"] for s in result["shards"].values())


# ------------------------------------------------------------------------ world size 2


PLACED_TIERS = sorted({TIERS[name].serves_tier for name in TIER_NAMES})


def _ws2_cases() -> list[h.ParityCase]:
    """Every kind x sharding x optimizer; tiers and cache sizes rotate so that each kind and
    sharding meets every tier and every cache size, and each kind every (tier, cache) pair.
    The block tier runs in its log layout for one sharding per kind."""
    cases = []
    for k_idx, kind in enumerate(h.KINDS):
        for s_idx, sharding in enumerate(h.SHARDINGS):
            for o_idx, optimizer in enumerate(h.OPTIMIZERS):
                tier = PLACED_TIERS[o_idx % len(PLACED_TIERS)]
                if tier == "block_scm" and s_idx == 1 + k_idx:
                    tier = "log_block_scm"
                cases.append(
                    h.ParityCase(
                        kind=kind,
                        sharding=sharding,
                        optimizer=optimizer,
                        tier=tier,
                        cache=h.CACHE_SIZES[(o_idx + s_idx) % len(h.CACHE_SIZES)],
                    )
                )
    return cases


WS2_CASES = _ws2_cases()


def test_world_size_2_cases_cover_the_matrix() -> None:
    for kind in h.KINDS:
        mine = [c for c in WS2_CASES if c.kind == kind]
        assert {(c.placed_tier, c.cache) for c in mine} == set(
            itertools.product(PLACED_TIERS, h.CACHE_SIZES)
        )
        assert "log_block_scm" in {c.tier for c in mine}
        for sharding in h.SHARDINGS:
            some = [c for c in mine if c.sharding == sharding]
            assert {c.optimizer for c in some} == set(h.OPTIMIZERS)
            assert {c.placed_tier for c in some} == set(PLACED_TIERS)
            assert {c.cache for c in some} == set(h.CACHE_SIZES)


@pytest.fixture(scope="module")
def ws2_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    """All world-size-2 cases, run once in one spawned pair of ranks."""
    return h.spawn_cases(WS2_CASES, 2, tmp_path_factory.mktemp("ws2"))


@pytest.mark.slow
@pytest.mark.parametrize("case", WS2_CASES, ids=lambda c: c.id)
def test_parity_world_size_2(
    case: h.ParityCase, ws2_results: list[dict[str, dict[str, Any]]]
) -> None:
    for rank, results in enumerate(ws2_results):
        failed = [r["error"] for r in results.values() if r["error"]]
        assert case.id in results, f"rank {rank} did not run {case.id}; failures: {failed}"
        check_result(results[case.id])
    # The tiered table has shards somewhere: on rank 1 only (table-wise) or on both.
    shards = [s for results in ws2_results for s in results[case.id]["shards"].values()]
    assert shards
    if case.sharding != "table_wise":
        assert all(results[case.id]["shards"] for results in ws2_results)
    if case.cache == "min":  # the tightest shard's cache holds exactly its largest batch
        assert min(s["slots"] - s["need"] for s in shards) == 0


# ---------------------------------------------------------------------- statistics


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_tier_stats_readable_from_sharded_model(tier: str, tmp_path: Path) -> None:
    case = h.ParityCase(
        kind="ebc", sharding="table_wise", optimizer="rowwise_adagrad", tier=tier, cache="min"
    )
    _, tie, planned = h.build_models(case, 1, tmp_path)
    before = tie.module.tier_stats()[h.TIERED_TABLE]
    assert before["lookups"] == 0 and before["tier_rows_read"] == 0
    h.train(tie, case.kind, case.seed, 0)
    stats = tie.module.tier_stats()
    assert list(stats) == [h.TIERED_TABLE]  # only the tiered table; the FUSED one has none
    st = stats[h.TIERED_TABLE]
    lookups, distinct, _ = h.shard_expectations(case.seed, 1, 0, h.ROWS[h.TIERED_TABLE])
    assert st["hits"] + st["misses"] == st["lookups"] == lookups
    assert planned[0] < distinct  # the batches touch more rows than the cache holds
    assert st["evictions"] > 0
    assert st["tier_bytes_read"] > before["tier_bytes_read"]
    assert st["tier_rows_read"] == st["misses"] > 0
    assert st["hit_rate"] == pytest.approx(st["hits"] / st["lookups"])
    assert h.tier_stats(tie) == stats  # also found by walking the modules


# ------------------------------------------------------------------ failure modes


def _tier_files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*.rows"))}


def _with_id(step: int, feature: str, bad: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    batch = h.batch_ids(0, 0, step)
    lengths, ids = batch[feature]
    ids = ids.clone()
    ids[len(ids) // 2] = bad
    batch[feature] = (lengths, ids)
    return batch


@pytest.mark.parametrize(
    ("kind", "sharding", "tier", "bad"),
    [
        *[
            ("ebc", "table_wise", tier, bad)
            for tier in TIER_NAMES
            for bad in (-1, h.ROWS[h.TIERED_TABLE])
        ],
        ("ebc", "row_wise", "dram", -1),
        ("ebc", "column_wise", "block_scm", h.ROWS[h.TIERED_TABLE]),
        ("ec", "table_wise", "byte_scm", -1),
        ("ec", "row_wise", "block_scm", 10**9),
    ],
)
def test_out_of_range_id_raises_before_writing(
    kind: str, sharding: str, tier: str, bad: int, tmp_path: Path
) -> None:
    case = h.ParityCase(kind=kind, sharding=sharding, optimizer="adagrad", tier=tier, cache="min")
    ref, tie, _ = h.build_models(case, 1, tmp_path)
    half = h.STEPS // 2
    for model in (ref, tie):  # warm up: the cache is full of dirty rows that evictions would write
        _train_steps(model, kind, 0, range(half))
    files, stats = _tier_files(tmp_path), tie.module.tier_stats()
    assert files

    with pytest.raises(TableIdError) as err:
        tie(h.make_kjt(_with_id(half, "f1", bad)))
    message = str(err.value)
    assert repr(h.TIERED_TABLE) in message and "'f1'" in message
    assert re.search(rf"row id {bad}\b", message), message

    assert tie.module.tier_stats() == stats
    assert _tier_files(tmp_path) == files
    # Nothing moved, so training goes on exactly as if the bad batch never came.
    for model in (ref, tie):
        _train_steps(model, kind, 0, range(half, h.STEPS))
    diffs = h.compare(ref, tie)
    assert max(diffs.values()) <= h.TOLERANCE, diffs


def _train_steps(model: DistributedModelParallel, kind: str, seed: int, steps: range) -> None:
    for step in steps:
        h.loss_of(h.per_feature(kind, model(h.make_kjt(h.batch_ids(seed, 0, step))))).backward()


@pytest.mark.parametrize("optimizer_first", [False, True], ids=["model_first", "optim_first"])
@pytest.mark.parametrize("tier", TIER_NAMES)
def test_resume_from_reference_checkpoint(tier: str, optimizer_first: bool, tmp_path: Path) -> None:
    """A tiered model whose cache holds dirty rows of another run loads the FUSED reference's
    mid-training weights and optimizer state, then trains on exactly like the reference."""
    case = h.ParityCase(
        kind="ebc", sharding="column_wise", optimizer="rowwise_adagrad", tier=tier, cache="min"
    )
    ref, tie, _ = h.build_models(case, 1, tmp_path)
    half = h.STEPS // 2
    _train_steps(ref, case.kind, 0, range(half))
    _train_steps(tie, case.kind, 7, range(10))  # other batches: dirty rows in the cache
    model_sd, optim_sd = ref.state_dict(), ref.fused_optimizer.state_dict()
    if optimizer_first:
        tie.fused_optimizer.load_state_dict(optim_sd)
        tie.load_state_dict(model_sd)
    else:
        tie.load_state_dict(model_sd)
        tie.fused_optimizer.load_state_dict(optim_sd)
    for model in (ref, tie):
        _train_steps(model, case.kind, 0, range(half, h.STEPS))
    diffs = h.compare(ref, tie)
    assert max(diffs.values()) <= h.TOLERANCE, diffs


def test_optimizer_state_load_keeps_newer_cached_weights(tmp_path: Path) -> None:
    """Loading only the optimizer state replaces the cached rows' state but not their weights,
    which are newer than the tier's until written back."""
    case = h.ParityCase(
        kind="ec", sharding="table_wise", optimizer="adagrad", tier="byte_scm", cache="min"
    )
    ref, _, _ = h.build_models(case, 1, tmp_path / "a")
    twin, tie, _ = h.build_models(case, 1, tmp_path / "b")
    _train_steps(ref, case.kind, 0, range(h.STEPS))
    for model in (twin, tie):  # other batches: other weights and state, dirty cached rows
        _train_steps(model, case.kind, 7, range(h.STEPS))
    tie.fused_optimizer.load_state_dict(ref.fused_optimizer.state_dict())
    weights = h.compare_weights(twin, tie)  # flushes the cache to the tier first
    assert max(weights.values()) <= h.TOLERANCE, weights
    optim = h.compare_optimizer(ref, tie)
    assert optim and max(optim.values()) <= h.TOLERANCE, optim


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_loaded_checkpoint_reaches_the_tier_files(tier: str, tmp_path: Path) -> None:
    """What a checkpoint load writes into a tiered table is in its tier file after a flush: a
    model reopening the files (open mode ``open``) resumes from the loaded weights and state."""
    case = h.ParityCase(
        kind="ebc", sharding="table_wise", optimizer="adagrad", tier=tier, cache="min"
    )
    ref, tie, _ = h.build_models(case, 1, tmp_path)
    _train_steps(ref, case.kind, 0, range(h.STEPS // 2))
    _train_steps(tie, case.kind, 7, range(5))
    tie.load_state_dict(ref.state_dict())
    tie.fused_optimizer.load_state_dict(ref.fused_optimizer.state_dict())
    tie.module.flush_tiers()
    del tie
    reopened = h.build_model(case, 1, h.tier_storage(tier, tmp_path, open_mode="open"))
    diffs = h.compare(ref, reopened)
    mine = {k: v for k, v in diffs.items() if h.TIERED_TABLE in k}
    assert len(mine) == 2 and max(mine.values()) <= h.TOLERANCE, mine


def _two_table_plan(
    tmp_path: Path, load_factor: float, tier: str = "byte_scm", tier_b: str | None = None
) -> DistributedModelParallel:
    """An EBC with tiered tables ``a`` (100 rows, feature fa) and ``b`` (40 rows, feature
    fb): in one tiered kernel (same tier and cache options) unless ``tier_b`` puts b on
    another tier (then each has its own kernel)."""
    tables = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=100, feature_names=["fa"]),
        EmbeddingBagConfig(name="b", embedding_dim=4, num_embeddings=40, feature_names=["fb"]),
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = TieredEmbeddingBagCollectionSharder(
        h.tier_storage(tier, tmp_path), fused_params=h.fused_params("sgd")
    )
    options = TieredTableOptions(tier=TIERS[tier].serves_tier, cache_load_factor=load_factor)
    plan = construct_module_sharding_plan(
        ebc,
        {t.name: table_wise(rank=0, compute_kernel=TIERED_KERNEL) for t in tables},
        sharder=sharder,
        local_size=1,
        world_size=1,
        device_type="cpu",
    )
    for t in tables:
        plan[t.name] = TieredParameterSharding.wrap(plan[t.name], options)
    if tier_b is not None:
        plan["b"] = TieredParameterSharding.wrap(
            plan["b"], TieredTableOptions(tier=tier_b, cache_load_factor=load_factor)
        )
    return DistributedModelParallel(
        ebc, device=torch.device("cpu"), plan=ShardingPlan({"": plan}), sharders=[sharder]
    )


def _kjt(fa: list[int], fb: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor(
        keys=["fa", "fb"],
        values=torch.tensor(fa + fb),
        lengths=torch.tensor([len(fa), len(fb)]),
    )


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_cache_too_small_for_one_batch(tier: str, tmp_path: Path) -> None:
    # Load factor 0.25: a gets 25 slots, b gets 10; the second batch needs 12 unique rows of b.
    model = _two_table_plan(tmp_path, 0.25, tier)
    model(_kjt([1, 2, 3], [0, 1])).values().sum().backward()
    files, stats = _tier_files(tmp_path), model.module.tier_stats()
    (group,) = list(model.module.tiered_groups())
    resident = [shard.cache.num_resident for shard in group.shards]

    b_ids = [*range(12), 3, 5]
    with pytest.raises(CacheTooSmallError) as err:
        model(_kjt([50, 60, 70], b_ids))
    message = str(err.value)
    assert "'b'" in message and "10 rows" in message
    assert re.search(r"at least 12 rows", message), message
    # Nothing happened to either table: a's rows were not planned in without being loaded.
    assert model.module.tier_stats() == stats
    assert [shard.cache.num_resident for shard in group.shards] == resident
    assert _tier_files(tmp_path) == files
    # A batch that fits still trains, and reads a's new rows from the tier.
    model(_kjt([50, 60, 70], [1, 2])).values().sum().backward()
    after = model.module.tier_stats()
    assert after["a"]["misses"] == stats["a"]["misses"] + 3


@pytest.mark.parametrize("tier_b", [None, "block_scm"], ids=["same_tier", "other_tier"])
def test_out_of_range_id_in_one_table_leaves_the_others_untouched(
    tier_b: str | None, tmp_path: Path
) -> None:
    """The bad id is in b; a (seen first) must not have planned, loaded or counted anything.
    Both tables share one kernel, on one tier or on two."""
    model = _two_table_plan(tmp_path, 0.1, "byte_scm", tier_b)
    assert len(list(model.module.tiered_groups())) == 1
    for step in range(4):  # a's 10-row cache fills with dirty rows
        model(_kjt([step * 10 + i for i in range(10)], [step])).values().sum().backward()
    files, stats = _tier_files(tmp_path), model.module.tier_stats()
    with pytest.raises(TableIdError, match=r"table 'b'.*row id 40\b"):
        model(_kjt([50, 60, 70, 80], [1, 40]))
    assert model.module.tier_stats() == stats
    assert _tier_files(tmp_path) == files


def test_cache_sized_to_one_batch_is_enough(tmp_path: Path) -> None:
    # 12 unique rows of b in 12 slots (load factor 0.3 of 40 rows) is exactly enough.
    model = _two_table_plan(tmp_path, 0.3)
    model(_kjt([1], [*range(12), 3, 5])).values().sum().backward()
    assert model.module.tier_stats()["b"]["misses"] == 12


@pytest.mark.parametrize("where", ["absolute", "tmp"])
def test_missing_tier_directory_fails_at_sharding(where: str, tmp_path: Path) -> None:
    missing = Path("/nonexistent") if where == "absolute" else tmp_path / "nonexistent"
    if missing.exists():
        pytest.skip(f"{missing} exists on this machine")
    case = h.ParityCase(
        kind="ebc", sharding="table_wise", optimizer="sgd", tier="byte_scm", cache="full"
    )
    with pytest.raises(RowStoreError, match=re.escape(str(missing))):
        h.build_model(case, 1, TierStorage(root=str(tmp_path), dirs={"byte_scm": str(missing)}))
    assert not missing.exists()  # a mount point named in dirs is never created


def test_tier_directory_that_is_a_file_fails_at_sharding(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    case = h.ParityCase(
        kind="ebc", sharding="table_wise", optimizer="sgd", tier="block_scm", cache="full"
    )
    with pytest.raises(RowStoreError, match=re.escape(str(afile))):
        h.build_model(case, 1, TierStorage(root=str(tmp_path), dirs={"block_scm": str(afile)}))


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory this process cannot create files in: mode 0500, or for root (who ignores
    modes) the immutable attribute."""
    path = tmp_path / "readonly"
    path.mkdir()
    if os.geteuid() != 0:
        path.chmod(0o500)
        yield path
        path.chmod(0o700)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root without chattr +i: no directory is unwritable to root here")
    try:
        yield path
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)


@pytest.mark.parametrize("via", ["dirs", "root"])
def test_unwritable_tier_directory_fails_at_sharding(via: str, unwritable_dir: Path) -> None:
    try:
        (unwritable_dir / "probe").touch()
    except OSError:
        pass
    else:
        pytest.fail(f"{unwritable_dir} is writable; the fixture did not work")
    case = h.ParityCase(
        kind="ec", sharding="table_wise", optimizer="sgd", tier="byte_scm", cache="full"
    )
    if via == "dirs":
        storage = TierStorage(
            root=str(unwritable_dir.parent), dirs={"byte_scm": str(unwritable_dir)}
        )
    else:
        storage = TierStorage(root=str(unwritable_dir))
    with pytest.raises(RowStoreError, match=re.escape(str(unwritable_dir))):
        h.build_model(case, 1, storage)
