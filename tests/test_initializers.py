"""RowSeededUniform: a row's initial values do not depend on the shard or chunk that holds it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from tests.parity.sweep import regions
from torchrec_mtrains.distributed import (
    TIERED_KERNEL,
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.initializers import BLOCK_ROWS, IdSeededUniform, RowSeededUniform

ROWS = {"t_a": 3 * BLOCK_ROWS + 17, "t_b": 300}
DIM = 16


def test_any_chunking_gives_the_same_rows() -> None:
    init = RowSeededUniform(seed=3, dim=8, low=-1.0, high=1.0)
    whole = torch.empty(2 * BLOCK_ROWS + 5, 8)
    init(whole)
    assert float(whole.min()) >= -1.0 and float(whole.max()) <= 1.0
    assert whole.unique().numel() > whole.numel() // 2  # random, not a pattern
    pieces = torch.empty_like(whole)
    for start, count in [(0, 1), (1, BLOCK_ROWS), (BLOCK_ROWS + 1, 777), (BLOCK_ROWS + 778, 4000)]:
        init.fill(pieces[start : start + count], start)
    init.fill(pieces[BLOCK_ROWS + 4778 :], BLOCK_ROWS + 4778)
    assert torch.equal(pieces, whole)
    right = torch.empty(whole.shape[0], 3)
    init.fill(right, 0, first_col=5)
    assert torch.equal(right, whole[:, 5:])
    assert not torch.equal(
        whole, RowSeededUniform(seed=4, dim=8, low=-1.0, high=1.0)(whole.clone())
    )
    with pytest.raises(ValueError, match="exceed the table's dim 8"):
        init.fill(torch.empty(2, 4), 0, first_col=6)


@pytest.fixture(scope="module")
def _group(one_rank_process_group: None) -> None:
    """One rank."""


GENERATORS = {
    "table_wise": lambda kernel: table_wise(rank=0, compute_kernel=kernel),
    "column_wise": lambda kernel: column_wise(ranks=[0, 0], compute_kernel=kernel),
    "row_wise": lambda kernel: row_wise(compute_kernel=kernel),
}


def _model(root: Path | None, sharding: str = "table_wise") -> DistributedModelParallel:
    """TorchRec's FUSED model, table-wise (``root`` None), or the tiered sharder's with every
    table ``sharding``: t_a on the block tier (filled 1,000 rows a chunk), t_b FUSED; every
    table initialized by RowSeededUniform."""
    tables = [
        EmbeddingBagConfig(
            name=name,
            num_embeddings=rows,
            embedding_dim=DIM,
            feature_names=[f"f_{name}"],
            init_fn=RowSeededUniform(seed=i, dim=DIM),
        )
        for i, (name, rows) in enumerate(ROWS.items())
    ]
    fused = {"optimizer": OptimType.EXACT_SGD, "learning_rate": 0.1}
    sharder: EmbeddingBagCollectionSharder
    if root is None:
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        gens = {name: GENERATORS["table_wise"]("fused") for name in ROWS}
    else:
        storage = TierStorage(root=str(root), checkpoint_chunk_rows=1000)
        sharder = TieredEmbeddingBagCollectionSharder(storage, fused_params=fused)
        gens = {
            "t_a": GENERATORS[sharding](TIERED_KERNEL),
            "t_b": GENERATORS[sharding]("fused"),
        }
    meta = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    plan = construct_module_sharding_plan(
        meta, gens, sharder=sharder, local_size=1, world_size=1, device_type="cpu"
    )
    if root is not None:
        plan["t_a"] = TieredParameterSharding.wrap(
            plan["t_a"], TieredTableOptions(tier="block_scm", cache_load_factor=0.1)
        )
    return DistributedModelParallel(
        EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
        device=torch.device("cpu"),
        plan=ShardingPlan({"": plan}),
        sharders=[sharder],
    )


def _tables(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        name = key.split(".")[-2]
        whole = torch.full((ROWS[name], DIM), float("nan"))
        for off, size, tensor in regions(value):
            whole[off[0] : off[0] + size[0], off[1] : off[1] + size[1]] = tensor
        out[name] = whole
    return out


@pytest.mark.parametrize("sharding", ["table_wise", "column_wise", "row_wise"])
def test_fused_and_tiered_models_start_from_the_same_weights(
    _group: None, tmp_path: Path, sharding: str
) -> None:
    """Initialized, not copied: TorchRec's own FUSED model (table-wise: TorchRec hands init_fn
    a rank's rows without their offsets), and the tiered sharder's under each sharding, its
    FUSED table filled shard by shard at its offsets, its tiered one chunk by chunk."""
    fused = _tables(_model(None))
    tiered = _tables(_model(tmp_path, sharding))
    for name in ROWS:
        assert not torch.isnan(fused[name]).any()
        assert torch.equal(fused[name], tiered[name]), name


def test_id_seeded_rows_depend_on_the_id_alone() -> None:
    init = IdSeededUniform(seed=5, dim=6, low=-0.5, high=0.25)
    whole = torch.empty(50, 6)
    init.fill(whole, 1000)
    # any order, any subset, any column range, fp16: the same values
    ids = torch.tensor([1049, 1000, 1017])
    some = torch.empty(3, 6)
    init.fill_ids(some, ids)
    assert torch.equal(some, whole[ids - 1000])
    cols = torch.empty(3, 2)
    init.fill_ids(cols, ids, first_col=4)
    assert torch.equal(cols, whole[ids - 1000, 4:])
    half = torch.empty(3, 6, dtype=torch.float16)
    init.fill_ids(half, ids)
    assert torch.equal(half, whole[ids - 1000].half())
    assert float(whole.min()) >= -0.5 and float(whole.max()) < 0.25
    # ids from a 2**50 space, another seed: other values
    far = torch.empty(2, 6)
    init.fill_ids(far, torch.tensor([2**50 - 1, 1000]))
    assert torch.equal(far[1], whole[0]) and not torch.equal(far[0], far[1])
    other = torch.empty(1, 6)
    IdSeededUniform(seed=6, dim=6, low=-0.5, high=0.25).fill(other, 1000)
    assert not torch.equal(other[0], whole[0])


def test_id_seeded_rows_are_the_same_compiled_or_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiled fill (the tier worker's) and numpy's give the same bits, any columns."""
    import torchrec_mtrains.initializers as initializers

    init = IdSeededUniform(seed=2**63 + 5, dim=64, low=-0.3, high=0.2)
    ids = torch.randint(0, 2**50, (5000,), generator=torch.Generator().manual_seed(0))
    filled = []
    for compiled in (True, False):
        monkeypatch.setattr(initializers, "NUMBA_AVAILABLE", compiled)
        rows = torch.empty(5000, 60)
        init.fill_ids(rows, ids, first_col=4)
        filled.append(rows)
    assert initializers.NUMBA_AVAILABLE is False and torch.equal(filled[0], filled[1])
    assert float(filled[0].min()) >= -0.3 and float(filled[0].max()) < 0.2


def test_id_seeded_init_takes_torchrecs_range_and_skips_meta_and_empty_weights() -> None:
    config = EmbeddingBagConfig(
        name="t_v", num_embeddings=2**40, embedding_dim=4, feature_names=["f"]
    )
    init = IdSeededUniform.for_config(config)
    assert init.high == pytest.approx(2**-20) and init.low == -init.high
    assert init(torch.empty(2**40, 4, device="meta")).is_meta
    assert init(torch.empty(0)).numel() == 0
