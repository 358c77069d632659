"""Raw Criteo TSV reader: parsing, empty fields, hashing, malformed rows, globs and sharding."""

from __future__ import annotations

import gzip
import logging
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES

from apps.dlrm.data import CriteoTsvDataConfig, CriteoTsvDataset, MalformedRowError

SIZES = [1000 + t for t in range(26)]


def _line(label: int, dense: list[str], cats: list[str]) -> str:
    return "\t".join([str(label), *dense, *cats]) + "\n"


def _row(index: int) -> str:
    """A valid line whose int_0 is ``index``, so a test can tell which line a sample came from."""
    dense = [str(index)] + [str((index * 7 + j) % 50) for j in range(12)]
    cats = [f"{(index * 2654435761 + t * 97) % 2**32:08x}" for t in range(26)]
    return _line(index % 2, dense, cats)


def _write(path: Path, lines: list[str]) -> str:
    path.write_text("".join(lines))
    return str(path)


def _config(paths: list[str], **overrides: object) -> CriteoTsvDataConfig:
    fields: dict[str, object] = {
        "paths": paths,
        "batch_size": 4,
        "num_embeddings_per_feature": SIZES,
    }
    fields.update(overrides)
    return CriteoTsvDataConfig(**fields)  # type: ignore[arg-type]


def _line_indices(batches: list) -> list[int]:  # type: ignore[type-arg]
    """Recovers each sample's int_0 (its line index) from the log1p dense value."""
    dense = torch.cat([b.dense_features for b in batches])[:, 0].double()
    return [round(math.expm1(v)) for v in dense.tolist()]


def test_parses_values_and_fills_empty_fields(tmp_path: Path) -> None:
    dense = ["", "3", "-2", *["0"] * 10]
    cats = ["", "ff", "7fffffff", *["1"] * 23]
    path = _write(tmp_path / "day_0", [_line(1, dense, cats), _row(5)])
    batches = list(CriteoTsvDataset(_config([path])))
    assert len(batches) == 1
    batch = batches[0]
    assert batch.labels.tolist() == [1.0, 1.0]
    assert batch.dense_features.dtype == torch.float32
    expected = np.log1p([0.0, 3.0, 0.0])  # empty -> 0, negative clamped to 0
    np.testing.assert_allclose(batch.dense_features[0, :3].numpy(), expected, rtol=1e-6)
    kjt = batch.sparse_features
    assert kjt.keys() == DEFAULT_CAT_NAMES
    assert bool((kjt.lengths() == 1).all())
    ids = kjt.to_dict()
    assert ids["cat_0"].values()[0] == 0  # empty categorical -> bucket 0
    assert ids["cat_1"].values()[0] == 0xFF % SIZES[1]
    assert ids["cat_2"].values()[0] == 0x7FFFFFFF % SIZES[2]
    for t, key in enumerate(DEFAULT_CAT_NAMES):
        values = ids[key].values()
        assert int(values.min()) >= 0 and int(values.max()) < SIZES[t]


def test_hashes_wider_than_64_bits_reduce_exactly(tmp_path: Path) -> None:
    wide = "f" * 20
    path = _write(tmp_path / "day_0", [_line(0, ["1"] * 13, [wide] * 26)])
    kjt = next(iter(CriteoTsvDataset(_config([path])))).sparse_features
    expected = [(16**20 - 1) % n for n in SIZES]
    assert kjt.values().tolist() == expected


def test_raw_id_features_keep_their_values(tmp_path: Path) -> None:
    """A virtual table's feature: the value is the id, no modulo (a wider one than int64 is
    left for the bounds check, as the largest int64)."""
    cats = ["7fffffff", "ffffffff", "", *["ff"] * 23]
    path = _write(tmp_path / "day_0", [_line(0, ["1"] * 13, cats)])
    sizes = [2**40, 2**40, *SIZES[2:]]
    config = _config([path], num_embeddings_per_feature=sizes, raw_id_features=[0, 1, 2])
    ids = next(iter(CriteoTsvDataset(config))).sparse_features.values().tolist()
    assert ids[:4] == [0x7FFFFFFF, 0xFFFFFFFF, 0, 0xFF % SIZES[3]]
    wide = _write(tmp_path / "day_1", [_line(0, ["1"] * 13, ["f" * 20] * 26)])
    config = _config([wide], num_embeddings_per_feature=sizes, raw_id_features=[0])
    ids = next(iter(CriteoTsvDataset(config))).sparse_features.values().tolist()
    assert ids[0] == 2**63 - 1 and ids[1] == (16**20 - 1) % 2**40
    with pytest.raises(ValueError, match=r"raw_id_features=\[26\]"):
        CriteoTsvDataset(_config([path], raw_id_features=[26]))


