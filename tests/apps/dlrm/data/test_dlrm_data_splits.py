"""Held-out splits of every data source: disjoint from the training rows, complete together,
sharded over ranks, from separate files or a share of the training files' rows."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.utils import Batch

from apps.dlrm.data import (
    CriteoNpyDataConfig,
    CriteoNpyDataset,
    CriteoTsvDataConfig,
    CriteoTsvDataset,
    Split,
    SyntheticCriteoDataset,
    SyntheticDataConfig,
    build_dataloader,
)

SIZES = [1000 + t for t in range(26)]


def _tsv(path: Path, first: int, count: int) -> str:
    """A TSV file whose line ``i`` has int_0 = ``first + i`` (a global row id)."""
    lines = []
    for row in range(first, first + count):
        dense = [str(row)] + ["1"] * 12
        cats = [f"{(row * 2654435761 + t) % 2**32:08x}" for t in range(26)]
        lines.append("\t".join([str(row % 2), *dense, *cats]) + "\n")
    path.write_text("".join(lines))
    return str(path)


def _tsv_rows(batches: list[Batch]) -> list[int]:
    if not batches:
        return []
    dense = torch.cat([b.dense_features for b in batches])[:, 0].double()
    return [round(math.expm1(v)) for v in dense.tolist()]


def _tsv_config(paths: list[str], **fields: object) -> CriteoTsvDataConfig:
    return CriteoTsvDataConfig(
        paths=paths,
        batch_size=4,
        num_embeddings_per_feature=SIZES,
        **fields,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("world", [1, 2, 3])
def test_tsv_fraction_holds_out_every_tenth_line_disjointly(tmp_path: Path, world: int) -> None:
    path = _tsv(tmp_path / "day_0", 0, 100)
    cfg = _tsv_config([path], eval_fraction=0.1)
    train = [
        _tsv_rows(list(CriteoTsvDataset(cfg, r, world, split=Split.TRAIN))) for r in range(world)
    ]
    held = [
        _tsv_rows(list(CriteoTsvDataset(cfg, r, world, split=Split.EVAL))) for r in range(world)
    ]
    all_train = sorted(row for rows in train for row in rows)
    all_held = sorted(row for rows in held for row in rows)
    assert all_held == list(range(9, 100, 10))  # floor((j + 1) / 10) steps up at j = 9, 19, ...
    assert not set(all_train) & set(all_held)
    assert sorted(all_train + all_held) == list(range(100))
    for r in range(world):  # each split's lines round-robin over the ranks
        assert held[r] == all_held[r::world]
        assert train[r] == all_train[r::world]


def test_tsv_fraction_counts_lines_across_files(tmp_path: Path) -> None:
    paths = [_tsv(tmp_path / "day_0", 0, 7), _tsv(tmp_path / "day_1", 7, 8)]
    held = _tsv_rows(list(CriteoTsvDataset(_tsv_config(paths, eval_fraction=0.25), split="eval")))
    assert held == [3, 7, 11]  # one line in four, counted over both files: floor(15 / 4) = 3


def test_tsv_eval_paths_are_the_held_out_split(tmp_path: Path) -> None:
    train = [_tsv(tmp_path / "day_0", 0, 10)]
    held = [_tsv(tmp_path / "day_1", 100, 6)]
    # eval_paths take precedence: no training line is held out then.
    cfg = _tsv_config(train, eval_paths=held, eval_fraction=0.5)
    assert _tsv_rows(list(CriteoTsvDataset(cfg))) == list(range(10))
    ds = CriteoTsvDataset(cfg, split=Split.EVAL)
    assert ds.paths == held
    assert _tsv_rows(list(ds)) == list(range(100, 106))
    assert _tsv_rows(list(CriteoTsvDataset(cfg, 1, 2, split=Split.EVAL))) == [101, 103, 105]


def test_tsv_without_held_out_rows_evaluates_nothing(tmp_path: Path) -> None:
    path = _tsv(tmp_path / "day_0", 0, 10)
    assert list(CriteoTsvDataset(_tsv_config([path]), split=Split.EVAL)) == []
    assert _tsv_rows(list(CriteoTsvDataset(_tsv_config([path])))) == list(range(10))


def test_tsv_num_batches_caps_training_only(tmp_path: Path) -> None:
    path = _tsv(tmp_path / "day_0", 0, 40)
    cfg = _tsv_config([path], eval_fraction=0.5, num_batches=1)
    assert len(_tsv_rows(list(CriteoTsvDataset(cfg)))) == 4
    assert len(_tsv_rows(list(CriteoTsvDataset(cfg, split=Split.EVAL)))) == 20


def test_a_file_in_both_splits_is_refused(tmp_path: Path) -> None:
    path = _tsv(tmp_path / "day_0", 0, 4)
    with pytest.raises(ValueError, match=r"eval_paths names .*day_0.*both trained and evaluated"):
        CriteoTsvDataset(_tsv_config([path], eval_paths=[str(tmp_path / "day_*")]))
    with pytest.raises(ValueError, match=r"eval_stems names \['b'\]"):
        CriteoNpyDataset(
            CriteoNpyDataConfig(data_dir=str(tmp_path), stems=["a", "b"], eval_stems=["b"])
        )


@pytest.mark.parametrize("fraction", [-0.1, 1.0, 2.0])
def test_eval_fraction_outside_0_1_is_refused(tmp_path: Path, fraction: float) -> None:
    path = _tsv(tmp_path / "day_0", 0, 4)
    with pytest.raises(ValueError, match=r"eval_fraction=.*\[0, 1\)"):
        CriteoTsvDataset(_tsv_config([path], eval_fraction=fraction))


def _npy_day(root: Path, stem: str, first: int, rows: int) -> None:
    dense = np.zeros((rows, 13), dtype=np.float32)
    dense[:, 0] = np.arange(first, first + rows)
    np.save(root / f"{stem}_dense.npy", dense)
    np.save(root / f"{stem}_sparse.npy", np.arange(rows * 26).reshape(rows, 26))
    np.save(root / f"{stem}_labels.npy", (np.arange(rows) % 2).reshape(rows, 1))


def _npy_rows(ds: CriteoNpyDataset) -> list[int]:
    batches = list(ds)
    if not batches:
        return []
    return [int(v) for v in torch.cat([b.dense_features for b in batches])[:, 0].tolist()]


@pytest.mark.parametrize("world", [1, 2])
def test_npy_fraction_holds_out_the_last_rows(tmp_path: Path, world: int) -> None:
    _npy_day(tmp_path, "day_0", 0, 23)
    _npy_day(tmp_path, "day_1", 23, 17)
    cfg = CriteoNpyDataConfig(
        data_dir=str(tmp_path), stems=["day_0", "day_1"], batch_size=4, eval_fraction=0.25
    )
    train = sorted(r for k in range(world) for r in _npy_rows(CriteoNpyDataset(cfg, k, world)))
    held = sorted(
        r for k in range(world) for r in _npy_rows(CriteoNpyDataset(cfg, k, world, split="eval"))
    )
    assert held == list(range(30, 40))  # floor(40 * 0.25) = 10 rows, the last ones
    assert train == list(range(30))
    assert len(CriteoNpyDataset(cfg, 0, world, split=Split.EVAL)) == math.ceil(10 / world / 4)


def test_npy_eval_stems_are_the_held_out_split(tmp_path: Path) -> None:
    _npy_day(tmp_path, "day_0", 0, 12)
    _npy_day(tmp_path, "day_23", 500, 5)
    cfg = CriteoNpyDataConfig(
        data_dir=str(tmp_path), stems=["day_0"], eval_stems=["day_23"], eval_fraction=0.5
    )
    assert _npy_rows(CriteoNpyDataset(cfg)) == list(range(12))
    assert _npy_rows(CriteoNpyDataset(cfg, split=Split.EVAL)) == list(range(500, 505))


def test_npy_without_held_out_rows_evaluates_nothing(tmp_path: Path) -> None:
    _npy_day(tmp_path, "day_0", 0, 12)
    cfg = CriteoNpyDataConfig(data_dir=str(tmp_path), stems=["day_0"])
    assert len(CriteoNpyDataset(cfg, split=Split.EVAL)) == 0


def test_synthetic_held_out_batches_are_fresh_draws() -> None:
    cfg = SyntheticDataConfig(batch_size=16, num_batches=4, num_embeddings_per_feature=[1000])
    train = list(SyntheticCriteoDataset(cfg))
    held = list(SyntheticCriteoDataset(cfg, split=Split.EVAL))
    assert len(held) == len(train) == 4
    for h in held:
        assert all(not torch.equal(h.dense_features, t.dense_features) for t in train)
    again = SyntheticCriteoDataset(cfg, split=Split.EVAL).batch_at(2)
    assert torch.equal(again.dense_features, held[2].dense_features)  # deterministic


def test_build_dataloader_passes_the_split(tmp_path: Path) -> None:
    cfg = SyntheticDataConfig(batch_size=4, num_batches=2, num_embeddings_per_feature=[100])
    assert build_dataloader(cfg, split="eval").split is Split.EVAL  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="split='test'"):
        build_dataloader(cfg, split="test")
