"""Criteo .npy reader: round trips with TorchRec's converter and with np.save, sharding, limits."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import (
    DEFAULT_CAT_NAMES,
    BinaryCriteoUtils,
    InMemoryBinaryCriteoIterDataPipe,
)
from torchrec.datasets.utils import Batch

from apps.dlrm.data import CriteoNpyDataConfig, CriteoNpyDataset

SIZES = [50 + 3 * t for t in range(26)]


def _save_day(root: Path, stem: str, start: int, rows: int, rng: np.random.Generator) -> None:
    """Writes one day in BinaryCriteoUtils' layout; dense column 0 holds the global row index."""
    dense = rng.random((rows, 13), dtype=np.float32)
    dense[:, 0] = np.arange(start, start + rows)
    np.save(root / f"{stem}_dense.npy", dense)
    np.save(root / f"{stem}_sparse.npy", rng.integers(0, 2**31, (rows, 26)))
    np.save(root / f"{stem}_labels.npy", rng.integers(0, 2, (rows, 1), dtype=np.int32))


@pytest.fixture
def two_days(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    _save_day(tmp_path, "day_0", 0, 23, rng)
    _save_day(tmp_path, "day_1", 23, 18, rng)
    return tmp_path


def _config(root: Path, **overrides: object) -> CriteoNpyDataConfig:
    fields: dict[str, object] = {
        "data_dir": str(root),
        "stems": ["day_0", "day_1"],
        "batch_size": 8,
        "num_embeddings_per_feature": SIZES,
    }
    fields.update(overrides)
    return CriteoNpyDataConfig(**fields)  # type: ignore[arg-type]


def _rows(batches: list[Batch]) -> list[int]:
    return [int(v) for v in torch.cat([b.dense_features for b in batches])[:, 0].tolist()]


def _sparse_matrix(batch: Batch) -> np.ndarray:
    kjt = batch.sparse_features
    return np.stack([kjt[key].values().numpy() for key in kjt.keys()], axis=1)  # noqa: SIM118 (a KJT is not a dict)


def test_round_trip_of_saved_arrays_across_files(two_days: Path) -> None:
    ds = CriteoNpyDataset(_config(two_days))
    batches = list(ds)
    assert len(ds) == len(batches) == 6  # 41 rows: 5 full batches and 1 of 1
    assert [len(b.labels) for b in batches] == [8] * 5 + [1]
    assert _rows(batches) == list(range(41))
    dense = np.concatenate([np.load(two_days / f"day_{d}_dense.npy") for d in range(2)])
    sparse = np.concatenate([np.load(two_days / f"day_{d}_sparse.npy") for d in range(2)])
    labels = np.concatenate([np.load(two_days / f"day_{d}_labels.npy") for d in range(2)])
    got_dense = torch.cat([b.dense_features for b in batches]).numpy()
    np.testing.assert_array_equal(got_dense, dense)
    got_sparse = np.concatenate([_sparse_matrix(b) for b in batches])
    np.testing.assert_array_equal(got_sparse, sparse % np.array(SIZES))
    got_labels = torch.cat([b.labels for b in batches])
    assert got_labels.dtype == torch.float32
    np.testing.assert_array_equal(got_labels.numpy(), labels.reshape(-1))
    assert batches[0].sparse_features.keys() == DEFAULT_CAT_NAMES


# TorchRec's converter builds a datapipe from a local function and warns about pickling.
@pytest.mark.filterwarnings("ignore:Local function is not supported by pickle")
def test_agrees_with_torchrec_reader_on_converted_tsv(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    lines = []
    for i in range(20):
        dense = [str(int(v)) if v >= 0 else "" for v in rng.integers(-1, 100, 13)]
        cats = [f"{int(v):08x}" for v in rng.integers(0, 2**32, 26)]
        lines.append("\t".join([str(i % 2), *dense, *cats]) + "\n")
    (tmp_path / "day_0.tsv").write_text("".join(lines))
    out = {kind: str(tmp_path / f"day_0_{kind}.npy") for kind in ("dense", "sparse", "labels")}
    BinaryCriteoUtils.tsv_to_npys(
        str(tmp_path / "day_0.tsv"), out["dense"], out["sparse"], out["labels"]
    )

    ours = list(CriteoNpyDataset(_config(tmp_path, stems=["day_0"], batch_size=6)))
    theirs = list(
        InMemoryBinaryCriteoIterDataPipe(
            "train", [out["dense"]], [out["sparse"]], [out["labels"]], 6, 0, 1, hashes=SIZES
        )
    )
    assert len(ours) == len(theirs) == 4
    for mine, ref in zip(ours, theirs):
        assert torch.equal(mine.dense_features, ref.dense_features)
        assert torch.equal(mine.labels, ref.labels.float())
        assert torch.equal(mine.sparse_features.values(), ref.sparse_features.values())


def test_ranks_get_equal_contiguous_disjoint_shares(two_days: Path) -> None:
    shares = [
        _rows(list(CriteoNpyDataset(_config(two_days), rank=r, world_size=3))) for r in range(3)
    ]
    # 41 rows over 3 ranks: 13 each, the last 2 rows dropped so batch counts match.
    assert shares == [list(range(0, 13)), list(range(13, 26)), list(range(26, 39))]
    lengths = {len(CriteoNpyDataset(_config(two_days), rank=r, world_size=3)) for r in range(3)}
    assert lengths == {2}


def test_start_batch_num_batches_and_drop_last(two_days: Path) -> None:
    resumed = list(CriteoNpyDataset(_config(two_days), start_batch=4))
    assert _rows(resumed) == list(range(32, 41))
    assert len(CriteoNpyDataset(_config(two_days, num_batches=2))) == 2
    assert len(CriteoNpyDataset(_config(two_days, drop_last=True))) == 5


def test_dataloader_workers_split_batches(two_days: Path) -> None:
    ds = CriteoNpyDataset(_config(two_days))
    loaded = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2))
    assert _rows(loaded) == list(range(41))


def test_missing_file_is_named(two_days: Path) -> None:
    (two_days / "day_1_labels.npy").unlink()
    with pytest.raises(FileNotFoundError, match=r"day_1_labels\.npy"):
        CriteoNpyDataset(_config(two_days))


def test_mismatched_shapes_are_rejected(two_days: Path) -> None:
    np.save(two_days / "day_1_labels.npy", np.zeros((5, 1), dtype=np.int32))
    with pytest.raises(ValueError, match="day_1"):
        CriteoNpyDataset(_config(two_days))
