"""Enumerates where each table may go, behind TorchRec's ``Enumerator``.

For every shardable table of every module a sharder handles (walked as TorchRec's
``EmbeddingEnumerator`` does), one option per (sharding type, placement) the sharder and the
host allow:

* kernels: TorchRec's ``FUSED`` (rows in HBM on GPU hosts, in DRAM on CPU hosts),
  ``FUSED_UVM`` (DRAM rows read by the GPU) and ``FUSED_UVM_CACHING`` (DRAM rows behind an HBM
  cache), and the tiered kernel once per storage tier the host has. Kernels the perf model does
  not know (key-value, virtual tables, quantized) are not offered.
* sharding: table-wise; with more than one rank also the splits the sharder offers: row-wise,
  and column-wise into the fewest equal slices (of a multiple of 4
  columns, as TorchRec's CPU kernels need) that fit one rank: every column slice serves every
  lookup, so more slices only multiply the per-lookup work.

Shard geometry comes from TorchRec's ``calculate_shard_sizes_and_offsets``.

A virtual table (``use_virtual_table=True``) is offered on the tiered kernel only, table-wise
or row-wise by whole buckets as TorchRec's input distribution routes them, and sized from its
``PlannerConfig.max_live_rows`` bound (a table without one is a planning error naming it).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch import nn
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.enumerators import get_partition_by_type
from torchrec.distributed.planner.types import Enumerator, Shard, ShardingOption
from torchrec.distributed.planner.utils import sharder_name
from torchrec.distributed.sharding_plan import calculate_shard_sizes_and_offsets
from torchrec.distributed.types import ModuleSharder, ShardingType

from torchrec_mtrains.distributed.options import TIERED_KERNEL
from torchrec_mtrains.distributed.virtual_tables import bucket_rows, is_virtual
from torchrec_mtrains.planner.access import TableAccess, from_profile, uniform_access
from torchrec_mtrains.planner.perf_model import Placement
from torchrec_mtrains.planner.shard_estimators import TieredShardEstimator, optimizer_state_width
from torchrec_mtrains.planner.types import PlanningContext, TieredShardingOption
from torchrec_mtrains.profiler.types import AccessProfile, ProfileSource

logger = logging.getLogger(__name__)

__all__ = ["TieredEnumerator", "kernel_for"]

_TW = ShardingType.TABLE_WISE.value
_RW = ShardingType.ROW_WISE.value
_CW = ShardingType.COLUMN_WISE.value
_FUSED = EmbeddingComputeKernel.FUSED.value
_UVM = EmbeddingComputeKernel.FUSED_UVM.value
_UVM_CACHING = EmbeddingComputeKernel.FUSED_UVM_CACHING.value


def offered_sharding_types(sharder: ModuleSharder[nn.Module], device: str) -> list[str]:
    """What ``sharder`` offers this planner: a tiered sharder's planner-only offer (row-wise on
    CPU too), else TorchRec's ``sharding_types``."""
    offer = getattr(sharder, "planner_sharding_types", None)
    return list(offer(device) if callable(offer) else sharder.sharding_types(device))


def offered_kernels(
    sharder: ModuleSharder[nn.Module], sharding_type: str, device: str
) -> list[str]:
    """What ``sharder`` offers this planner: a tiered sharder's planner-only offer (with the
    tiered kernel), else TorchRec's ``compute_kernels``."""
    offer = getattr(sharder, "planner_compute_kernels", None)
    if callable(offer):
        return list(offer(sharding_type, device))
    return list(sharder.compute_kernels(sharding_type, device))


def kernel_for(placement: Placement, on_gpu: bool) -> str:
    """The compute kernel name a placement uses in a TorchRec plan."""
    if placement is Placement.FUSED_HBM:
        return _FUSED
    if placement is Placement.FUSED_DRAM:
        return _UVM if on_gpu else _FUSED
    if placement is Placement.CACHED_DRAM:
        return _UVM_CACHING
    return TIERED_KERNEL


def _placements(kernel: str, context: PlanningContext) -> list[Placement]:
    host = context.host
    on_gpu = host.gpu is not None
    if kernel == _FUSED:
        return [Placement.FUSED_HBM if on_gpu else Placement.FUSED_DRAM]
    if kernel == _UVM and on_gpu:
        return [Placement.FUSED_DRAM]
    if kernel == _UVM_CACHING and on_gpu:
        return [Placement.CACHED_DRAM]
    if kernel == TIERED_KERNEL:
        out = []
        if host.byte_scm is not None:
            out.append(Placement.CACHED_BYTE_SCM)
        if host.block_scm is not None:
            out.append(Placement.CACHED_BLOCK_SCM)
        return out
    return []


