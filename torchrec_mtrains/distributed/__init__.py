"""The TorchRec plugin: tiered kernels, grouped lookups, sharded modules and sharders."""

from torchrec_mtrains.distributed.id_bounds import HostBoundsCheck, OutOfRangeIdError
from torchrec_mtrains.distributed.options import (
    TIERED_KERNEL,
    BoundsCheck,
    TieredParameterSharding,
    TieredTableOptions,
    TierStorage,
)
from torchrec_mtrains.distributed.sharders import (
    TieredEmbeddingBagCollectionSharder,
    TieredEmbeddingCollectionSharder,
)
from torchrec_mtrains.distributed.tiered_tables import TableIdError

__all__ = [
    "TIERED_KERNEL",
    "BoundsCheck",
    "HostBoundsCheck",
    "OutOfRangeIdError",
    "TableIdError",
    "TierStorage",
    "TieredEmbeddingBagCollectionSharder",
    "TieredEmbeddingCollectionSharder",
    "TieredParameterSharding",
    "TieredTableOptions",
]
