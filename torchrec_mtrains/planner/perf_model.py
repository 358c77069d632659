"""Per-step time of an embedding table shard on a memory hierarchy: the planner's perf model.

The model predicts the time one training step (forward + backward + fused optimizer update)
spends on one table shard, from the shard's traffic (:class:`ShardWork`), where its rows live
(:class:`Placement`), its cache size and hit rate, and the host's figures (:mod:`topology`).
All times are seconds. A rank's step time is the sum over its shards plus a fixed per-step cost;
the plan's step time is that of its slowest rank (ranks synchronise every step).

Terms, for a shard that serves ``S`` samples per step with ``L`` looked-up ids of which ``U``
are distinct, rows of ``d`` columns plus ``s`` optimizer-state values of ``e`` bytes
(``row = (d + s) e`` bytes, weights ``w = d e``):

* **compute** (TorchRec's fused kernel on the compute device):
  ``table_overhead + L * lookup_ns + (2 L w + 2 U row + 2 S d 4) / bandwidth``: rows read in
  forward, gradients scattered in backward, each distinct row read and written back with its
  optimizer state by the fused update, pooled outputs written and their gradients read.
  Rows in host DRAM computed from a GPU (``FUSED_UVM``) move at the GPU's host-link bandwidth.
* **cache** (only cached shards: the tiered kernel's row cache, or FUSED_UVM_CACHING):
  ``table_overhead + L lookup_ns + U unique_ns + C slot_ns + M (miss_ns + 2 row / bandwidth)``
  with ``M = U (1 - h(C))`` misses for a cache of ``C`` rows with hit rate ``h`` (from the
  profile's LRU curve). Each miss loads a row and, in steady-state training, evicts one updated
  (dirty) row; ``slot_ns`` is the per-slot cost of choosing victims over the whole cache.
* **cache-hit traffic** is part of *compute*: hits are served from the cache at the compute
  device's bandwidth, which is why the kernel's bandwidth term applies to every lookup.
* **miss traffic** at the backing tier, ``M`` rows read and ``M`` dirty rows written back:

  - byte-addressable tier: each row touches ``k`` access units of the device (64 B cache lines;
    256 B for Optane PMem, whose media reads 256 B), so ``k * unit`` bytes move per row
    (*read amplification*); time ``call_overhead + M latency / concurrency +
    M k unit / bandwidth`` per direction;
  - block tier: a row touches ``k`` blocks, ``k`` being the mean over where rows start within a
    block (rows are packed back to back, so a ``row``-byte row straddles a block boundary with
    probability about ``(row - 1) / block``); rows of the same batch sharing a block share its
    I/O (*rows per block*, counted by :func:`distinct_units`). Reads cost ``latency +
    max(ios / read_iops, bytes / read_bandwidth)``; write-backs first read the blocks they only
    partly cover (read-modify-write), then write every touched block. In the ``log`` layout
    (``BlockTierConfig.layout``) write-backs are sequential appends plus compaction's copies
    (see :func:`block_tier_time`).
  - Rows on DRAM or a storage tier reaching a GPU are also capped by its host link.
  - The ranks of a host share its tiers: each gets ``1 / local_world_size`` of a tier's
    bandwidth and IOPS (latency is not shared).
* **comms** (more than one rank): ids in (8 bytes each) and pooled outputs out, forward and
  backward, the remote share at intra-host (NVLink / shared memory) or the rank's share of the
  host's network bandwidth.

Without a look-ahead pipeline the tier's I/O is on the critical path and terms add up; with
``overlap_tier_io`` a rank's step is ``max(compute + comms, cache + I/O)``: the cDLRM pipeline
prefetches the next batch's rows while the current one computes.

The figures come from the host topology: measured on this machine for the ``local`` preset
(``benchmarks/perf_model_check.py calibrate``), vendor datasheets for the others. The same
script's ``check`` compares predictions with measured DMP steps.

What the model leaves out: dense layers (the same for every placement), stragglers from skewed
row-wise shards, CPU cache effects of the fused kernel (its cost per lookup grows with the
tables' total size), and the page cache in front of a memory-mapped file larger than free
memory (rows then fault in from disk one at a time).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import lru_cache

from torchrec_mtrains.cache.id_map import map_bytes
from torchrec_mtrains.planner.topology import BlockTierConfig, HostTopology, MemoryTierConfig
from torchrec_mtrains.types import Tier, stored_row_bytes

__all__ = [
    "ID_BYTES",
    "ID_MAP_BYTES",
    "OUTPUT_BYTES",
    "SLOT_OVERHEAD_BYTES",
    "Placement",
    "ShardWork",
    "StepTime",
    "block_tier_time",
    "byte_tier_time",
    "cache_bytes",
    "cache_time",
    "comms_time",
    "compute_time",
    "distinct_units",
    "partial_units_per_row",
    "shard_step_time",
    "slot_map_bytes",
    "units_per_row",
]

ID_BYTES = 8
"""Bytes per looked-up id in the input distribution (int64)."""
OUTPUT_BYTES = 4
"""Bytes per pooled output value and its gradient (fp32)."""
ID_MAP_BYTES = 4
"""Host memory per row of a tiered shard for the cache's id -> slot map (int32)."""
SLOT_OVERHEAD_BYTES = 40
"""Cache-tier memory per cache slot besides the row, with the most any built-in policy takes
(LFU's, the default, on the compiled bookkeeping): slot -> id (8), hold count (4), dirty /
pinned / reserved / scratch flags (4), last use (8), access count (8), the policy list's links
(8). LRU has no count: 32."""


