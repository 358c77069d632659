"""Small hosts whose capacities make placements interesting, and table configs, for the
planner tests."""

from __future__ import annotations

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_mtrains.planner import (
    BlockTierConfig,
    CacheManagerConfig,
    ComputeConfig,
    HostTopology,
    MemoryTierConfig,
)

MiB = 2**20


def small_host(
    dram: str = "64MiB",
    byte_scm: str | None = "256MiB",
    block_scm: str | None = "1GiB",
    ranks_per_host: int = 2,
) -> HostTopology:
    """A CPU host with tiny tiers, so tables of a few MB already compete for space."""
    return HostTopology(
        name="small",
        ranks_per_host=ranks_per_host,
        dram=MemoryTierConfig(capacity=dram, read_bandwidth_gbs=5.0, write_bandwidth_gbs=5.0),
        dram_reserved="1MiB",
        byte_scm=None
        if byte_scm is None
        else MemoryTierConfig(
            capacity=byte_scm,
            read_bandwidth_gbs=2.0,
            write_bandwidth_gbs=1.0,
            read_latency_ns=300,
            write_latency_ns=300,
            access_bytes=256,
        ),
        block_scm=None
        if block_scm is None
        else BlockTierConfig(
            capacity=block_scm,
            read_bandwidth_gbs=2.0,
            write_bandwidth_gbs=1.0,
            read_latency_ns=80_000,
            write_latency_ns=20_000,
            read_iops=100_000,
            write_iops=50_000,
            max_pass_bytes=256 << 10,  # a tiny host's I/O passes (2 of them are planned DRAM)
        ),
        compute=ComputeConfig(step_overhead_us=100, table_overhead_us=10, lookup_ns=20),
        cache_manager=CacheManagerConfig(
            table_overhead_us=50, lookup_ns=5, unique_ns=20, miss_ns=200, slot_ns=0.0
        ),
    )


def tables(rows: list[int], dim: int = 16) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t_cat_{i}", embedding_dim=dim, num_embeddings=n, feature_names=[f"cat_{i}"]
        )
        for i, n in enumerate(rows)
    ]
