"""How a table's tier and cache travel from a sharding plan to the tiered kernel.

TorchRec 1.8 has one hook for a third-party kernel, ``EmbeddingComputeKernel.CUSTOMIZED_KERNEL``,
so the tier, cache size and policy of each table ride beside it: a
:class:`TieredParameterSharding` (a ``ParameterSharding`` subclass) holds them in the plan, and
the tiered sharded modules hand each kernel the options of its tables by name. They are not
fused parameters: TorchRec groups tables into kernels by fused parameters, and a tiered table
belongs in the group TorchRec would put it in on FUSED, whatever its tier, cache size and policy
(one fbgemm module per group, with the group's FUSED tables; see
:mod:`~torchrec_mtrains.distributed.grouping`).

Where the tiers' files go, and how their stores are opened (block size, queue depth, ...), is a
property of the host, not of a table: :class:`TierStorage`, given to the sharders. Its per-tier
options are the tiers' typed :class:`~torchrec_mtrains.tiers.TierOptions`, built from the
planner's host topology by :func:`torchrec_mtrains.planner.presets.store_options` so that the
stores run with what the perf model assumed.

What a batch holding an id outside its table does is one rule for every table a sharder builds,
:class:`BoundsCheck`; its fbgemm counterpart travels to TorchRec's kernels as the fused
parameter ``bounds_check_mode``.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.types import ParameterSharding

from torchrec_mtrains.cache.policies import DEFAULT_POLICY, registered_policy
from torchrec_mtrains.tiers import (
    OpenMode,
    RowStore,
    RowStoreError,
    TierOptions,
    placement_options,
    tier_class,
)
from torchrec_mtrains.tiers.base import FILE_SUFFIX, check_directory
from torchrec_mtrains.types import Tier, parse_choice

TIERED_KERNEL: str = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value
"""The compute-kernel name tiered tables carry in a sharding plan."""

BOUNDS_CHECK_MODE_KEY = "bounds_check_mode"
"""The fused parameter (and ``ParameterSharding`` field) fbgemm's kernels take their mode from."""

STORAGE_TIERS: tuple[Tier, ...] = (Tier.DRAM, Tier.BYTE_SCM, Tier.BLOCK_SCM)
"""Tiers a tiered table's rows can live on (HBM/DRAM hold its cache)."""


class BoundsCheck(str, enum.Enum):
    """What a batch holding a row id outside its table does, for every table of a sharded
    module (TorchRec's kernels and tiered ones alike). The ids are checked as the batch enters
    the module, before the input distribution, where they are still global.

    * ``ERROR``: the batch is refused before any lookup with :class:`~torchrec_mtrains.
      distributed.id_bounds.OutOfRangeIdError`, naming the table, the feature, the id and the
      valid range; nothing is read, trained or written. fbgemm runs in its ``FATAL`` mode
      behind it.
    * ``WARN``: TorchRec's default (fbgemm's ``WARNING`` mode): a warning is logged and each
      out-of-range id is replaced by row 0 of its table, which the batch then trains.
    """

    ERROR = "error"
    WARN = "warn"

    @classmethod
    def parse(cls, value: str | BoundsCheck) -> BoundsCheck:
        """The mode named ``value``; raises ``ValueError`` naming the allowed ones."""
        return parse_choice(cls, value, "bounds check")

    @property
    def fbgemm_mode(self) -> BoundsCheckMode:
        """fbgemm's mode for TorchRec's kernels (a backstop: the module's own check runs first
        and hands them only ids in range)."""
        return BoundsCheckMode.FATAL if self is BoundsCheck.ERROR else BoundsCheckMode.WARNING