class TieredEnumerator(Enumerator):
    """Lists the sharding options of every table (see the module docstring).

    Args:
        context: the planning context; its ``access`` is filled here, per table, from
            ``profile``, ``access`` overrides or the uniform fallback (logged and labelled).
        estimator: fills the options' demand and perf.
        profile: measured access profile, or ``None``.
        access: per-table access statistics that take precedence (e.g. stated Zipf skews).
        poolings: ids per sample of tables without a profile (default: the config's).
    """

    def __init__(
        self,
        context: PlanningContext,
        estimator: TieredShardEstimator,
        profile: AccessProfile | None = None,
        access: dict[str, TableAccess] | None = None,
        poolings: dict[str, float] | None = None,
    ) -> None:
        self.context = context
        self.estimator = estimator
        self.profile = profile
        self.overrides = dict(access or {})
        self.poolings = dict(poolings or {})
        self.assumed_uniform: list[str] = []
        # virtual tables bounded by their profile's distinct ids (no planner.max_live_rows)
        self.bounds_from_profile: dict[str, int] = {}

    # ---------------------------------------------------------------------------- helpers

    def _access(self, name: str, rows: int, dim: int, id_space: int | None = None) -> TableAccess:
        """The table's access statistics over its ``rows``. A virtual table's (``rows``: its
        bound on live rows) may describe its ``id_space`` (a profile of its raw ids): their
        distinct ids and cache hit rates are taken as they are, over its live rows."""
        if name in self.overrides:
            found = self.overrides[name]
        elif self.profile is not None and name in self.profile:
            found = from_profile(self.profile[name])
        else:
            pooling = self.poolings.get(name, self.context.config.default_pooling)
            found = uniform_access(name, rows, dim, pooling, self.context.samples_per_step)
            self.assumed_uniform.append(name)
        if id_space is not None and found.num_rows == id_space:
            found = dataclasses.replace(found, num_rows=rows)
        if found.num_rows != rows:
            raise ValueError(
                f"table {name!r} has {rows} rows but its access statistics describe "
                f"{found.num_rows}: profile the model being planned"
            )
        return found

    def _split_types(self, sharder: ModuleSharder[nn.Module], rows: int, cols: int) -> list[str]:
        """Row-wise (lookups split between ranks, but every rank sends partial sums for the
        whole batch) and column-wise (fewer, narrower outputs, but every slice serves every
        lookup), whichever the sharder offers: which is faster depends on the table."""
        ctx = self.context
        if ctx.world_size == 1 or not ctx.config.split_tables:
            return []
        offered = offered_sharding_types(sharder, ctx.host.compute_device)
        out = []
        if _RW in offered and rows >= ctx.world_size:
            out.append(_RW)
        if _CW in offered and self._cw_shards(rows, cols) > 1:
            out.append(_CW)
        return out

    def _cw_shards(self, rows: int, cols: int) -> int:
        """Column slices for a column-wise split: every slice serves every lookup, so as few
        as make a slice fit one rank's largest tier (at least 2), a multiple of 4 columns each
        (TorchRec's CPU kernels need it); 1 when the columns cannot be split."""
        valid = [
            n
            for n in range(2, self.context.world_size + 1)
            if cols % n == 0 and (cols // n) % 4 == 0
        ]
        if not valid:
            return 1
        largest_tier = max(self.context.capacity(t) for t in self.context.tiers())
        for n in valid:
            if rows * (cols // n + 1) * 4 <= largest_tier:
                return n
        return valid[-1]

    def _geometry(
        self, param: torch.Tensor, sharding_type: str
    ) -> tuple[list[list[int]], list[list[int]]]:
        ctx = self.context
        rows, cols = int(param.shape[0]), int(param.shape[1])
        if sharding_type == _CW:
            n = self._cw_shards(rows, cols)
            width = cols // n
            return [[rows, width]] * n, [[0, width * i] for i in range(n)]
        sizes, offsets = calculate_shard_sizes_and_offsets(
            tensor=param,
            world_size=ctx.world_size,
            local_world_size=ctx.local_world_size,
            sharding_type=sharding_type,
        )
        return [list(s) for s in sizes], [list(o) for o in offsets]

    def _virtual_bound(self, config: Any) -> int:
        """A virtual table's bound on live rows: ``planner.max_live_rows``, else the distinct
        ids a measured profile of its id space saw (the rows it would hold without eviction
        over the profiled traffic)."""
        name = config.name
        bound = self.context.config.max_live_rows.get(name)
        if bound is not None:
            return int(bound)
        measured = self.profile[name] if self.profile is not None and name in self.profile else None
        if (
            measured is not None
            and measured.source == ProfileSource.MEASURED
            and measured.num_rows == config.num_embeddings
            and measured.distinct_rows > 0
        ):
            self.bounds_from_profile[name] = int(measured.distinct_rows)
            return int(measured.distinct_rows)
        raise ValueError(
            f"virtual table {name!r}: set planner.max_live_rows.{name}, the most ids it holds "
            "at once (the planner sizes its store from it), or give a profile of its ids"
        )

    def _virtual_types(self, config: Any) -> list[str]:
        """Table-wise, and row-wise when its buckets can be spread over the ranks."""
        buckets = getattr(config, "total_num_buckets", None) or 0
        ctx = self.context
        if ctx.world_size > 1 and ctx.config.split_tables and buckets >= ctx.world_size:
            return [_TW, _RW]
        return [_TW]

    def _virtual_geometry(
        self, config: Any, sharding_type: str, cols: int
    ) -> tuple[list[list[int]], list[list[int]]]:
        if sharding_type == _TW:
            return [[config.num_embeddings, cols]], [[0, 0]]
        sizes = bucket_rows(
            config.num_embeddings, config.total_num_buckets, self.context.world_size
        )
        starts = [sum(sizes[:r]) for r in range(len(sizes))]
        return [[n, cols] for n in sizes], [[s, 0] for s in starts]

    # --------------------------------------------------------------------- TorchRec API

    def enumerate(
        self, module: nn.Module, sharders: list[ModuleSharder[nn.Module]]
    ) -> list[ShardingOption]:
        ctx = self.context
        device = ctx.host.compute_device
        sharder_map = {sharder_name(s.module_type): s for s in sharders}
        options: list[ShardingOption] = []
        self.assumed_uniform = []
        self.bounds_from_profile = {}
        queue: list[tuple[str, nn.Module]] = [("", module)]
        while queue:
            path, child = queue.pop(0)
            sharder = sharder_map.get(sharder_name(type(child)))
            if sharder is None:
                for n, m in child.named_children():
                    queue.append((f"{path}.{n}" if path else n, m))
                continue
            pooled = ShardingOption.module_pooled(child, path)
            fused_params: dict[str, Any] | None = getattr(sharder, "fused_params", None)
            configs = {c.name: c for c in _table_configs(child)}
            for name, param in sharder.shardable_parameters(child).items():
                rows, cols = int(param.shape[0]), int(param.shape[1])
                config = configs.get(name)
                virtual = config is not None and is_virtual(config)
                live = self._virtual_bound(config) if virtual else None
                access = self._access(name, live or rows, cols, rows if virtual else None)
                ctx.access[name] = access
                state = optimizer_state_width(fused_params, cols)
                types = (
                    self._virtual_types(config)
                    if virtual
                    else [_TW, *self._split_types(sharder, rows, cols)]
                )
                per_table: list[ShardingOption] = []
                for sharding_type in types:
                    if sharding_type not in offered_sharding_types(sharder, device):
                        continue
                    sizes, offsets = (
                        self._virtual_geometry(config, sharding_type, cols)
                        if virtual
                        else self._geometry(param, sharding_type)
                    )
                    for kernel in offered_kernels(sharder, sharding_type, device):
                        if virtual and kernel != TIERED_KERNEL:
                            continue  # only the tiered kernel backs virtual tables here
                        for placement in _placements(kernel, ctx):
                            per_table.append(
                                TieredShardingOption(
                                    placement=placement,
                                    access=access,
                                    table_rows=rows,
                                    table_cols=cols,
                                    state_width=state,
                                    element_bytes=param.element_size(),
                                    live_rows=live,
                                    name=name,
                                    tensor=param,
                                    module=(path, child),
                                    input_lengths=[access.accesses_per_sample],
                                    batch_size=ctx.batch_size,
                                    sharding_type=sharding_type,
                                    partition_by=get_partition_by_type(sharding_type),
                                    compute_kernel=kernel,
                                    shards=[
                                        Shard(size=s, offset=o) for s, o in zip(sizes, offsets)
                                    ],
                                    is_pooled=pooled,
                                )
                            )
                if not per_table:
                    raise ValueError(
                        f"table {name!r}: sharder {type(sharder).__name__} offers no kernel the "
                        f"tiered planner can place on {device} (offered for table-wise: "
                        f"{offered_kernels(sharder, _TW, device)}); build the sharder with "
                        "offer_tiered_kernel=True"
                    )
                options.extend(per_table)
        bounded = {o.name for o in options if getattr(o, "live_rows", None) is not None}
        stray = sorted(set(ctx.config.max_live_rows) - bounded)
        if stray:
            raise ValueError(
                f"planner.max_live_rows names {', '.join(stray)}: not a virtual table "
                "(use_virtual_table=True) of the model being planned"
            )
        if self.assumed_uniform:
            logger.info(
                "no access profile for %d table(s): assuming uniform access (%s)",
                len(self.assumed_uniform),
                ", ".join(self.assumed_uniform),
            )
        self.populate_estimates(options)
        return options

    def populate_estimates(self, sharding_options: list[ShardingOption]) -> None:
        self.estimator.estimate(sharding_options)


def _table_configs(module: nn.Module) -> list[Any]:
    """The embedding configs of an EBC or EC (others: none)."""
    for attr in ("embedding_bag_configs", "embedding_configs"):
        getter = getattr(module, attr, None)
        if callable(getter):
            return list(getter())
    return []
