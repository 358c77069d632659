"""Node topology: one host's memory hierarchy as a Hydra structured config.

A host has DRAM, optionally GPUs with HBM, and optionally the two storage-class tiers (byte
addressable: PMem / CXL memory / a mapped file; block addressable: an Optane or NAND NVMe SSD).
Each tier is described by what the perf model needs: capacity, read/write bandwidth and latency,
the size of the device's internal access unit, and for block devices IOPS, block size and queue
depth. The presets ship with the package (``torchrec_mtrains/conf/hardware/*.yaml``) and cite
where every figure comes from; a Hydra app reaches them through ``pkg://torchrec_mtrains.conf``.

Why plain (not frozen) dataclasses: OmegaConf makes nodes of frozen dataclasses read-only, so
YAML values could not be merged onto the schema. Instances are validated in ``__post_init__``
(OmegaConf's ``to_object`` runs it) and the planner never mutates them.

Sizes are strings with an SI or IEC unit (``"512GB"`` = 512e9 bytes as on datasheets,
``"24GiB"`` = 24 * 2**30); bandwidths are decimal GB/s; latencies are ns.

Example::

    topo = load_topology("gpu_pmem_nvme")
    topo.rank_capacity(Tier.BYTE_SCM, local_world_size=8)   # bytes of PMem per GPU rank
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from torchrec_mtrains.planner.sizes import parse_size
from torchrec_mtrains.tiers import (
    BlockIOOptions,
    LogBlockScmOptions,
    default_layout,
    layouts_of,
)
from torchrec_mtrains.types import Tier

logger = logging.getLogger(__name__)

__all__ = [
    "BlockTierConfig",
    "CacheManagerConfig",
    "ComputeConfig",
    "GpuConfig",
    "HostTopology",
    "MemoryTierConfig",
    "NetworkConfig",
]


def _positive(obj: object, names: Sequence[str], *, allow_zero: bool = False) -> None:
    for name in names:
        value = getattr(obj, name)
        ok = value >= 0 if allow_zero else value > 0
        if not ok or not math.isfinite(value):
            bound = ">= 0" if allow_zero else "> 0"
            raise ValueError(f"{type(obj).__name__}.{name} must be finite and {bound}, got {value}")


@dataclass
class MemoryTierConfig:
    """A byte-addressable tier (DRAM, PMem, CXL memory, a page-cache-backed mapped file).

    Args:
        capacity: total bytes of the tier on one host.
        read_bandwidth_gbs / write_bandwidth_gbs: sustained random-access bandwidth, GB/s.
        read_latency_ns / write_latency_ns: latency of one access that misses the CPU caches.
        access_bytes: the device's internal access unit (64 B cache line; 256 B for Optane
            PMem): a row touching ``k`` units moves ``k * access_bytes`` bytes.
        concurrency: accesses one rank keeps in flight; latency is divided by it.
        call_overhead_us: fixed software cost of one batched read or write call (measured on
            this implementation; 0 for datasheet-only presets).
        source: where the figures come from.
    """

    capacity: str = "0B"
    read_bandwidth_gbs: float = 1.0
    write_bandwidth_gbs: float = 1.0
    read_latency_ns: float = 100.0
    write_latency_ns: float = 100.0
    access_bytes: int = 64
    concurrency: float = 1.0
    call_overhead_us: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        parse_size(self.capacity, f"{type(self).__name__}.capacity")
        _positive(self, ("read_bandwidth_gbs", "write_bandwidth_gbs", "concurrency"))
        _positive(
            self, ("read_latency_ns", "write_latency_ns", "call_overhead_us"), allow_zero=True
        )
        if self.access_bytes <= 0:
            raise ValueError(f"access_bytes must be positive, got {self.access_bytes}")

    @property
    def capacity_bytes(self) -> int:
        return parse_size(self.capacity, "capacity")


@dataclass
class BlockTierConfig(MemoryTierConfig):
    """A block-addressable tier (NVMe / Optane SSD) read and written in aligned blocks.

    Args:
        read_iops / write_iops: random ``block_size`` I/Os per second at ``queue_depth``.
        block_size: the I/O unit in bytes (also ``access_bytes``: a row straddling two blocks
            costs two I/Os). The block stores use it too (see :func:`store_options`).
        queue_depth: I/Os the tier keeps in flight per rank (the IOPS figures assume it); the
            block stores run at this depth (see :func:`store_options`).
        max_pass_bytes: buffer memory of one I/O pass of a block store (larger batches are
            moved in passes); a store holds at most two passes' buffers, which the planner
            counts as host memory of every block-tier table shard.
        layout: how rows lie in the files: ``log`` (the default: written back by appending
            whole blocks, compacted as it goes; the ``log_block_scm`` store) or ``flat`` (row
            ``i`` at ``i * row_bytes``, written back in place: a read-modify-write of each
            block a row partly covers; no index in memory, for hosts that cannot spare 4 bytes
            a row).
        max_space_amplification: ``log`` only: the files take at most this many times the
            rows' bytes (>= 1.1); compaction copies more the lower it is.
        cpu_ns_per_row: CPU the tier's I/O worker spends per row it reads or writes (issuing
            the I/O, gathering and scattering rows, the log's index), overlapping the device's
            work; it is what makes many misses costly even where the device keeps up. 0 for
            datasheet-only presets.
        (other fields as for :class:`MemoryTierConfig`; latencies are per I/O at queue depth 1.)
    """

    read_iops: float = 1.0
    write_iops: float = 1.0
    # The block stores' options of the same names: one default, one check (tiers.options).
    block_size: int = BlockIOOptions.block_size
    queue_depth: int = BlockIOOptions.queue_depth
    max_pass_bytes: int = BlockIOOptions.max_pass_bytes
    layout: str = default_layout(Tier.BLOCK_SCM.value)
    max_space_amplification: float = LogBlockScmOptions.max_space_amplification
    cpu_ns_per_row: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        _positive(self, ("read_iops", "write_iops"))
        _positive(self, ("cpu_ns_per_row",), allow_zero=True)
        layouts = sorted(layouts_of(Tier.BLOCK_SCM.value))
        if self.layout not in layouts:
            raise ValueError(f"layout must be one of {', '.join(layouts)}, got {self.layout!r}")
        shared = LogBlockScmOptions.hardware_fields  # the flat store's are a subset
        try:
            LogBlockScmOptions.from_mapping({f: getattr(self, f) for f in shared})
        except ValueError as e:
            raise ValueError(f"block_scm: {e}") from None
        self.access_bytes = self.block_size


@dataclass
class GpuConfig:
    """The GPUs of a host; each is one rank.

    Args:
        count: GPUs per host.
        name: product name (for the printout).
        hbm_capacity: HBM per GPU.
        hbm_bandwidth_gbs: HBM bandwidth per GPU, GB/s.
        hbm_latency_ns: HBM access latency.
        host_link_gbs: GPU <-> host memory bandwidth per GPU (PCIe), GB/s: rows in DRAM or on
            a storage tier reach the GPU at most this fast.
    """

    count: int = 8
    name: str = ""
    hbm_capacity: str = "80GB"
    hbm_bandwidth_gbs: float = 2000.0
    hbm_latency_ns: float = 500.0
    host_link_gbs: float = 25.0

    def __post_init__(self) -> None:
        if self.count < 1:
            raise ValueError(f"GpuConfig.count must be >= 1, got {self.count}")
        parse_size(self.hbm_capacity, "gpu.hbm_capacity")
        _positive(self, ("hbm_bandwidth_gbs", "hbm_latency_ns", "host_link_gbs"))

    @property
    def hbm_bytes(self) -> int:
        return parse_size(self.hbm_capacity, "gpu.hbm_capacity")


@dataclass
class ComputeConfig:
    """Cost of TorchRec's fused embedding kernel (forward + backward + fused optimizer) on the
    device that computes the embeddings (the GPU, or the CPU cores of one rank).

    Step time of one table shard: ``table_overhead_us + lookups * lookup_ns + bytes /
    bandwidth_gbs``, bytes being the rows' values read in forward, the gradients in backward and
    the updated rows with their optimizer state (see ``perf_model``).

    Args:
        step_overhead_us: fixed cost per training step of one rank's sharded embedding module
            (input and output distribution, Python).
        table_overhead_us: fixed cost per table shard per step.
        lookup_ns: cost per looked-up id independent of the row size.
        bandwidth_gbs: effective bandwidth at which the kernel moves embedding values, GB/s.
        source: where the figures come from.
    """

    step_overhead_us: float = 100.0
    table_overhead_us: float = 10.0
    lookup_ns: float = 1.0
    bandwidth_gbs: float = 10.0
    source: str = ""

    def __post_init__(self) -> None:
        _positive(self, ("step_overhead_us", "table_overhead_us", "lookup_ns"), allow_zero=True)
        _positive(self, ("bandwidth_gbs",))


@dataclass
class CacheManagerConfig:
    """Cost of the row cache in front of a storage tier, per table shard and step: mapping ids
    to slots, choosing victims, and copying loaded / evicted rows in and out of the slots.

    Args:
        table_overhead_us: fixed cost per cached table shard per step.
        lookup_ns: per looked-up id (splitting the batch per table, de-duplicating).
        unique_ns: per distinct id (slot map lookup, policy update).
        miss_ns: per missed row (victim choice, slot bookkeeping, gather/scatter of the row).
        slot_ns: per cache slot, in steps that evict: choosing victims scans the policy's
            state of every slot, so a bigger cache costs time as well as memory.
        source: where the figures come from.
    """

    table_overhead_us: float = 100.0
    lookup_ns: float = 10.0
    unique_ns: float = 50.0
    miss_ns: float = 500.0
    slot_ns: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        _positive(
            self,
            ("table_overhead_us", "lookup_ns", "unique_ns", "miss_ns", "slot_ns"),
            allow_zero=True,
        )


@dataclass
class NetworkConfig:
    """Links between ranks.

    Args:
        intra_host_gbs: per-rank bandwidth to the other ranks of its host (NVLink; shared
            memory for CPU ranks), GB/s.
        inter_host_gbs: per-host network bandwidth (sum of its NICs), GB/s; ranks share it.
    """

    intra_host_gbs: float = 50.0
    inter_host_gbs: float = 12.5

    def __post_init__(self) -> None:
        _positive(self, ("intra_host_gbs", "inter_host_gbs"))


@dataclass
class HostTopology:
    """One host's memory hierarchy, compute and links, plus where this run puts the tier files.

    Args:
        name: preset name.
        description: one line for the printout.
        ranks_per_host: training processes per host (one per GPU on GPU hosts).
        cpu_cores: the host's CPU cores, what a launcher asks a scheduler for per host (the
            torchx component ``mtrains.dlrm`` sizes its job from them and ``dram.capacity``).
        dram: host memory.
        dram_reserved: host memory kept for everything but embedding tables (dense model,
            batches, framework), per host.
        byte_scm: the byte-addressable storage tier, if the host has one.
        block_scm: the block-addressable storage tier, if the host has one.
        gpu: the GPUs, if any; without, embeddings are computed on the CPU from DRAM.
        compute: cost of the fused embedding kernel on the compute device.
        cache_manager: cost of the cache in front of a storage tier.
        network: links between ranks.
        tier_root: where the tiered kernel keeps its files on this host; ``None`` leaves it to
            the job (the DLRM app: ``<run.dir>/tiers``, so every run has its own).
        dirs: per-tier directories that win over ``tier_root`` (a PMem or NVMe mount); the
            storage tiers are listed with ``None`` so that ``hardware.dirs={block_scm:...}``
            overrides a key that exists.
        block_size: the block tier's I/O unit in bytes; the presets copy it into
            ``block_scm.block_size``, which wins where the two differ (see :func:`store_options`).
    """

    name: str = "unnamed"
    description: str = ""
    ranks_per_host: int = 1
    cpu_cores: int = 1
    dram: MemoryTierConfig = field(default_factory=MemoryTierConfig)
    dram_reserved: str = "0B"
    byte_scm: MemoryTierConfig | None = None
    block_scm: BlockTierConfig | None = None
    gpu: GpuConfig | None = None
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    cache_manager: CacheManagerConfig = field(default_factory=CacheManagerConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    tier_root: str | None = None
    dirs: dict[str, str | None] = field(
        default_factory=lambda: {Tier.BYTE_SCM.value: None, Tier.BLOCK_SCM.value: None}
    )
    block_size: int = 4096

    def __post_init__(self) -> None:
        if self.ranks_per_host < 1:
            raise ValueError(f"ranks_per_host must be >= 1, got {self.ranks_per_host}")
        if self.cpu_cores < 1:
            raise ValueError(f"cpu_cores must be >= 1, got {self.cpu_cores}")
        if self.gpu is not None and self.ranks_per_host != self.gpu.count:
            raise ValueError(
                f"host {self.name!r}: ranks_per_host ({self.ranks_per_host}) must equal "
                f"gpu.count ({self.gpu.count}): each GPU is one rank"
            )
        reserved = parse_size(self.dram_reserved, "dram_reserved")
        if reserved >= self.dram.capacity_bytes:
            raise ValueError(
                f"host {self.name!r}: dram_reserved ({self.dram_reserved}) leaves no DRAM of "
                f"{self.dram.capacity} for embeddings"
            )
        for name in self.dirs:
            Tier.parse(name)

    # ------------------------------------------------------------------------ derived views

    @property
    def compute_device(self) -> str:
        """``cuda`` on GPU hosts, ``cpu`` otherwise (TorchRec's compute device names)."""
        return "cuda" if self.gpu is not None else "cpu"

    @property
    def cache_tier(self) -> Tier:
        """Where the caches of tiered tables live: the compute device's memory."""
        return Tier.HBM if self.gpu is not None else Tier.DRAM

    def tiers(self) -> tuple[Tier, ...]:
        """Tiers this host has, fastest first."""
        out = [Tier.HBM] if self.gpu is not None else []
        out.append(Tier.DRAM)
        if self.byte_scm is not None:
            out.append(Tier.BYTE_SCM)
        if self.block_scm is not None:
            out.append(Tier.BLOCK_SCM)
        return tuple(out)

    def memory(self, tier: Tier) -> MemoryTierConfig:
        """The config of a host-memory or storage tier (not HBM)."""
        spec = {Tier.DRAM: self.dram, Tier.BYTE_SCM: self.byte_scm, Tier.BLOCK_SCM: self.block_scm}
        found = spec.get(tier)
        if found is None:
            raise ValueError(f"host {self.name!r} has no {tier.value} tier")
        return found

    def host_capacity(self, tier: Tier) -> int:
        """Bytes of ``tier`` on one host available to embeddings (DRAM less the reservation)."""
        if tier is Tier.HBM:
            return 0 if self.gpu is None else self.gpu.hbm_bytes * self.gpu.count
        if tier not in self.tiers():
            return 0
        cap = self.memory(tier).capacity_bytes
        if tier is Tier.DRAM:
            cap -= parse_size(self.dram_reserved, "dram_reserved")
        return cap

    def rank_capacity(self, tier: Tier, local_world_size: int) -> int:
        """Bytes of ``tier`` one rank may use: HBM per GPU; host tiers split evenly between the
        ``local_world_size`` ranks of a host (each rank's share is honoured separately)."""
        if local_world_size < 1:
            raise ValueError(f"local_world_size must be >= 1, got {local_world_size}")
        if tier is Tier.HBM:
            return 0 if self.gpu is None else self.gpu.hbm_bytes
        return self.host_capacity(tier) // local_world_size

    def without(self, *tiers: Tier) -> HostTopology:
        """A copy of this host without the given storage tiers (for what-if comparisons)."""
        out = copy.deepcopy(self)
        for tier in tiers:
            if tier is Tier.BYTE_SCM:
                out.byte_scm = None
            elif tier is Tier.BLOCK_SCM:
                out.block_scm = None
            else:
                raise ValueError(f"only storage tiers can be removed, not {tier.value}")
        return out