@dataclass(frozen=True)
class TieredTableOptions:
    """Placement of one tiered table.

    Args:
        tier: where the rows live: ``byte_scm``, ``block_scm`` (or ``dram``, for tests and for
            tables that need write-back caching in front of host memory).
        cache_load_factor: cache size as a fraction of the table shard's rows (at least one
            row); the cache sits in the compute device's memory.
        cache_policy: eviction policy name, one registered in ``POLICIES`` (``lru``, ``lfu``).
        max_live_rows: for a virtual table (``use_virtual_table=True``), the most ids it
            holds at once, over all its shards: its store's rows (a row-wise shard gets its
            share of the id space's). ``cache_load_factor`` is a fraction of these.
        virtual: for a virtual table, how its rows are made and evicted, which the sharded
            module sets from the table's config (see
            :class:`~torchrec_mtrains.distributed.virtual_tables.VirtualSpec`).
    """

    tier: Tier = Tier.BYTE_SCM
    cache_load_factor: float = 0.2
    cache_policy: str = DEFAULT_POLICY
    max_live_rows: int | None = None
    virtual: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", Tier.parse(self.tier))
        if self.tier not in STORAGE_TIERS:
            allowed = ", ".join(t.value for t in STORAGE_TIERS)
            raise ValueError(f"tier {self.tier.value!r} cannot hold a tiered table; use {allowed}")
        if not 0.0 < self.cache_load_factor <= 1.0:
            raise ValueError(f"cache_load_factor must be in (0, 1], got {self.cache_load_factor}")
        registered_policy(self.cache_policy)
        if self.max_live_rows is not None and self.max_live_rows < 1:
            raise ValueError(f"max_live_rows must be at least 1, got {self.max_live_rows}")

    def cache_rows(self, local_rows: int) -> int:
        return max(1, min(local_rows, math.ceil(self.cache_load_factor * local_rows)))


@dataclass
class TieredParameterSharding(ParameterSharding):
    """A ``ParameterSharding`` for a table on a storage tier; ``compute_kernel`` must be
    :data:`TIERED_KERNEL`.

    Example::

        plan = construct_module_sharding_plan(ebc, {"t_big": table_wise(rank=0,
                                              compute_kernel=TIERED_KERNEL)})
        plan["t_big"] = TieredParameterSharding.wrap(plan["t_big"], TieredTableOptions(
            tier="block_scm", cache_load_factor=0.05))
    """

    tier_options: TieredTableOptions = field(default_factory=TieredTableOptions)

    def __post_init__(self) -> None:
        if self.compute_kernel != TIERED_KERNEL:
            raise ValueError(
                f"TieredParameterSharding needs compute_kernel={TIERED_KERNEL!r}, "
                f"got {self.compute_kernel!r}"
            )

    @classmethod
    def wrap(
        cls, sharding: ParameterSharding, options: TieredTableOptions
    ) -> TieredParameterSharding:
        """Returns ``sharding`` (any ParameterSharding) as a tiered one with ``options``."""
        return cls(
            sharding_type=sharding.sharding_type,
            compute_kernel=TIERED_KERNEL,
            ranks=sharding.ranks,
            sharding_spec=sharding.sharding_spec,
            cache_params=sharding.cache_params,
            enforce_hbm=sharding.enforce_hbm,
            stochastic_rounding=sharding.stochastic_rounding,
            bounds_check_mode=sharding.bounds_check_mode,
            output_dtype=sharding.output_dtype,
            key_value_params=sharding.key_value_params,
            tier_options=options,
        )


