"""Reader of the raw Criteo click logs (tab-separated text, one file per day).

Each line holds a 0/1 label, 13 integer features and 26 categorical features written as
hexadecimal hashes, any feature possibly empty. Conversion, as is customary for DLRM:

* dense: empty -> 0, negative -> 0, then ``log(1 + x)``;
* categorical: hex -> int, then modulo the table's row count. Criteo's values are already
  32-bit hashes, so the modulo is the hashing trick. An empty field is value 0, hence row 0
  of its table (a fixed "missing" bucket that it shares with real values that hash there).
  A feature of ``raw_id_features`` (a virtual table's) keeps its values as they are: raw ids.

Held-out rows come from ``eval_paths``, or else every line ``j`` (counted across the training
files in order) at which ``floor((j + 1) * eval_fraction)`` steps up; the training split is
the complement, so the two never share a line. Within a split, lines are sharded round-robin
over ranks (the split's ``k``-th line belongs to rank ``k % world_size``): every rank scans
every file but parses only its own lines, so the shards are disjoint and need no index of the
files. A malformed line is reported with its file and 1-based line number; ``on_error``
chooses whether it is skipped and counted or raised.
"""

from __future__ import annotations

import glob
import gzip
import io
import logging
import os
from collections.abc import Iterator, Sequence
from enum import Enum

import numpy as np
import numpy.typing as npt
from torch.utils.data import IterableDataset
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
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
from apps.dlrm.data.config import CriteoTsvDataConfig, Split, parse_choice

logger = logging.getLogger(__name__)

NUM_FIELDS = 1 + INT_FEATURE_COUNT + CAT_FEATURE_COUNT
_GLOB_CHARS = frozenset("*?[")


class OnError(str, Enum):
    """What a reader does with a malformed row."""

    SKIP = "skip"
    FAIL = "fail"

    @classmethod
    def parse(cls, value: str | OnError) -> OnError:
        return parse_choice(cls, value, "on_error")


class MalformedRowError(ValueError):
    """A row that cannot be parsed, located by file and 1-based line number."""

    def __init__(self, path: str, line_number: int, reason: str) -> None:
        super().__init__(f"{path}:{line_number}: {reason}")
        self.path = path
        self.line_number = line_number
        self.reason = reason


def expand_paths(paths: str | Sequence[str]) -> list[str]:
    """Expands globs (matches sorted) and checks that every file exists.

    Raises:
        FileNotFoundError: naming a path that does not exist or a glob that matches nothing.
    """
    entries = [paths] if isinstance(paths, str) else list(paths)
    if not entries:
        raise ValueError("no Criteo TSV paths given")
    files: list[str] = []
    for entry in entries:
        if _GLOB_CHARS.intersection(entry):
            matches = sorted(glob.glob(entry))
            if not matches:
                raise FileNotFoundError(f"no file matches the pattern {entry!r}")
            files.extend(matches)
        elif os.path.isfile(entry):
            files.append(entry)
        else:
            raise FileNotFoundError(f"Criteo TSV file not found: {entry!r}")
    return files


def _show(field: bytes) -> str:
    return repr(field.decode("utf-8", errors="replace"))


def parse_row(line: bytes) -> tuple[int, list[int], list[int]]:
    """Parses one line into (label, raw dense ints, raw categorical ints).

    Raises:
        ValueError: saying which field is wrong.
    """
    fields = line.rstrip(b"\r\n").split(b"\t")
    if len(fields) != NUM_FIELDS:
        raise ValueError(f"expected {NUM_FIELDS} tab-separated fields, got {len(fields)}")
    if fields[0] not in (b"0", b"1"):
        raise ValueError(f"label {_show(fields[0])} is not 0 or 1")
    # Fast path: whole-row comprehensions; the field-by-field scan runs only to name a culprit.
    try:
        dense = [int(f) if f else 0 for f in fields[1 : 1 + INT_FEATURE_COUNT]]
        sparse = [int(f, 16) if f else 0 for f in fields[1 + INT_FEATURE_COUNT :]]
        if min(sparse) >= 0:
            return int(fields[0]), dense, sparse
    except ValueError:
        pass
    for i, field in enumerate(fields[1 : 1 + INT_FEATURE_COUNT]):
        try:
            int(field or b"0")
        except ValueError:
            raise ValueError(f"dense feature int_{i} {_show(field)} is not an integer") from None
    for i, field in enumerate(fields[1 + INT_FEATURE_COUNT :]):
        try:
            value = int(field or b"0", 16)
        except ValueError:
            value = -1
        if value < 0:
            raise ValueError(f"categorical feature cat_{i} {_show(field)} is not hexadecimal")
    raise AssertionError("unreachable: the fast path failed but no field is malformed")


def _open(path: str) -> gzip.GzipFile | io.BufferedReader:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