def cache_bytes(cache_rows: int, row_bytes: int) -> int:
    """Memory of a tiered shard's cache: its rows and each slot's state."""
    return cache_rows * (row_bytes + SLOT_OVERHEAD_BYTES)


def slot_map_bytes(stored_rows: int, virtual: bool) -> int:
    """Host memory of a tiered shard's maps over its ``stored_rows`` store rows: the cache's
    id -> slot map and, for a virtual table, its id -> row map with its eviction statistics."""
    return stored_rows * ID_MAP_BYTES + (map_bytes(stored_rows) if virtual else 0)


_NS = 1e-9
_US = 1e-6
_GB = 1e9


class Placement(str, enum.Enum):
    """Where a shard's rows live and how they are computed.

    * ``fused_hbm``: TorchRec's FUSED kernel, rows in HBM.
    * ``fused_dram``: rows in host DRAM, no cache: FUSED on a CPU host, FUSED_UVM on a GPU host.
    * ``cached_dram``: rows in DRAM behind an HBM cache (FUSED_UVM_CACHING, GPU hosts).
    * ``cached_byte_scm`` / ``cached_block_scm``: the tiered kernel, rows on a storage tier
      behind a cache in the compute device's memory.
    """

    FUSED_HBM = "fused_hbm"
    FUSED_DRAM = "fused_dram"
    CACHED_DRAM = "cached_dram"
    CACHED_BYTE_SCM = "cached_byte_scm"
    CACHED_BLOCK_SCM = "cached_block_scm"

    @property
    def rows_tier(self) -> Tier:
        return {
            Placement.FUSED_HBM: Tier.HBM,
            Placement.FUSED_DRAM: Tier.DRAM,
            Placement.CACHED_DRAM: Tier.DRAM,
            Placement.CACHED_BYTE_SCM: Tier.BYTE_SCM,
            Placement.CACHED_BLOCK_SCM: Tier.BLOCK_SCM,
        }[self]

    @property
    def cached(self) -> bool:
        return self.value.startswith("cached_")