@dataclass(frozen=True)
class TierStorage:
    """Where each tier keeps its files on this host, and how they are opened.

    Args:
        root: directory under which each tier gets a subdirectory named after it, unless
            ``dirs`` names one.
        dirs: per-tier directory overrides, e.g. ``{"byte_scm": "/mnt/pmem0/run"}``.
        tier_options: per-tier store options, tier name -> that tier's
            :class:`~torchrec_mtrains.tiers.TierOptions` (e.g. ``LogBlockScmOptions``), usually
            :func:`~torchrec_mtrains.planner.presets.store_options` of the host topology. A
            mapping of option values is accepted too (``{"block_scm": {"queue_depth": 8}}``):
            it is checked key by key and replaced by the typed options, so an unknown tier,
            option or value fails here, naming it. Tiers left out, and mappings naming no
            ``layout``, get the tier's default layout (the block tier's is the log:
            ``{"block_scm": {"layout": "flat"}}`` picks the flat file).
        open_mode: what to do with a table file that already exists: ``create`` (the default)
            refuses to overwrite it, ``open`` resumes from it, ``truncate`` replaces it.
        checkpoint_chunk_rows: rows per chunk when checkpoints read or write a tiered table,
            bounding the memory a save or load needs.
        initialize_created: a table file created now gets the table's initial values
            (``init_fn``). ``False`` leaves its rows zero, for a resume whose checkpoint writes
            every row next (filling a large table only to replace it doubles the writes).
    """

    root: str = "runs/tiers"
    dirs: Mapping[str, str] = field(default_factory=dict)
    tier_options: Mapping[str, TierOptions | Mapping[str, Any]] = field(default_factory=dict)
    open_mode: OpenMode = OpenMode.CREATE
    checkpoint_chunk_rows: int = 65_536
    initialize_created: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "open_mode", OpenMode(self.open_mode))
        for name in self.dirs:
            Tier.parse(name)
        typed: dict[str, TierOptions] = {}
        for name, value in self.tier_options.items():
            tier = Tier.parse(name).value
            typed[tier] = placement_options(tier, value)
        object.__setattr__(self, "tier_options", typed)
        if self.checkpoint_chunk_rows <= 0:
            raise ValueError(
                f"checkpoint_chunk_rows must be positive, got {self.checkpoint_chunk_rows}"
            )

    def directory(self, tier: Tier, rank: int) -> Path:
        """The directory holding ``tier``'s files for ``rank``: ``<dir>/rank<rank>``.

        ``root`` is created when missing (it is this run's own directory); a directory named in
        ``dirs`` must already exist (it is a mount point). Raises ``RowStoreError`` naming the
        path when a directory is missing, cannot be created or is not writable."""
        if tier.value in self.dirs:
            base = Path(self.dirs[tier.value])
            check_directory(base)
        else:
            base = Path(self.root) / tier.value
        path = base / f"rank{rank}"
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as e:
            raise RowStoreError(f"cannot create tier directory {path}: {e.strerror}") from e
        check_directory(path)
        return path

    def options_for(self, tier: Tier) -> TierOptions:
        """The options ``tier``'s stores are opened with: those given, else the defaults of the
        tier's default layout. Their ``tier`` names the store that keeps the rows (for
        ``block_scm``: ``log_block_scm``, or ``block_scm`` in the flat layout). Given options
        were resolved once, when this storage was made; they are not resolved again per store."""
        given = self.tier_options.get(tier.value)
        if isinstance(given, TierOptions):
            return given
        return placement_options(tier.value)

    def store_for(self, tier: Tier) -> type[RowStore]:
        """The store class that keeps ``tier``'s rows on this host (its file layout)."""
        return tier_class(self.options_for(tier).tier)


def shard_file_stem(table: str, row_offset: int, col_offset: int) -> str:
    """The name a table shard (first global row and column) gives its store: the store
    makes its file ``<stem>.<store name>.rows`` (:func:`tier_file_name`)."""
    return f"{table}.r{row_offset}.c{col_offset}"


def tier_file_name(table: str, row_offset: int, col_offset: int, store: str) -> str:
    """The file holding the rows of one table shard (first global row and column) in
    ``store`` (a registered store name, e.g. ``log_block_scm``)."""
    return f"{shard_file_stem(table, row_offset, col_offset)}.{store}{FILE_SUFFIX}"


def tier_options_by_table(plan: Mapping[str, ParameterSharding]) -> dict[str, TieredTableOptions]:
    """The tier options of every tiered table of a module's sharding plan, by table name."""
    return {
        name: sharding.tier_options
        for name, sharding in plan.items()
        if isinstance(sharding, TieredParameterSharding)
    }
