"""Storage tiers: one module per backend, all registered by name in :data:`TIERS`.

Importing this package registers the built-in tiers (``dram``, ``byte_scm``, ``block_scm``).
The log-structured block tier ``log_block_scm`` registers itself when
:mod:`torchrec_mtrains.tiers.log_block_scm` is imported: the distributed layer cannot place
tables on it yet (its checkpoints map a block tier's file as the flat row array, which a log
is not), and code that enumerates :data:`TIERS` as the tiers tables can use must not see it.
A new tier is one new module defining a :class:`TierOptions` dataclass and a :class:`RowStore`
subclass naming it as ``options_type``, decorated with :func:`register_tier`.
"""

from torchrec_mtrains.tiers import block_scm, byte_scm, dram  # noqa: F401  (registers tiers)
from torchrec_mtrains.tiers._blockio import IOEngineKind
from torchrec_mtrains.tiers.base import (
    TIERS,
    FileHeader,
    HeaderMismatchError,
    OpenMode,
    RowStore,
    RowStoreError,
    TierOptions,
    TierStats,
    open_store,
    register_tier,
    resolve_options,
    tier_class,
)
from torchrec_mtrains.tiers.block_scm import BlockScmOptions
from torchrec_mtrains.tiers.byte_scm import ByteScmOptions
from torchrec_mtrains.tiers.dram import DramOptions

__all__ = [
    "TIERS",
    "BlockScmOptions",
    "ByteScmOptions",
    "DramOptions",
    "FileHeader",
    "HeaderMismatchError",
    "IOEngineKind",
    "OpenMode",
    "RowStore",
    "RowStoreError",
    "TierOptions",
    "TierStats",
    "open_store",
    "register_tier",
    "resolve_options",
    "tier_class",
]