def test_batches_files_and_globs_in_order(tmp_path: Path) -> None:
    _write(tmp_path / "day_1", [_row(i) for i in range(5, 9)])
    _write(tmp_path / "day_0", [_row(i) for i in range(5)])
    ds = CriteoTsvDataset(_config([str(tmp_path / "day_*")], batch_size=4))
    assert ds.paths == [str(tmp_path / "day_0"), str(tmp_path / "day_1")]
    batches = list(ds)
    assert [len(b.labels) for b in batches] == [4, 4, 1]
    assert _line_indices(batches) == list(range(9))
    dropped = list(CriteoTsvDataset(_config([str(tmp_path / "day_*")], drop_last=True)))
    assert [len(b.labels) for b in dropped] == [4, 4]


def test_start_batch_and_num_batches(tmp_path: Path) -> None:
    path = _write(tmp_path / "day_0", [_row(i) for i in range(10)])
    resumed = list(CriteoTsvDataset(_config([path], batch_size=3), start_batch=2))
    assert _line_indices(resumed) == [6, 7, 8, 9]
    capped = list(CriteoTsvDataset(_config([path], batch_size=3, num_batches=2)))
    assert _line_indices(capped) == list(range(6))


def test_reads_gzipped_files(tmp_path: Path) -> None:
    path = tmp_path / "day_0.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(_row(i) for i in range(3))
    assert _line_indices(list(CriteoTsvDataset(_config([str(path)])))) == [0, 1, 2]


def test_missing_paths_are_named(tmp_path: Path) -> None:
    missing = str(tmp_path / "day_9")
    with pytest.raises(FileNotFoundError, match="day_9"):
        CriteoTsvDataset(_config([missing]))
    with pytest.raises(FileNotFoundError, match="nothing_"):
        CriteoTsvDataset(_config([str(tmp_path / "nothing_*")]))


def _malformed_file(tmp_path: Path) -> str:
    good = [_row(i) for i in range(4)]
    lines = [
        good[0],
        "1\t2\t3\n",  # line 2: too few fields
        _row(1).replace("1", "x", 1),  # line 3: label "x"
        good[1],
        _line(0, ["1.5", *["0"] * 12], ["a"] * 26),  # line 5: non-integer dense
        _line(0, ["1"] * 13, ["zz", *["a"] * 25]),  # line 6: non-hex categorical
        good[2],
        _line(0, ["1"] * 13, ["-a", *["a"] * 25]),  # line 8: negative hex
        good[3],
    ]
    return _write(tmp_path / "day_0", lines)


def test_skip_mode_counts_and_logs_malformed_rows(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _malformed_file(tmp_path)
    ds = CriteoTsvDataset(_config([path]))
    with caplog.at_level(logging.WARNING, logger="apps.dlrm.data.criteo_tsv"):
        batches = list(ds)
    assert _line_indices(batches) == [0, 1, 2, 3]
    assert ds.num_skipped == 5
    assert len(ds.skipped_examples) == 5
    assert ds.skipped_examples[0].startswith(f"{path}:2: expected 40")
    assert [e.split(":")[1] for e in ds.skipped_examples] == ["2", "3", "5", "6", "8"]
    assert ds.skipped_examples[1].endswith("label 'x' is not 0 or 1")
    assert ds.skipped_examples[2].endswith("dense feature int_0 '1.5' is not an integer")
    assert ds.skipped_examples[3].endswith("categorical feature cat_0 'zz' is not hexadecimal")
    assert ds.skipped_examples[4].endswith("categorical feature cat_0 '-a' is not hexadecimal")
    assert "skipped 5 malformed" in caplog.text and f"{path}:2" in caplog.text
    list(ds)  # a second pass counts afresh
    assert ds.num_skipped == 5


def test_fail_mode_raises_with_file_and_line(tmp_path: Path) -> None:
    path = _malformed_file(tmp_path)
    ds = CriteoTsvDataset(_config([path], on_error="fail", batch_size=1))
    it = iter(ds)
    next(it)  # line 1 is fine
    with pytest.raises(MalformedRowError, match=f"{path}:2: expected 40") as info:
        next(it)
    assert info.value.path == path and info.value.line_number == 2


def test_bad_on_error_lists_the_allowed_values(tmp_path: Path) -> None:
    path = _write(tmp_path / "day_0", [_row(0)])
    with pytest.raises(ValueError, match="'skip', 'fail'"):
        CriteoTsvDataset(_config([path], on_error="ignore"))


def test_ranks_get_disjoint_round_robin_lines(tmp_path: Path) -> None:
    _write(tmp_path / "day_0", [_row(i) for i in range(7)])
    _write(tmp_path / "day_1", [_row(i) for i in range(7, 11)])
    paths = [str(tmp_path / "day_0"), str(tmp_path / "day_1")]
    shards = [
        _line_indices(list(CriteoTsvDataset(_config(paths), rank=r, world_size=3)))
        for r in range(3)
    ]
    assert shards == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]


def test_malformed_rows_are_reported_by_the_rank_that_owns_them(tmp_path: Path) -> None:
    path = _malformed_file(tmp_path)  # malformed lines 2, 3, 5, 6, 8 -> indices 1, 2, 4, 5, 7
    ranks = [CriteoTsvDataset(_config([path]), rank=r, world_size=2) for r in range(2)]
    for ds in ranks:
        list(ds)
    assert [ds.num_skipped for ds in ranks] == [2, 3]
