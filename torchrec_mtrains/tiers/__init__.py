"""Storage tiers: one module per backend, all registered by name in :data:`TIERS`.

Importing this package registers the built-in stores: ``dram``, ``byte_scm``, ``block_scm``
and ``log_block_scm``. A store serves one placement tier (:class:`torchrec_mtrains.types.Tier`)
in one file layout: ``log_block_scm`` is the block tier's log-structured layout, its default
(:data:`DEFAULT_LAYOUTS`); the flat ``block_scm`` store is chosen by the block tier's options
(``BlockScmOptions``, or ``{"layout": "flat"}``). Stores are never placed by name.
The option types of every tier, and their checks, live in :mod:`torchrec_mtrains.tiers.options`.
A new tier is an options dataclass there (a :class:`TierOptions`) and one new module defining a
:class:`RowStore` subclass naming it as ``options_type``, decorated with :func:`register_tier`.
"""

from torchrec_mtrains.tiers import (  # noqa: F401  (registers the stores)
    block_scm,
    byte_scm,
    dram,
    log_block_scm,
)
from torchrec_mtrains.tiers.base import (
    FileHeader,
    HeaderMismatchError,
    OpenMode,
    RowStore,
    RowStoreError,
    TierStats,
)
from torchrec_mtrains.tiers.multi_read import read_rows_together
from torchrec_mtrains.tiers.options import (
    BlockIOOptions,
    BlockScmOptions,
    ByteScmOptions,
    DramOptions,
    IOEngineKind,
    LogBlockScmOptions,
    TierOptions,
)
from torchrec_mtrains.tiers.registry import (
    DEFAULT_LAYOUTS,
    TIERS,
    default_layout,
    layouts_of,
    open_store,
    placement_options,
    register_tier,
    resolve_options,
    tier_class,
)

__all__ = [
    "DEFAULT_LAYOUTS",
    "TIERS",
    "BlockIOOptions",
    "BlockScmOptions",
    "ByteScmOptions",
    "DramOptions",
    "FileHeader",
    "HeaderMismatchError",
    "IOEngineKind",
    "LogBlockScmOptions",
    "OpenMode",
    "RowStore",
    "RowStoreError",
    "TierOptions",
    "TierStats",
    "default_layout",
    "layouts_of",
    "open_store",
    "placement_options",
    "read_rows_together",
    "register_tier",
    "resolve_options",
    "tier_class",
]