class CriteoTsvDataset(IterableDataset[Batch]):
    """Batches of this rank's rows of raw Criteo TSV files.

    Args:
        config: files, batch size, table sizes, error policy, held-out split and limits.
        rank: this process's rank.
        world_size: number of ranks.
        start_batch: number of leading batches to skip (to resume a run); they are parsed
            (malformed rows move batch boundaries) but not converted.
        split: the training rows or the held-out ones.

    Attributes:
        paths: the files this split reads, globs expanded.
        num_skipped: malformed rows skipped in the current or last pass (``on_error="skip"``).
        skipped_examples: the first few of those, as ``"file:line: reason"``.

    Note:
        Ranks' batch counts can differ by one (their line counts differ by at most one, and
        skipped rows shift that); a distributed loop should stop when any rank runs out, or
        set ``num_batches``. The dataset has no length: counting lines takes a full pass.

    Example::

        ds = CriteoTsvDataset(CriteoTsvDataConfig(paths=["/data/day_*"], batch_size=4096))
        for batch in ds:
            ...
    """

    max_examples = 5

    def __init__(
        self,
        config: CriteoTsvDataConfig,
        rank: int = 0,
        world_size: int = 1,
        start_batch: int = 0,
        split: Split | str = Split.TRAIN,
    ) -> None:
        super().__init__()
        check_stream(rank, world_size, config.batch_size, start_batch, config.num_batches)
        check_fraction(config.eval_fraction)
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.start_batch = start_batch
        self.split = Split.parse(split)
        self.on_error = OnError.parse(config.on_error)
        self.keys = feature_names(CAT_FEATURE_COUNT)
        sizes = per_table(
            config.num_embeddings_per_feature, CAT_FEATURE_COUNT, "num_embeddings_per_feature"
        )
        check_sizes(sizes)
        self._sizes = [int(n) for n in sizes]
        raw = [int(f) for f in config.raw_id_features]
        if any(not 0 <= f < CAT_FEATURE_COUNT for f in raw):
            raise ValueError(
                f"raw_id_features={raw}: give indices of categorical features "
                f"(0 to {CAT_FEATURE_COUNT - 1})"
            )
        # the modulus of each feature; 0 for raw ids, which stay as they are
        self._moduli = [0 if t in raw else n for t, n in enumerate(self._sizes)]
        train = expand_paths(([config.path] if config.path else []) + list(config.paths))
        held_out = expand_paths(list(config.eval_paths)) if config.eval_paths else []
        check_disjoint(
            [os.path.realpath(p) for p in train],
            [os.path.realpath(p) for p in held_out],
            "eval_paths",
        )
        self.paths = held_out if held_out and self.split is Split.EVAL else train
        # Without eval files, the held-out lines are interleaved with the training lines.
        self._fraction = 0.0 if held_out else float(config.eval_fraction)
        self.num_skipped = 0
        self.skipped_examples: list[str] = []

    def __iter__(self) -> Iterator[Batch]:
        _, num_workers = worker_shard()
        if num_workers > 1:
            raise ValueError(
                "CriteoTsvDataset shards by rank only; use it with DataLoader num_workers=0"
            )
        self.num_skipped = 0
        self.skipped_examples = []
        try:
            yield from self._batches()
        finally:
            if self.num_skipped:
                logger.warning(
                    "rank %d skipped %d malformed Criteo rows; first: %s",
                    self.rank,
                    self.num_skipped,
                    "; ".join(self.skipped_examples),
                )

    def _batches(self) -> Iterator[Batch]:
        cfg = self.config
        evaluating = self.split is Split.EVAL
        if evaluating and not cfg.eval_paths and self._fraction == 0.0:
            return  # nothing is held out: no need to scan the files
        limit = None if evaluating else cfg.num_batches
        fraction = self._fraction
        labels: list[int] = []
        dense: list[list[int]] = []
        sparse: list[list[int]] = []
        batches_done = 0
        line_index = 0  # over all lines of self.paths
        split_index = 0  # over this split's lines
        held_below = 0  # floor(line_index * fraction)
        for path in self.paths:
            with _open(path) as lines:
                for line_number, line in enumerate(lines, start=1):
                    if fraction:
                        line_index += 1
                        held_upto = int(line_index * fraction)
                        held, held_below = held_upto > held_below, held_upto
                        if held is not evaluating:
                            continue
                    owned = split_index % self.world_size == self.rank
                    split_index += 1
                    if not owned:
                        continue
                    if limit is not None and batches_done >= limit:
                        return
                    try:
                        label, row_dense, row_sparse = parse_row(line)
                    except ValueError as e:
                        error = MalformedRowError(path, line_number, str(e))
                        if self.on_error is OnError.FAIL:
                            raise error from None
                        self._record(error)
                        continue
                    labels.append(label)
                    dense.append(row_dense)
                    sparse.append(row_sparse)
                    if len(labels) == cfg.batch_size:
                        if batches_done >= self.start_batch:
                            yield self._to_batch(labels, dense, sparse)
                        batches_done += 1
                        labels, dense, sparse = [], [], []
        last_wanted = batches_done >= self.start_batch and (limit is None or batches_done < limit)
        if labels and not cfg.drop_last and last_wanted:
            yield self._to_batch(labels, dense, sparse)

    def _reduce(self, sparse: list[list[int]]) -> npt.NDArray[np.int64]:
        """Categorical values modulo table rows (raw ids as they are); values wider than
        int64 reduce in Python (a raw id that wide is out of any table: the bounds check
        refuses the largest id an int64 holds in its place)."""
        moduli = self._moduli
        try:
            values = np.asarray(sparse, dtype=np.int64)
        except OverflowError:
            top = np.iinfo(np.int64).max
            return np.asarray(
                [[v % n if n else min(v, top) for v, n in zip(row, moduli)] for row in sparse],
                dtype=np.int64,
            )
        raw = np.asarray([n == 0 for n in moduli])
        return np.where(raw, values, values % np.asarray([n or 1 for n in moduli], dtype=np.int64))

    def _record(self, error: MalformedRowError) -> None:
        self.num_skipped += 1
        if len(self.skipped_examples) < self.max_examples:
            self.skipped_examples.append(str(error))

    def _to_batch(
        self, labels: list[int], dense: list[list[int]], sparse: list[list[int]]
    ) -> Batch:
        dense_arr = np.log1p(np.maximum(np.asarray(dense, dtype=np.float64), 0.0))
        return one_hot_batch(
            dense_arr.astype(np.float32),
            self._reduce(sparse),
            np.asarray(labels, dtype=np.float32),
            self.keys,
        )