@dataclass(frozen=True)
class ShardWork:
    """Traffic of one table shard in one training step.

    Args:
        rows: rows in the shard.
        cols: columns (embedding dimension) of the shard.
        state_width: optimizer-state values stored per row (1 for row-wise Adagrad).
        element_bytes: bytes per stored weight (the optimizer state is fp32).
        samples: samples whose lookups the shard serves per step (the global batch).
        lookups: ids looked up in the shard per step.
        unique_rows: distinct ids among them.
        pooled: pooled (EmbeddingBag) or sequence output.
    """

    rows: int
    cols: int
    state_width: int
    element_bytes: int
    samples: float
    lookups: float
    unique_rows: float
    pooled: bool = True

    @property
    def row_bytes(self) -> int:
        """Bytes of a stored row: weights then optimizer state (fp32, as fbgemm keeps it)."""
        return stored_row_bytes(self.cols, self.state_width, self.element_bytes)

    @property
    def weight_bytes(self) -> int:
        return self.cols * self.element_bytes

    @property
    def table_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def output_bytes(self) -> float:
        """Bytes of the shard's output per step (pooled per sample, or per lookup)."""
        per = self.samples if self.pooled else self.lookups
        return per * self.cols * OUTPUT_BYTES


@dataclass(frozen=True)
class StepTime:
    """One shard's (or rank's) step time by component, seconds."""

    compute: float = 0.0
    cache: float = 0.0
    tier_read: float = 0.0
    tier_write: float = 0.0
    comms: float = 0.0

    @property
    def io(self) -> float:
        return self.tier_read + self.tier_write

    @property
    def total(self) -> float:
        return self.compute + self.cache + self.io + self.comms

    def critical(self, overlap_tier_io: bool) -> float:
        """Time on the step's critical path: the sum, or with a look-ahead pipeline the longer
        of compute (+ comms) and the cache's own work (+ I/O)."""
        if overlap_tier_io:
            return max(self.compute + self.comms, self.cache + self.io)
        return self.total

    def __add__(self, other: StepTime) -> StepTime:
        return StepTime(
            self.compute + other.compute,
            self.cache + other.cache,
            self.tier_read + other.tier_read,
            self.tier_write + other.tier_write,
            self.comms + other.comms,
        )


# ---------------------------------------------------------------------------- geometry


