"""Reader of Criteo in TorchRec's binary layout (``BinaryCriteoUtils.tsv_to_npys``).

Per file stem ``s``: ``s_dense.npy`` float32 ``[N, 13]`` (already log-transformed),
``s_sparse.npy`` int ``[N, 26]`` and ``s_labels.npy`` int ``[N, 1]``.

Why not TorchRec's ``InMemoryBinaryCriteoIterDataPipe``: it works on CPU, but it reseeds
numpy's global RNG in its constructor, loads every file whole on every rank unless
``mmap_mode`` is set, hard-codes 26 features, yields int32 labels and cannot start at a
given batch. This reader memory-maps the files and reuses TorchRec's
``BinaryCriteoUtils.get_file_row_ranges_and_remainder`` to give each rank one contiguous row
range, so a rank touches only its own pages and reads them sequentially. Every rank gets the
same number of rows (the last ``total % world_size`` rows of a split are dropped), hence the
same number of batches, which keeps collective calls in step.

The held-out split is the files of ``eval_stems`` or, without them, the last ``eval_fraction``
of the rows of ``stems`` (evaluation follows training in time, as with TorchRec's held-out
last day); the training split is everything before.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import BinaryCriteoUtils
from torchrec.datasets.utils import Batch

from apps.dlrm.data._common import (
    check_disjoint,
    check_fraction,
    check_sizes,
    check_stream,
    feature_names,
    one_hot_batch,
    per_table,
    worker_shard,
)
from apps.dlrm.data.config import CriteoNpyDataConfig, Split

logger = logging.getLogger(__name__)


def _load(path: str) -> npt.NDArray[np.generic]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Criteo .npy file not found: {path!r}")
    array: npt.NDArray[np.generic] = np.load(path, mmap_mode="r")
    return array


class CriteoNpyDataset(IterableDataset[Batch]):
    """Batches of this rank's contiguous share of Criteo .npy files, memory-mapped.

    Args:
        config: directory, file stems, batch size, table sizes and limits.
        rank: this process's rank.
        world_size: number of ranks.
        start_batch: first batch index to yield (to resume a run).
        split: the training rows or the held-out ones.

    Attributes:
        num_rows: rows of this split assigned to this rank.

    Raises:
        FileNotFoundError: naming a missing file.
        ValueError: if the arrays' shapes do not fit together or the config is invalid.

    Example::

        ds = CriteoNpyDataset(CriteoNpyDataConfig(data_dir="/data/criteo_npy",
                                                  stems=["day_0", "day_1"]))
        batch = next(iter(ds))
    """

    def __init__(
        self,
        config: CriteoNpyDataConfig,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        split: Split | str = Split.TRAIN,
    ) -> None:
        super().__init__()
        check_stream(rank, world_size, config.batch_size, start_batch, config.num_batches)
        check_fraction(config.eval_fraction)
        if not config.data_dir:
            raise ValueError("data_dir must name the directory of the Criteo .npy files")
        if not config.stems:
            raise ValueError("stems must list at least one file stem, e.g. ['day_0']")
        check_disjoint(list(config.stems), list(config.eval_stems), "eval_stems")
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        self.split = Split.parse(split)
        evaluating = self.split is Split.EVAL
        stems = config.eval_stems if evaluating and config.eval_stems else config.stems

        self._dense: list[npt.NDArray[np.generic]] = []
        self._sparse: list[npt.NDArray[np.generic]] = []
        self._labels: list[npt.NDArray[np.generic]] = []
        for stem in stems:
            prefix = os.path.join(config.data_dir, stem)
            dense = _load(prefix + "_dense.npy")
            sparse = _load(prefix + config.sparse_suffix)
            labels = _load(prefix + "_labels.npy")
            rows = dense.shape[0]
            if (
                dense.ndim != 2
                or sparse.ndim != 2
                or labels.shape not in ((rows,), (rows, 1))
                or sparse.shape[0] != rows
            ):
                raise ValueError(
                    f"{prefix}: need dense [N, D], sparse [N, T], labels [N, 1] with one N; "
                    f"got {dense.shape}, {sparse.shape}, {labels.shape}"
                )
            if self._dense and (
                dense.shape[1] != self._dense[0].shape[1]
                or sparse.shape[1] != self._sparse[0].shape[1]
            ):
                raise ValueError(f"{prefix}: feature counts differ from {stems[0]}")
            self._dense.append(dense)
            self._sparse.append(sparse)
            self._labels.append(labels.reshape(rows))

        num_tables = self._sparse[0].shape[1]
        self.keys = feature_names(num_tables)
        sizes = per_table(
            config.num_embeddings_per_feature, num_tables, "num_embeddings_per_feature"
        )
        check_sizes(sizes)
        self._sizes = np.asarray(sizes, dtype=np.int64)

        lengths = [int(d.shape[0]) for d in self._dense]
        total = sum(lengths)
        # Global rows [first, end) of this split: with eval_stems, all rows of its own files;
        # else the held-out tail of the training files, or what precedes it.
        held = int(total * config.eval_fraction)
        if config.eval_stems:
            first, end = 0, total
        else:
            first, end = (total - held, total) if evaluating else (0, total - held)
        self.num_rows = (end - first) // world_size
        # (file index, first row, end row) of this rank's contiguous share, in order.
        self._segments: list[tuple[int, int, int]] = []
        if self.num_rows > 0:
            ranges, _ = BinaryCriteoUtils.get_file_row_ranges_and_remainder(
                lengths,
                rank,
                world_size,
                start_row=first,
                last_row=first + self.num_rows * world_size - 1,
            )
            self._segments = [(i, lo, hi + 1) for i, (lo, hi) in sorted(ranges.items())]
        elif end > first or not evaluating:
            logger.warning(
                "rank %d gets no %s rows: %d rows for %d ranks",
                rank,
                self.split.value,
                end - first,
                world_size,
            )
        full, rest = divmod(self.num_rows, config.batch_size)
        self.num_batches = full + (1 if rest and not config.drop_last else 0)
        if config.num_batches is not None and not evaluating:
            self.num_batches = min(self.num_batches, config.num_batches)

    def __len__(self) -> int:
        return max(0, self.num_batches - self.start_batch)

    def __iter__(self) -> Iterator[Batch]:
        worker, num_workers = worker_shard()
        for index in range(self.start_batch + worker, self.num_batches, num_workers):
            yield self.batch_at(index)

    def batch_at(self, index: int) -> Batch:
        """Batch ``index`` of this rank (rows ``index * B`` onwards of its share)."""
        if not 0 <= index < self.num_batches:
            raise IndexError(f"batch {index} out of range [0, {self.num_batches})")
        begin = index * self.config.batch_size
        end = min(begin + self.config.batch_size, self.num_rows)
        dense, sparse, labels = [], [], []
        offset = 0  # position of the current segment within this rank's share
        for file_index, lo, hi in self._segments:
            take_lo, take_hi = max(begin - offset, 0), min(end - offset, hi - lo)
            if take_lo < take_hi:
                rows = slice(lo + take_lo, lo + take_hi)
                dense.append(self._dense[file_index][rows])
                sparse.append(self._sparse[file_index][rows])
                labels.append(self._labels[file_index][rows])
            offset += hi - lo
        return one_hot_batch(
            np.concatenate(dense).astype(np.float32),
            np.concatenate(sparse).astype(np.int64) % self._sizes,
            np.concatenate(labels).astype(np.float32),
            self.keys,
        )
