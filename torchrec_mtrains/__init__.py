"""torchrec_mtrains: train DLRMs whose embedding tables live on a DRAM / SCM / NVMe hierarchy.

The TorchRec-facing names are imported lazily so that ``import torchrec_mtrains.tiers`` does not
pay for importing TorchRec.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "CheckpointManager": "torchrec_mtrains.checkpoint",
    "CheckpointOptions": "torchrec_mtrains.checkpoint",
    "TIERED_KERNEL": "torchrec_mtrains.distributed",
    "TierStorage": "torchrec_mtrains.distributed",
    "TieredEmbeddingBagCollectionSharder": "torchrec_mtrains.distributed",
    "TieredEmbeddingCollectionSharder": "torchrec_mtrains.distributed",
    "TieredParameterSharding": "torchrec_mtrains.distributed",
    "TieredTableOptions": "torchrec_mtrains.distributed",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'torchrec_mtrains' has no attribute {name!r}")
