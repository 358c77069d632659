"""Typed configs of the DLRM app's data sources, one dataclass per source.

They are plain (not frozen) dataclasses so that they work as Hydra structured configs: Hydra
marks a frozen dataclass read-only and then refuses command-line overrides of its list fields.
Each carries a ``kind`` discriminator that :func:`apps.dlrm.data.build_dataloader` dispatches on.
Values are checked when a dataset is built from them, not here, so that a config can be
composed piecewise.

Every source has two disjoint splits (:class:`Split`): the rows trained on and held-out rows to
evaluate on. The Criteo sources take the held-out rows from separate files (``eval_paths``,
``eval_stems``) or, without them, set aside ``eval_fraction`` of the training files' rows; the
synthetic source draws its held-out batches from a seed stream of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar


class Split(str, Enum):
    """Which rows a source yields: those to train on, or the held-out rows to evaluate on."""

    TRAIN = "train"
    EVAL = "eval"

    @classmethod
    def parse(cls, value: str | Split) -> Split:
        return parse_choice(cls, value, "split")


_E = TypeVar("_E", bound=Enum)


def parse_choice(kind: type[_E], value: str | _E, option: str) -> _E:
    """``value`` as a member of ``kind``; ``ValueError`` naming ``option`` and the choices."""
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{option}={value!r} is not one of {allowed}") from None


# Rows per categorical feature of the Criteo Kaggle (Display Advertising Challenge) data set, in
# feature order cat_0 .. cat_25, as TorchRec's DLRM example uses them.
CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE: tuple[int, ...] = (
    1460,
    583,
    10131227,
    2202608,
    305,
    24,
    12517,
    633,
    3,
    93145,
    5683,
    8351593,
    3194,
    27,
    14992,
    5461306,
    10,
    5652,
    2173,
    4,
    7046547,
    18,
    15,
    286181,
    105,
    142572,
)


def _kaggle_sizes() -> list[int]:
    return list(CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE)


@dataclass
class SyntheticDataConfig:
    """Criteo-shaped synthetic data with Zipf-skewed ids and learnable labels.

    Per-table lists (``num_embeddings_per_feature``, ``zipf_exponents``, ``pooling_factors``)
    have one entry per sparse feature, or a single entry that applies to all of them.

    Attributes:
        kind: discriminator, always ``"synthetic"``.
        batch_size: samples per batch (per rank).
        num_batches: batches per rank in one pass (an epoch); the dataset's length. The
            held-out split has as many, drawn from their own seed stream, so they are never
            trained on.
        seed: fixes ids, labels, the row permutations and the hidden label model.
        num_dense_features: dense features per sample (Criteo: 13).
        num_sparse_features: sparse features (tables) per sample (Criteo: 26).
        num_embeddings_per_feature: rows of each table; ids lie in ``[0, rows)``.
        zipf_exponents: skew of each table's id distribution, ``P(rank k) ~ k**-s``;
            0 is uniform, around 1.05-1.2 resembles production click logs.
        pooling_factors: ids per sample and table (1 = one-hot).
        random_pooling: if true, each bag's length is uniform on ``[1, 2 * pooling - 1]``
            (mean = the pooling factor) instead of fixed.
        sparse_signal: standard deviation of the hidden sparse part of the label logit.
        dense_signal: standard deviation of the hidden dense part of the label logit.
        label_bias: constant of the label logit; -1.6 gives a click rate near Criteo's ~25%.
    """

    kind: str = "synthetic"
    batch_size: int = 512
    num_batches: int = 100
    seed: int = 0
    num_dense_features: int = 13
    num_sparse_features: int = 26
    num_embeddings_per_feature: list[int] = field(default_factory=_kaggle_sizes)
    zipf_exponents: list[float] = field(default_factory=lambda: [1.1])
    pooling_factors: list[int] = field(default_factory=lambda: [1])
    random_pooling: bool = False
    sparse_signal: float = 1.5
    dense_signal: float = 1.0
    label_bias: float = -1.6


@dataclass
class CriteoTsvDataConfig:
    """Raw Criteo click logs: one tab-separated text file per day (optionally gzipped).

    Attributes:
        kind: discriminator, always ``"criteo_tsv"``.
        paths: files or glob patterns, read in the given order (each glob's matches sorted).
        path: one more file or glob, read first (``data.path=/data/day_0.gz`` on the command
            line is shorter than a list).
        batch_size: samples per batch (per rank).
        num_embeddings_per_feature: rows of each of the 26 tables (one entry = all);
            categorical values are taken modulo these.
        raw_id_features: features (indices) whose values are their ids as they are, with no
            modulo: a virtual table's (``model.virtual.features``), whose id space holds raw
            ids. A value outside it is the bounds check's to refuse, naming the feature.
        on_error: ``"skip"`` counts and logs malformed rows, ``"fail"`` raises on the first.
        drop_last: drop the last, incomplete batch of a rank.
        num_batches: stop a rank's training split after this many batches (``None`` = read
            everything).
        eval_paths: files or globs of the held-out split (e.g. the last day, as TorchRec's
            Criteo utilities hold it out); none of them may also be a training file.
        eval_fraction: without ``eval_paths``, the share of the training files' lines held
            out: every line ``j`` (counted across files) where ``floor((j + 1) * f)`` steps
            up, i.e. one line in ``1 / f`` spread evenly. Interleaved rather than the last
            lines because a text file's line count is unknown without a full pass.
    """

    kind: str = "criteo_tsv"
    paths: list[str] = field(default_factory=list)
    path: str = ""
    batch_size: int = 512
    num_embeddings_per_feature: list[int] = field(default_factory=_kaggle_sizes)
    raw_id_features: list[int] = field(default_factory=list)
    on_error: str = "skip"
    drop_last: bool = False
    num_batches: int | None = None
    eval_paths: list[str] = field(default_factory=list)
    eval_fraction: float = 0.0


@dataclass
class CriteoNpyDataConfig:
    """Criteo converted by TorchRec's ``BinaryCriteoUtils.tsv_to_npys`` into .npy files.

    For each stem ``s`` in ``stems`` the files ``{data_dir}/{s}_dense.npy``,
    ``{data_dir}/{s}{sparse_suffix}`` and ``{data_dir}/{s}_labels.npy`` are read.

    Attributes:
        kind: discriminator, always ``"criteo_npy"``.
        data_dir: directory holding the .npy files.
        stems: file stems in reading order, e.g. ``["day_0", "day_1"]`` (Kaggle: ``["train"]``).
        sparse_suffix: ``"_sparse.npy"``, or ``"_sparse_contig_freq.npy"`` for the output of
            ``BinaryCriteoUtils.sparse_to_contiguous``.
        batch_size: samples per batch (per rank).
        num_embeddings_per_feature: rows of each table (one entry = all); ids are taken
            modulo these.
        drop_last: drop the last, incomplete batch of a rank.
        num_batches: stop a rank's training split after this many batches (``None`` = read
            everything).
        eval_stems: file stems of the held-out split (e.g. ``["day_23"]``, the day TorchRec's
            Criteo utilities hold out); none of them may also be in ``stems``.
        eval_fraction: without ``eval_stems``, the share of the rows of ``stems`` held out:
            the last ``floor(N * f)`` of the ``N`` rows, so evaluation follows training in
            time as with a held-out last day.
    """

    kind: str = "criteo_npy"
    data_dir: str = ""
    stems: list[str] = field(default_factory=lambda: ["day_0"])
    sparse_suffix: str = "_sparse.npy"
    batch_size: int = 512
    num_embeddings_per_feature: list[int] = field(default_factory=_kaggle_sizes)
    drop_last: bool = False
    num_batches: int | None = None
    eval_stems: list[str] = field(default_factory=list)
    eval_fraction: float = 0.0


DataConfig = SyntheticDataConfig | CriteoTsvDataConfig | CriteoNpyDataConfig
