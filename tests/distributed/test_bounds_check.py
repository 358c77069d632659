"""One bounds-check rule for every table the tiered sharders build.

By default (``BoundsCheck.ERROR``) a batch holding an id outside its table is refused before any
lookup, naming the table, the feature, the id and the range, whether the table is on TorchRec's
FUSED kernel or on a tier; nothing trains, so training goes on exactly as if the batch never came.
With ``BoundsCheck.WARN`` every table does what TorchRec's FUSED kernel does by default (fbgemm's
WARNING mode): the id is logged and row 0 of its table is looked up (and trained) instead.

The models are the parity harness's (``t_tier``: features f0, f1, 96 rows, on a tier in the
tiered model; ``t_fused``: feature f2, 40 rows, FUSED in both); the reference is TorchRec's own
sharders on FUSED kernels.
"""

from __future__ import annotations

import gc
import logging
import os
import pickle
import re
import tempfile
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import parity_harness as h
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.datasets.utils import Batch as TorchrecBatch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.types import ShardingPlan
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_mtrains.distributed.id_bounds import HostBoundsCheck, OutOfRangeIdError
from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    BoundsCheck,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.runtime import free_port, process_group
from torchrec_mtrains.distributed.sharders import (
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
)
from torchrec_mtrains.distributed.tiered_tables import TableIdError

