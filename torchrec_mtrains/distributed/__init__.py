"""The TorchRec plugin: tiered kernels, grouped lookups, sharded modules and sharders."""

from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.sharders import (
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
)

__all__ = [
    "TIERED_KERNEL",
    "TierStorage",
    "TieredEmbeddingBagCollectionSharder",
    "TieredEmbeddingCollectionSharder",
    "TieredParameterSharding",
    "TieredTableOptions",
]
