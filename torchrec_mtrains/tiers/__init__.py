"""Storage tiers: one module per backend, all registered by name in :data:`TIERS`.

Importing this package registers the built-in tiers (``dram``, ``byte_scm``, ``block_scm``).
A new tier is one new module defining a :class:`RowStore` subclass decorated with
:func:`register_tier`.
"""

from torchrec_mtrains.tiers import block_scm, byte_scm, dram  # noqa: F401  (registers tiers)
from torchrec_mtrains.tiers.base import (
    TIERS,
    FileHeader,
    HeaderMismatchError,
    OpenMode,
    RowStore,
    RowStoreError,
    TierStats,
    open_store,
    register_tier,
)

__all__ = [
    "TIERS",
    "FileHeader",
    "HeaderMismatchError",
    "OpenMode",
    "RowStore",
    "RowStoreError",
    "TierStats",
    "open_store",
    "register_tier",
]