@lru_cache(maxsize=4096)
def _unit_stats(row_bytes: int, unit: int) -> tuple[float, float]:
    """(mean units touched, mean units only partly covered) per row, rows packed back to back
    from a unit-aligned offset: row starts cycle through the multiples of gcd(row, unit)."""
    step = math.gcd(row_bytes, unit)
    touched = partial = 0
    count = unit // step
    for start in range(0, unit, step):
        end = start + row_bytes  # exclusive, relative to the first unit's start
        n = (end - 1) // unit + 1
        full = max(0, end // unit - -(-start // unit))
        touched += n
        partial += n - full
    return touched / count, partial / count


def units_per_row(row_bytes: int, unit: int) -> float:
    """Mean number of ``unit``-byte aligned units (cache lines, PMem lines, blocks) one row
    touches: 1 + (row - 1) / unit on average when rows are not unit-aligned."""
    if row_bytes <= 0 or unit <= 0:
        raise ValueError(f"row_bytes and unit must be positive, got {row_bytes}, {unit}")
    return _unit_stats(row_bytes, unit)[0]


def partial_units_per_row(row_bytes: int, unit: int) -> float:
    """Mean number of units a row covers only in part: writing the row must read them first
    (read-modify-write) on a block device."""
    if row_bytes <= 0 or unit <= 0:
        raise ValueError(f"row_bytes and unit must be positive, got {row_bytes}, {unit}")
    return _unit_stats(row_bytes, unit)[1]


def distinct_units(rows: float, per_row: float, total_units: float) -> float:
    """Expected distinct units touched by ``rows`` random rows of ``per_row`` units each, out of
    ``total_units``: rows of one batch sharing a block (or line) share its transfer."""
    if rows <= 0:
        return 0.0
    if total_units <= per_row:
        return min(total_units, rows * per_row)
    touches = rows * per_row
    return total_units * -math.expm1(touches * math.log1p(-1.0 / total_units))


# ------------------------------------------------------------------------------- terms


def compute_time(work: ShardWork, host: HostTopology, bandwidth_gbs: float | None = None) -> float:
    """TorchRec's fused kernel (forward, backward, fused update) over the shard's rows."""
    c = host.compute
    bw = (bandwidth_gbs or c.bandwidth_gbs) * _GB
    moved = (
        2.0 * work.lookups * work.weight_bytes
        + 2.0 * work.unique_rows * work.row_bytes
        + 2.0 * work.output_bytes
    )
    return c.table_overhead_us * _US + work.lookups * c.lookup_ns * _NS + moved / bw


def cache_time(work: ShardWork, cache_rows: float, misses: float, host: HostTopology) -> float:
    """The row cache's bookkeeping: ids to slots, victims, rows copied into / out of slots."""
    cm = host.cache_manager
    copy_bytes = 2.0 * misses * work.row_bytes
    return (
        cm.table_overhead_us * _US
        + work.lookups * cm.lookup_ns * _NS
        + work.unique_rows * cm.unique_ns * _NS
        + (cache_rows * cm.slot_ns * _NS if misses > 0 else 0.0)
        + misses * cm.miss_ns * _NS
        + copy_bytes / (host.compute.bandwidth_gbs * _GB)
    )


def byte_tier_time(
    rows: float,
    row_bytes: int,
    shard_rows: int,
    tier: MemoryTierConfig,
    *,
    write: bool,
    link_gbs: float | None = None,
    share: float = 1.0,
) -> float:
    """Reading (or writing) ``rows`` random rows of a byte-addressable tier, of whose
    bandwidth this rank gets ``share`` (ranks of a host share its tiers)."""
    if rows <= 0:
        return 0.0
    unit = tier.access_bytes
    per_row = units_per_row(row_bytes, unit)
    units = distinct_units(rows, per_row, shard_rows * row_bytes / unit)
    bw = (tier.write_bandwidth_gbs if write else tier.read_bandwidth_gbs) * share
    if link_gbs is not None:
        bw = min(bw, link_gbs)
    latency = tier.write_latency_ns if write else tier.read_latency_ns
    return (
        tier.call_overhead_us * _US
        + rows * latency / tier.concurrency * _NS
        + units * unit / (bw * _GB)
    )


def block_tier_time(
    reads: float,
    writes: float,
    row_bytes: int,
    shard_rows: int,
    tier: BlockTierConfig,
    *,
    link_gbs: float | None = None,
    share: float = 1.0,
) -> tuple[float, float]:
    """(read time, write time) of ``reads`` missed rows and ``writes`` written-back rows on a
    block tier, with read amplification, shared blocks and read-modify-write; this rank gets
    ``share`` of the tier's IOPS and bandwidth.

    In the ``log`` layout a write-back is a sequential append of the rows' bytes, and
    compaction reads and rewrites live rows: with the file at most ``S`` times the rows'
    bytes, cleaning a segment copies at most ``1/(S-1)`` bytes per byte freed. Reads then
    spread over ``S`` times as many blocks. Every row read, written or copied also costs the
    I/O worker ``cpu_ns_per_row`` of CPU, which overlaps the device's work: each direction
    takes the longer of the two."""
    bs = tier.block_size
    log = tier.layout == "log"
    amp = tier.max_space_amplification if log else 1.0
    total_blocks = shard_rows * row_bytes * amp / bs
    read_bw = tier.read_bandwidth_gbs * _GB * share
    write_bw = tier.write_bandwidth_gbs * _GB * share
    read_iops = tier.read_iops * share
    write_iops = tier.write_iops * share
    if link_gbs is not None:
        read_bw = min(read_bw, link_gbs * _GB)
        write_bw = min(write_bw, link_gbs * _GB)
    read_t = write_t = 0.0
    cpu = tier.cpu_ns_per_row * _NS
    if reads > 0:
        ios = distinct_units(reads, units_per_row(row_bytes, bs), total_blocks)
        read_t = (
            tier.call_overhead_us * _US
            + tier.read_latency_ns * _NS
            + max(ios / read_iops, ios * bs / read_bw, reads * cpu)
        )
    if writes > 0 and log:
        copied = writes * row_bytes / (amp - 1.0)  # compaction's reads and rewrites
        write_t = (
            tier.call_overhead_us * _US
            + tier.write_latency_ns * _NS
            + max(
                (writes * row_bytes + copied) / write_bw + copied / read_bw,
                (writes + 2.0 * copied / row_bytes) * cpu,
            )
        )
    elif writes > 0:
        ios = distinct_units(writes, units_per_row(row_bytes, bs), total_blocks)
        rmw = distinct_units(writes, partial_units_per_row(row_bytes, bs), total_blocks)
        write_t = (
            tier.call_overhead_us * _US
            + tier.write_latency_ns * _NS
            + max(ios / write_iops, ios * bs / write_bw, writes * cpu)
        )
        if rmw > 0:
            write_t += tier.read_latency_ns * _NS + max(rmw / read_iops, rmw * bs / read_bw)
    return read_t, write_t


def comms_time(
    work: ShardWork, host: HostTopology, world_size: int, local_world_size: int
) -> float:
    """Input ids in and outputs out, forward and backward, over the links between ranks."""
    if world_size <= 1:
        return 0.0
    local = min(local_world_size, world_size)
    net = host.network
    moved = work.lookups * ID_BYTES + 2.0 * work.output_bytes
    intra_share = (local - 1) / world_size
    inter_share = (world_size - local) / world_size
    per_rank_inter = net.inter_host_gbs / local * _GB
    return moved * (intra_share / (net.intra_host_gbs * _GB) + inter_share / per_rank_inter)


def shard_step_time(
    placement: Placement,
    work: ShardWork,
    host: HostTopology,
    *,
    cache_rows: float = 0.0,
    hit_rate: float = 0.0,
    world_size: int = 1,
    local_world_size: int = 1,
) -> StepTime:
    """The step time of one shard placed as ``placement`` (see the module docstring).

    Args:
        placement: where the rows live.
        work: the shard's traffic.
        host: the host's figures.
        cache_rows: cache size of a cached placement.
        hit_rate: the cache's hit rate among distinct ids (``h(cache_rows)``).
        world_size / local_world_size: ranks in all / on one host, for the comms term.
    """
    on_gpu = host.gpu is not None
    link = host.gpu.host_link_gbs if host.gpu is not None else None
    share = 1.0 / max(1, min(local_world_size, world_size))  # ranks of a host share its tiers
    comms = comms_time(work, host, world_size, local_world_size)
    if placement is Placement.FUSED_HBM:
        if not on_gpu:
            raise ValueError(f"host {host.name!r} has no HBM")
        return StepTime(compute=compute_time(work, host), comms=comms)
    if placement is Placement.FUSED_DRAM:
        bw = None
        if link is not None:  # FUSED_UVM: the GPU reads host memory over its link
            bw = min(link, host.dram.read_bandwidth_gbs * share)
        return StepTime(compute=compute_time(work, host, bw), comms=comms)
    if not 0.0 <= hit_rate <= 1.0:
        raise ValueError(f"hit_rate must be in [0, 1], got {hit_rate}")
    misses = work.unique_rows * (1.0 - hit_rate)
    tier = host.memory(placement.rows_tier)
    if isinstance(tier, BlockTierConfig):
        read_t, write_t = block_tier_time(
            misses, misses, work.row_bytes, work.rows, tier, link_gbs=link, share=share
        )
    else:
        read_t, write_t = (
            byte_tier_time(
                misses, work.row_bytes, work.rows, tier, write=w, link_gbs=link, share=share
            )
            for w in (False, True)
        )
    return StepTime(
        compute=compute_time(work, host),
        cache=cache_time(work, cache_rows, misses, host),
        tier_read=read_t,
        tier_write=write_t,
        comms=comms,
    )