STEPS = 6
BAD_STEP = 3
Batch = dict[str, tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module", autouse=True)
def world_size_1(one_rank_process_group: None) -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ helpers


def _sharder(kind: str, storage: TierStorage, optimizer: str = "adagrad", **kwargs: Any) -> Any:
    fp = h.fused_params(optimizer)
    if kind == "ebc":
        return TieredEmbeddingBagCollectionSharder(storage, fused_params=fp, **kwargs)
    return TieredEmbeddingCollectionSharder(storage, fused_params=fp, **kwargs)


def _tiered_model(
    case: h.ParityCase,
    world_size: int,
    root: Path,
    bounds_check: Any = None,
    tiered: bool = True,
    **plan: Any,
) -> DistributedModelParallel:
    """The harness's tiered model (both tables FUSED unless ``tiered``), sharded by our
    sharder with ``bounds_check`` (the default when None); ``plan`` sets fields of both
    tables' ``ParameterSharding``."""
    kwargs = {} if bounds_check is None else {"bounds_check": bounds_check}
    sharder = _sharder(case.kind, TierStorage(root=str(root)), case.optimizer, **kwargs)
    kernels = {h.FUSED_TABLE: "fused", h.TIERED_TABLE: TIERED_KERNEL if tiered else "fused"}
    gens = {
        name: h._generator(case.sharding, world_size, name, kernels[name])
        for name, _, _ in h.TABLES
    }
    module_plan = construct_module_sharding_plan(
        h.make_module(case.kind),
        gens,
        sharder=sharder,
        local_size=world_size,
        world_size=world_size,
        device_type="cpu",
    )
    for ps in module_plan.values():
        for key, value in plan.items():
            setattr(ps, key, value)
    if tiered:
        factor, _ = h.cache_load_factor(case, world_size)
        module_plan[h.TIERED_TABLE] = TieredParameterSharding.wrap(
            module_plan[h.TIERED_TABLE],
            TieredTableOptions(tier=case.tier, cache_load_factor=factor),
        )
    return DistributedModelParallel(
        h.make_module(case.kind),
        device=h.CPU,
        plan=ShardingPlan({"": module_plan}),
        sharders=[sharder],
    )


def _models(
    case: h.ParityCase, world_size: int, root: Path, bounds_check: Any = None
) -> tuple[DistributedModelParallel, DistributedModelParallel]:
    """TorchRec's FUSED reference and the tiered model, on the same initial weights."""
    ref = h.build_model(case, world_size, None)
    h.set_weights(ref, h.global_weights(case.seed))
    tie = _tiered_model(case, world_size, root, bounds_check)
    tie.load_state_dict(ref.state_dict())
    return ref, tie


def _with_ids(batch: Batch, feature: str, *ids: int) -> Batch:
    """``batch`` with its first ids of ``feature`` replaced by ``ids`` (on a copy)."""
    out = dict(batch)
    lengths, values = batch[feature]
    assert values.numel() >= len(ids)
    values = values.clone()
    values[: len(ids)] = torch.tensor(ids)
    out[feature] = (lengths, values)
    return out


def _zeroed(batch: Batch) -> Batch:
    """``batch`` with every out-of-range id replaced by 0, what BoundsCheck.WARN looks up."""
    rows = {f: n for _, n, feats in h.TABLES for f in feats}
    return {
        f: (lengths, torch.where((v < 0) | (v >= rows[f]), 0, v))
        for f, (lengths, v) in batch.items()
    }


def _step(model: DistributedModelParallel, kind: str, batch: Batch) -> None:
    h.loss_of(h.per_feature(kind, model(h.make_kjt(batch)))).backward()


def _snapshot(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """Every local weight and optimizer state value, copied."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        out.update({f"{key}@{off}": t.clone() for off, _, t in h.regions(value)})
    for key, state in model.fused_optimizer.state_dict()["state"].items():
        for name, value in state.items():
            out.update({f"{key}.{name}@{off}": t.clone() for off, _, t in h.regions(value)})
    return out


def _fbgemm_modes(model: DistributedModelParallel) -> set[int]:
    """fbgemm's bounds check mode of every TorchRec kernel (and tiered kernel cache) here."""
    modes: set[int] = set()
    for lookup in model.module._lookups:
        module = getattr(lookup, "module", lookup)
        for kernel in module._emb_modules:
            emb = getattr(kernel, "_emb_module", None)
            if emb is not None and hasattr(emb, "bounds_check_mode_int"):
                modes.add(int(emb.bounds_check_mode_int))
    return modes


# ------------------------------------------------------------------------------- ERROR


ERROR_CASES = [
    ("ebc", "table_wise", h.FUSED_TABLE, "f2", 40),
    ("ebc", "table_wise", h.FUSED_TABLE, "f2", -1),
    ("ebc", "row_wise", h.FUSED_TABLE, "f2", 10**9),
    ("ebc", "column_wise", h.FUSED_TABLE, "f2", 40),
    ("ebc", "row_wise", h.TIERED_TABLE, "f1", 96),
    ("ec", "table_wise", h.FUSED_TABLE, "f2", 40),
    ("ec", "row_wise", h.FUSED_TABLE, "f2", -7),
    ("ec", "column_wise", h.TIERED_TABLE, "f0", -1),
]


@pytest.mark.parametrize(
    ("kind", "sharding", "table", "feature", "bad"),
    ERROR_CASES,
    ids=[f"{k}-{s}-{t}-{b}" for k, s, t, _, b in ERROR_CASES],
)
def test_out_of_range_id_is_an_error_for_every_table(
    kind: str, sharding: str, table: str, feature: str, bad: int, tmp_path: Path
) -> None:
    case = h.ParityCase(kind=kind, sharding=sharding, optimizer="adagrad", tier="dram", cache="mid")
    ref, tie = _models(case, 1, tmp_path)
    for step in range(BAD_STEP):
        for model in (ref, tie):
            _step(model, kind, h.batch_ids(0, 0, step))
    before, stats = _snapshot(tie), tie.module.tier_stats()
    batch = _with_ids(h.batch_ids(0, 0, BAD_STEP), feature, bad)
    kjt = h.make_kjt(batch)
    values = kjt.values().clone()

    with pytest.raises(OutOfRangeIdError) as err:
        tie(kjt)
    rows = h.ROWS[table]
    message = str(err.value)
    assert f"table {table!r}" in message and f"feature {feature!r}" in message, message
    assert re.search(rf"row id {bad}\b", message) and f"[0, {rows})" in message, message
    e = err.value
    assert isinstance(e, TableIdError)  # the tiered tables' error, for every table now
    assert (e.table, e.feature, e.row_id, e.num_rows, e.counts) == (
        table,
        feature,
        bad,
        rows,
        {table: 1},
    )
    copy = pickle.loads(pickle.dumps(e))
    assert str(copy) == message and copy.counts == e.counts

    # Refused before the lookup: nothing trained, read or written, the batch left as it was.
    assert torch.equal(kjt.values(), values)
    after = _snapshot(tie)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert tie.module.tier_stats() == stats
    # So training goes on exactly as the reference, which never saw the bad batch.
    for step in range(BAD_STEP, STEPS):
        for model in (ref, tie):
            _step(model, kind, h.batch_ids(0, 0, step))
    diffs = h.compare(ref, tie)
    assert max(diffs.values()) <= h.TOLERANCE, diffs


def test_error_names_the_first_bad_id_and_counts_them_all(tmp_path: Path) -> None:
    case = h.ParityCase("ebc", "adagrad", "table_wise", "byte_scm", "mid")
    tie = _tiered_model(case, 1, tmp_path)
    batch = _with_ids(h.batch_ids(0, 0, 0), "f2", 1, 41, 99)
    batch = _with_ids(batch, "f1", 500)
    with pytest.raises(OutOfRangeIdError) as err:
        tie(h.make_kjt(batch))
    # f1 comes before f2 in the batch's keys: its id is the one named.
    assert (err.value.table, err.value.feature, err.value.row_id) == (h.TIERED_TABLE, "f1", 500)
    assert err.value.counts == {h.TIERED_TABLE: 1, h.FUSED_TABLE: 2}
    assert "3 out-of-range id(s)" in str(err.value)


def test_torchrecs_own_sharders_train_on_out_of_range_ids(tmp_path: Path) -> None:
    """The issue: TorchRec's FUSED kernel only warns (fbgemm WARNING mode) and trains row 0."""
    case = h.ParityCase("ebc", "adagrad", "table_wise", "dram", "mid")
    ref, tie = _models(case, 1, tmp_path, BoundsCheck.WARN)
    batch = _with_ids(h.batch_ids(0, 0, 0), "f2", 40)
    _step(ref, "ebc", batch)  # no error
    _step(tie, "ebc", batch)
    diffs = h.compare(ref, tie)
    assert max(diffs.values()) <= h.TOLERANCE, diffs


# -------------------------------------------------------------------------------- WARN


@pytest.mark.parametrize("sharding", h.SHARDINGS)
@pytest.mark.parametrize("kind", h.KINDS)
def test_warn_looks_up_row_0_as_torchrec_does_for_every_table(
    kind: str, sharding: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bad ids in the tiered table and the FUSED one: the tiered model with WARN trains exactly
    as TorchRec's FUSED reference fed the same batches (one rank: fbgemm's WARNING mode looks up
    row 0 of the table whatever the sharding)."""
    case = h.ParityCase(
        kind=kind, sharding=sharding, optimizer="adagrad", tier="block_scm", cache="min"
    )
    ref, tie = _models(case, 1, tmp_path, "warn")
    bad_steps = {1: ("f1", (96, -2)), 2: ("f2", (40,)), 4: ("f0", (10**6,))}
    with caplog.at_level(logging.WARNING, logger="torchrec_mtrains.distributed.sharded"):
        for step in range(STEPS):
            batch = h.batch_ids(0, 0, step)
            if step in bad_steps:
                feature, ids = bad_steps[step]
                batch = _with_ids(batch, feature, *ids)
            kjt = h.make_kjt(batch)
            values = kjt.values().clone()
            h.loss_of(h.per_feature(kind, tie(kjt))).backward()
            assert torch.equal(kjt.values(), values)  # the caller's batch is not changed
            _step(ref, kind, batch)
    diffs = h.compare(ref, tie)
    assert max(diffs.values()) <= h.TOLERANCE, diffs
    assert tie.module.out_of_range_ids() == {h.TIERED_TABLE: 3, h.FUSED_TABLE: 1}
    logged = [r.getMessage() for r in caplog.records if "out of range" in r.getMessage()]
    # The first batch of each table is logged, naming the table, the feature and the id.
    assert len(logged) == 2, logged
    assert re.search(rf"table '{h.TIERED_TABLE}': row id 96 \(feature 'f1'\).*\[0, 96\)", logged[0])
    assert re.search(rf"table '{h.FUSED_TABLE}': row id 40 \(feature 'f2'\).*\[0, 40\)", logged[1])


def test_warn_logs_the_1st_10th_100th_batch_of_a_table(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    case = h.ParityCase("ebc", "sgd", "table_wise", "dram", "full")
    tie = _tiered_model(case, 1, tmp_path, BoundsCheck.WARN)
    kjt = h.make_kjt(_with_ids(h.batch_ids(0, 0, 0), "f2", 40, 41))
    with caplog.at_level(logging.WARNING, logger="torchrec_mtrains.distributed.sharded"):
        for _ in range(12):
            tie(kjt)
    assert len([r for r in caplog.records if "out of range" in r.getMessage()]) == 2
    assert "t_fused 20 in 10 batch(es)" in caplog.records[-1].getMessage()
    assert tie.module.out_of_range_ids() == {h.FUSED_TABLE: 24}


# ------------------------------------------------------------------- fbgemm and options


@pytest.mark.parametrize(
    ("bounds_check", "mode"),
    [(None, BoundsCheckMode.FATAL), (BoundsCheck.WARN, BoundsCheckMode.WARNING)],
)
def test_torchrecs_kernels_run_fbgemms_matching_mode(
    bounds_check: BoundsCheck | None, mode: BoundsCheckMode, tmp_path: Path
) -> None:
    """Behind the module's own check, fbgemm's mode matches it: FATAL with ERROR (a backstop
    that never warns and trains), WARNING with WARN."""
    for kind in h.KINDS:
        case = h.ParityCase(kind, "sgd", "table_wise", "dram", "full")
        tie = _tiered_model(case, 1, tmp_path / kind, bounds_check)
        assert _fbgemm_modes(tie) == {mode.value}


def test_bounds_check_values() -> None:
    assert BoundsCheck.parse("warn") is BoundsCheck.WARN
    assert BoundsCheck.parse(BoundsCheck.ERROR) is BoundsCheck.ERROR
    with pytest.raises(ValueError, match=r"'fatal'.*error, warn"):
        BoundsCheck.parse("fatal")
    for kind in h.KINDS:
        assert _sharder(kind, TierStorage()).bounds_check is BoundsCheck.ERROR
        assert _sharder(kind, TierStorage(), bounds_check="warn").bounds_check is BoundsCheck.WARN
        with pytest.raises(ValueError, match=r"'clamp'.*error, warn"):
            _sharder(kind, TierStorage(), bounds_check="clamp")


@pytest.mark.parametrize("kind", h.KINDS)
def test_fbgemm_mode_contradicting_the_rule_is_refused(kind: str, tmp_path: Path) -> None:
    fp = {**h.fused_params("sgd"), "bounds_check_mode": BoundsCheckMode.WARNING}
    cls = TieredEmbeddingBagCollectionSharder if kind == "ebc" else TieredEmbeddingCollectionSharder
    with pytest.raises(ValueError, match=r"bounds_check_mode.*contradicts bounds_check='error'"):
        cls(TierStorage(), fused_params=fp)
    cls(TierStorage(), fused_params=fp, bounds_check=BoundsCheck.WARN)  # the same rule: fine
    case = h.ParityCase(kind, "sgd", "table_wise", "dram", "full")
    with pytest.raises(ValueError, match=r"table 't_\w+': the plan sets bounds_check_mode"):
        _tiered_model(case, 1, tmp_path, bounds_check_mode=BoundsCheckMode.IGNORE)


def test_keys_no_table_reads_are_not_checked(tmp_path: Path) -> None:
    case = h.ParityCase("ebc", "sgd", "table_wise", "dram", "full")
    tie = _tiered_model(case, 1, tmp_path)
    kjt = h.make_kjt(h.batch_ids(0, 0, 0))
    extra = KeyedJaggedTensor(
        keys=[*kjt.keys(), "unread"],
        values=torch.cat([kjt.values(), torch.tensor([-5, 10**9])]),
        lengths=torch.cat([kjt.lengths(), torch.tensor([2] + [0] * (h.BATCH - 1))]),
    )
    checked = tie.module._check_ids(extra)
    assert checked is extra


@pytest.mark.parametrize("bounds_check", list(BoundsCheck))
def test_one_id_per_sample_batches_are_checked_too(
    bounds_check: BoundsCheck, tmp_path: Path
) -> None:
    """Every feature with as many ids (one-hot Criteo): the check takes one reduction."""
    case = h.ParityCase("ebc", "sgd", "table_wise", "dram", "full")
    tie = _tiered_model(case, 1, tmp_path, bounds_check)
    values = torch.arange(3 * h.BATCH) % 40
    values[h.BATCH + 5] = 96  # f1 (t_tier, 96 rows)
    values[2 * h.BATCH + 1] = -4  # f2 (t_fused, 40 rows)
    kjt = KeyedJaggedTensor(
        keys=list(h.FEATURES), values=values, lengths=torch.ones(3 * h.BATCH, dtype=torch.int64)
    )
    if bounds_check is BoundsCheck.ERROR:
        with pytest.raises(OutOfRangeIdError) as err:
            tie.module._check_ids(kjt)
        assert (err.value.table, err.value.feature, err.value.row_id) == (h.TIERED_TABLE, "f1", 96)
        assert err.value.counts == {h.TIERED_TABLE: 1, h.FUSED_TABLE: 1}
        return
    checked = tie.module._check_ids(kjt)
    want = values.clone()
    want[[h.BATCH + 5, 2 * h.BATCH + 1]] = 0
    assert torch.equal(checked.values(), want)
    assert torch.equal(checked.lengths(), kjt.lengths()) and checked.keys() == kjt.keys()


def test_warn_keeps_a_variable_batch_per_feature(tmp_path: Path) -> None:
    """A VBE batch with a bad id comes out as the same VBE batch with row 0 there, and trains
    as that batch does."""
    case = h.ParityCase("ebc", "sgd", "table_wise", "dram", "full")
    warn = _tiered_model(case, 1, tmp_path / "a", BoundsCheck.WARN, tiered=False)
    plain = _tiered_model(case, 1, tmp_path / "b", tiered=False)
    plain.load_state_dict(warn.state_dict())
    keys = list(h.FEATURES)
    lengths = torch.tensor([1, 2, 0, 1, 1, 2, 1, 1, 1])  # f0: 2 samples, f1: 3, f2: 4
    values = torch.tensor([5, 7, 8, 9, 10, 11, 12, 41, 13, 3])
    inverse = torch.tensor([[0, 1, 1, 0], [0, 1, 2, 2], [0, 1, 2, 3]])

    def vbe(ids: torch.Tensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(
            keys=keys,
            values=ids,
            lengths=lengths,
            stride_per_key_per_rank=[[2], [3], [4]],
            inverse_indices=(keys, inverse),
        )

    checked = warn.module._check_ids(vbe(values))
    assert checked.variable_stride_per_key()
    assert checked.stride_per_key_per_rank() == [[2], [3], [4]]
    assert checked.inverse_indices()[1] is inverse
    fixed = values.clone()
    fixed[7] = 0
    assert torch.equal(checked.values(), fixed)
    for model, ids in ((warn, values), (plain, fixed)):
        out = model(vbe(ids))
        out = out.wait() if hasattr(out, "wait") else out
        out.values().square().sum().backward()
    for key, value in plain.state_dict().items():
        assert torch.equal(h.regions(value)[0][2], h.regions(warn.state_dict()[key])[0][2]), key


# ------------------------------------------------------------------- the host's check


def test_a_batch_checked_on_the_host_is_let_in_unchecked_once(tmp_path: Path) -> None:
    """HostBoundsCheck checks the batch before its copy and vouches for the copy: the module
    lets that copy in without a check of its own (on a GPU: no host sync), once; a batch
    built from it, even on the same values, is checked as usual."""
    case = h.ParityCase("ebc", "adagrad", "table_wise", "byte_scm", "mid")
    ref, tie = _models(case, 1, tmp_path)
    check = tie.module.id_bounds_check()
    host = HostBoundsCheck(tie)
    kjt = h.make_kjt(h.batch_ids(0, 0, 0))
    copy = host.to_device(kjt, h.CPU)
    tie(copy)
    assert (check.vouched_batches, check.checked_batches) == (1, 0)
    tie(copy)  # a vouch is spent by the batch it was for
    assert (check.vouched_batches, check.checked_batches) == (1, 1)
    rebuilt = KeyedJaggedTensor(keys=copy.keys(), values=copy.values(), lengths=copy.lengths())
    host.vouch(host.check(kjt), copy)
    tie(rebuilt)
    assert (check.vouched_batches, check.checked_batches) == (1, 2)
    # A vouch for a batch that never runs is forgotten with it.
    del copy
    gc.collect()
    assert check._vouched == {}
    # Trained as TorchRec's kernel does, vouched or not.
    for model in (ref, tie):
        for step in range(1, 4):
            batch = h.make_kjt(h.batch_ids(0, 0, step))
            batch = host.to_device(batch, h.CPU) if model is tie else batch
            h.loss_of(h.per_feature("ebc", model(batch))).backward()
    assert check.vouched_batches == 4
    diffs = h.compare(ref, tie)
    assert max(diffs.values()) <= h.TOLERANCE, diffs


@pytest.mark.parametrize("bounds_check", list(BoundsCheck))
def test_a_batch_the_host_check_refuses_meets_the_modules_own(
    bounds_check: BoundsCheck, tmp_path: Path
) -> None:
    """An out-of-range id is not vouched for: the module checks the batch itself and raises
    (ERROR) or looks up row 0 (WARN) exactly as without the host check."""
    case = h.ParityCase("ebc", "sgd", "table_wise", "dram", "full")
    tie = _tiered_model(case, 1, tmp_path, bounds_check)
    check = tie.module.id_bounds_check()
    host = HostBoundsCheck(tie)
    batch = _with_ids(h.batch_ids(0, 0, 0), "f1", 96)
    assert host.check(h.make_kjt(batch)) == []
    copy = host.to_device(h.make_kjt(batch), h.CPU)
    if bounds_check is BoundsCheck.ERROR:
        with pytest.raises(OutOfRangeIdError, match=r"table 't_tier': row id 96 \(feature 'f1'\)"):
            tie(copy)
    else:
        tie(copy)
        assert tie.module.out_of_range_ids() == {h.TIERED_TABLE: 1}
    assert (check.vouched_batches, check.checked_batches) == (0, 1)


def test_the_host_check_finds_sparse_features_wherever_a_batch_holds_them(
    tmp_path: Path,
) -> None:
    """A torchrec Batch, a dict and a tuple: each KeyedJaggedTensor on the host is checked
    and its copy vouched for; one already on another device is left to the module."""
    case = h.ParityCase("ebc", "sgd", "table_wise", "dram", "full")
    tie = _tiered_model(case, 1, tmp_path)
    check = tie.module.id_bounds_check()
    host = HostBoundsCheck(tie)
    good = h.make_kjt(h.batch_ids(0, 0, 0))
    bad = h.make_kjt(_with_ids(h.batch_ids(0, 0, 1), "f2", 40))
    batch = TorchrecBatch(
        dense_features=torch.zeros(1), sparse_features=good, labels=torch.zeros(1)
    )
    assert host.check(batch) == [(check, 0)]
    assert host.check({"a": bad, "b": (torch.zeros(1), [good])}) == [(check, 1)]
    meta = KeyedJaggedTensor(
        keys=["f2"],
        values=torch.zeros(1, dtype=torch.int64, device="meta"),
        lengths=torch.ones(1, dtype=torch.int64, device="meta"),
    )
    assert host.check(meta) == []
    assert host.check(torch.zeros(3)) == []
    assert HostBoundsCheck(torch.nn.Linear(1, 1)).check(good) == []


# ------------------------------------------------------------------------ world size 2


def _rank_main(rank: int, port: int, root: str, out: str) -> None:
    """Both ranks: row-wise and table-wise EBC; ERROR refuses each rank's bad batch, naming its
    own table, then both train on like the reference; WARN trains like the reference fed the
    bad ids as row 0."""
    torch.set_num_threads(1)
    results: dict[str, Any] = {}
    with process_group(
        backend="gloo", rank=rank, world_size=2, port=port, timeout=timedelta(seconds=120)
    ):
        try:
            # rank 0: an id past t_fused's end; rank 1: a negative id of the tiered table.
            feature, bad = ("f2", 45) if rank == 0 else ("f0", -3)
            for sharding in ("row_wise", "table_wise"):
                case = h.ParityCase("ebc", "adagrad", sharding, "byte_scm", "mid")
                ref, tie = _models(case, 2, Path(root) / f"err-{sharding}-{rank}")
                batch = _with_ids(h.batch_ids(0, rank, 0), feature, bad)
                try:
                    tie(h.make_kjt(batch))
                    results[f"error-{sharding}"] = "no error"
                except OutOfRangeIdError as e:
                    results[f"error-{sharding}"] = (e.table, e.feature, e.row_id)
                for step in range(1, STEPS):
                    for model in (ref, tie):
                        _step(model, "ebc", h.batch_ids(0, rank, step))
                results[f"error-{sharding}-diff"] = max(h.compare(ref, tie).values())

                ref, tie = _models(case, 2, Path(root) / f"warn-{sharding}-{rank}", "warn")
                for step in range(STEPS):
                    batch = h.batch_ids(0, rank, step)
                    if step in (1, 3):
                        batch = _with_ids(batch, feature, bad)
                    _step(tie, "ebc", batch)
                    _step(ref, "ebc", _zeroed(batch))
                results[f"warn-{sharding}-diff"] = max(h.compare(ref, tie).values())
                results[f"warn-{sharding}-counts"] = tie.module.out_of_range_ids()
        except Exception:
            results["failure"] = traceback.format_exc()
        finally:
            torch.save(results, os.path.join(out, f"rank{rank}.pt"))


@pytest.mark.slow
def test_world_size_2(tmp_path: Path) -> None:
    out = tempfile.mkdtemp(dir=tmp_path)
    mp.spawn(_rank_main, args=(free_port(), str(tmp_path), out), nprocs=2, join=True)
    for rank in range(2):
        results = torch.load(os.path.join(out, f"rank{rank}.pt"), weights_only=False)
        assert "failure" not in results, results["failure"]
        table, feature, bad = (h.FUSED_TABLE, "f2", 45) if rank == 0 else (h.TIERED_TABLE, "f0", -3)
        for sharding in ("row_wise", "table_wise"):
            assert results[f"error-{sharding}"] == (table, feature, bad), (rank, sharding)
            assert results[f"error-{sharding}-diff"] <= h.TOLERANCE, (rank, sharding)
            assert results[f"warn-{sharding}-diff"] <= h.TOLERANCE, (rank, sharding)
            assert results[f"warn-{sharding}-counts"] == {table: 2}, (rank, sharding)
    assert not dist.is_initialized() or dist.get_world_size() == 1
