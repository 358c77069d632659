"""Helpers shared by the data sources: argument checks and numpy -> ``Batch`` packing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np
import numpy.typing as npt
import torch
from torch.utils.data import get_worker_info
from torchrec.datasets.criteo import DEFAULT_CAT_NAMES
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

T = TypeVar("T")


def feature_names(num_sparse: int) -> list[str]:
    """KJT keys ``cat_0 .. cat_{n-1}``: TorchRec's Criteo names, so its DLRM configs match."""
    if num_sparse <= len(DEFAULT_CAT_NAMES):
        return list(DEFAULT_CAT_NAMES[:num_sparse])
    return [f"cat_{i}" for i in range(num_sparse)]


def per_table(values: Sequence[T], num_tables: int, name: str) -> list[T]:
    """Broadcasts a one-entry list to ``num_tables`` entries; other lengths must match."""
    if len(values) == 1:
        return [values[0]] * num_tables
    if len(values) != num_tables:
        raise ValueError(
            f"{name} has {len(values)} entries; expected 1 or {num_tables} (one per table)"
        )
    return list(values)


def check_positive(value: int, name: str) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


def check_stream(
    rank: int, world_size: int, batch_size: int, start_batch: int, num_batches: int | None
) -> None:
    """The checks every data source makes of where its stream starts and how long it is."""
    check_rank(rank, world_size)
    check_positive(batch_size, "batch_size")
    if start_batch < 0:
        raise ValueError(f"start_batch must be >= 0, got {start_batch}")
    if num_batches is not None and num_batches < 0:
        raise ValueError(f"num_batches must be >= 0 or None, got {num_batches}")


def check_fraction(value: float, name: str = "eval_fraction") -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value} must lie in [0, 1): the share of rows held out")


def check_disjoint(train: Sequence[str], held_out: Sequence[str], option: str) -> None:
    """Evaluation must never read rows trained on: no file may be in both splits."""
    shared = sorted(set(train) & set(held_out))
    if shared:
        raise ValueError(
            f"{option} names {shared}, which the training split reads too: a file would be "
            "both trained and evaluated on; list each under one split"
        )


def check_sizes(sizes: Sequence[int], name: str = "num_embeddings_per_feature") -> None:
    bad = [n for n in sizes if n < 1]
    if bad:
        raise ValueError(f"{name} must all be >= 1, got {bad}")


def worker_shard() -> tuple[int, int]:
    """(worker id, worker count) of the current DataLoader worker; (0, 1) in the main process."""
    info = get_worker_info()
    if info is None:
        return 0, 1
    return int(info.id), int(info.num_workers)


def one_hot_batch(
    dense: npt.NDArray[np.float32],
    sparse: npt.NDArray[np.int64],
    labels: npt.NDArray[np.float32],
    keys: list[str],
) -> Batch:
    """Packs ``[B, D]`` dense, ``[B, T]`` one-hot ids and ``[B]`` labels into a ``Batch``.

    The KJT is key-major (all samples of ``keys[0]``, then ``keys[1]`` ...), as TorchRec expects.
    """
    batch_size = sparse.shape[0]
    values = np.ascontiguousarray(sparse.T).reshape(-1)
    return Batch(
        dense_features=torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32)),
        sparse_features=KeyedJaggedTensor(
            keys=keys,
            values=torch.from_numpy(values.astype(np.int64, copy=False)),
            lengths=torch.ones(batch_size * len(keys), dtype=torch.int32),
        ),
        labels=torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32).reshape(-1)),
    )
