"""Data sources of the DLRM app: synthetic, raw Criteo TSV and Criteo .npy, all yielding
``torchrec.datasets.utils.Batch`` (dense ``[B, D]`` float32, a KJT of ids, labels ``[B]`` float32).

:func:`build_dataloader` picks the source from a config's ``kind`` and the rows from a
:class:`Split` (training or held-out); :func:`register_configs` puts the three config schemas
into Hydra's ConfigStore group ``data``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torchrec.datasets.utils import Batch

from apps.dlrm.data.config import (
    CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE,
    CriteoNpyDataConfig,
    CriteoTsvDataConfig,
    DataConfig,
    Split,
    SyntheticDataConfig,
)
from apps.dlrm.data.criteo_npy import CriteoNpyDataset
from apps.dlrm.data.criteo_tsv import CriteoTsvDataset, MalformedRowError, OnError
from apps.dlrm.data.synthetic import FeistelPermutation, SyntheticCriteoDataset, ZipfRankSampler

__all__ = [
    "CONFIG_KINDS",
    "CRITEO_KAGGLE_NUM_EMBEDDINGS_PER_FEATURE",
    "CriteoNpyDataConfig",
    "CriteoNpyDataset",
    "CriteoTsvDataConfig",
    "CriteoTsvDataset",
    "DataConfig",
    "FeistelPermutation",
    "MalformedRowError",
    "OnError",
    "Split",
    "SyntheticCriteoDataset",
    "SyntheticDataConfig",
    "ZipfRankSampler",
    "build_dataloader",
    "register_configs",
    "to_data_config",
]

# kind -> config schema; the one place a new source is added (with its dataset below).
CONFIG_KINDS: dict[str, type[DataConfig]] = {
    "synthetic": SyntheticDataConfig,
    "criteo_tsv": CriteoTsvDataConfig,
    "criteo_npy": CriteoNpyDataConfig,
}


def _allowed() -> str:
    return ", ".join(repr(k) for k in CONFIG_KINDS)


def to_data_config(cfg_like: DataConfig | Mapping[Any, Any] | DictConfig) -> DataConfig:
    """Turns a config dataclass, a Hydra/OmegaConf node or a plain mapping into a dataclass.

    Raises:
        ValueError: for an unknown ``kind`` (listing the allowed ones) or unknown fields.
    """
    if is_dataclass(cfg_like) and not isinstance(cfg_like, type):
        kind = getattr(cfg_like, "kind", None)
        schema = CONFIG_KINDS.get(kind) if isinstance(kind, str) else None
        if schema is None:
            raise ValueError(f"data kind {kind!r} is not one of {_allowed()}")
        if not isinstance(cfg_like, schema):
            raise ValueError(
                f"{type(cfg_like).__name__} has kind {kind!r}, which needs a {schema.__name__}"
            )
        return cfg_like
    if isinstance(cfg_like, DictConfig):
        container = OmegaConf.to_container(cfg_like, resolve=True)
        if not isinstance(container, dict):
            raise TypeError(f"expected a mapping config, got {type(container).__name__}")
        values: dict[str, Any] = {str(k): v for k, v in container.items()}
    elif isinstance(cfg_like, Mapping):
        values = dict(cfg_like)
    else:
        raise TypeError(f"expected a data config, got {type(cfg_like).__name__}")
    kind = values.get("kind")
    schema = CONFIG_KINDS.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise ValueError(f"data kind {kind!r} is not one of {_allowed()}")
    known = {f.name for f in fields(schema)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(
            f"unknown fields for data kind {kind!r}: {unknown}; allowed: {sorted(known)}"
        )
    return schema(**values)


def build_dataloader(
    cfg_like: DataConfig | Mapping[Any, Any] | DictConfig,
    rank: int = 0,
    world_size: int = 1,
    *,
    start_batch: int = 0,
    split: Split | str = Split.TRAIN,
) -> Iterable[Batch]:
    """Builds this rank's stream of batches for the source named by ``cfg_like.kind``.

    The result is an ``IterableDataset`` that already yields whole batches: iterate it
    directly, or wrap it in ``DataLoader(ds, batch_size=None)`` (the synthetic and .npy
    sources also split their batches over DataLoader workers).

    Args:
        cfg_like: a :data:`DataConfig` dataclass, or a mapping / OmegaConf node with ``kind``.
        rank: this process's rank.
        world_size: number of ranks.
        start_batch: first batch to yield, to resume a run part-way.
        split: the training rows or the held-out rows; the two never overlap.

    Raises:
        ValueError: for an unknown ``kind`` (listing the allowed ones) or invalid values.
        FileNotFoundError: for a missing data file.
    """
    cfg = to_data_config(cfg_like)
    if isinstance(cfg, SyntheticDataConfig):
        return SyntheticCriteoDataset(cfg, rank, world_size, start_batch, split)
    if isinstance(cfg, CriteoTsvDataConfig):
        return CriteoTsvDataset(cfg, rank, world_size, start_batch, split)
    return CriteoNpyDataset(cfg, rank, world_size, start_batch, split)


def register_configs(group: str = "data") -> None:
    """Stores the config schemas in Hydra's ConfigStore as ``<group>/<kind>``."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for kind, schema in CONFIG_KINDS.items():
        store.store(group=group, name=kind, node=schema)
