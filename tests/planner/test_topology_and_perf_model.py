"""Hardware presets load and validate; the perf model's geometry and monotonicity."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import numpy as np
import pytest
from planner_helpers import small_host

from torchrec_mtrains.planner import (
    HostTopology,
    Placement,
    ShardWork,
    available_presets,
    load_topology,
    parse_size,
    shard_step_time,
    topology_from_config,
    zipf_access,
)
from torchrec_mtrains.planner.perf_model import (
    distinct_units,
    partial_units_per_row,
    units_per_row,
)
from torchrec_mtrains.planner.presets import on_compute_device, preset_path, store_options
from torchrec_mtrains.planner.topology import GpuConfig
from torchrec_mtrains.tiers import BlockScmOptions, ByteScmOptions, DramOptions, LogBlockScmOptions
from torchrec_mtrains.types import Tier

PRESETS = available_presets()


def test_the_three_presets_exist() -> None:
    assert {"local", "gpu_pmem_nvme", "cpu_cxl_nvme"} <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_loads_and_validates(name: str) -> None:
    host = load_topology(name)
    assert isinstance(host, HostTopology)
    assert Tier.DRAM in host.tiers()
    assert host.host_capacity(Tier.DRAM) > 0
    for tier in host.tiers():
        assert host.rank_capacity(tier, host.ranks_per_host) > 0
    if host.gpu is not None:
        assert host.compute_device == "cuda" and host.ranks_per_host == host.gpu.count
    if host.block_scm is not None:
        assert host.block_scm.access_bytes == host.block_scm.block_size


def test_the_compute_device_decides_where_caches_and_fast_tables_go() -> None:
    gpu_host = load_topology("gpu_pmem_nvme")
    on_cpu = on_compute_device(gpu_host, "cpu")
    assert on_cpu.gpu is None and on_cpu.compute_device == "cpu"
    assert on_cpu.cache_tier is Tier.DRAM and Tier.HBM not in on_cpu.tiers()
    assert on_compute_device(gpu_host, "cuda") is gpu_host  # the preset's GPUs are kept

    local = load_topology("local")
    assert on_compute_device(local, "cpu") is local
    on_gpu = on_compute_device(local, "cuda", GpuConfig(count=1, name="H100", hbm_capacity="80GB"))
    assert on_gpu.compute_device == "cuda" and on_gpu.ranks_per_host == 1
    assert on_gpu.cache_tier is Tier.HBM and on_gpu.rank_capacity(Tier.HBM, 1) == 80 * 10**9
    with pytest.raises(ValueError, match="describes no GPU"):
        on_compute_device(local, "cuda")
    with pytest.raises(ValueError, match="'tpu'"):
        on_compute_device(local, "tpu")


def test_presets_with_storage_tiers() -> None:
    gpu = load_topology("gpu_pmem_nvme")
    assert gpu.byte_scm is not None and gpu.block_scm is not None and gpu.gpu is not None
    assert gpu.byte_scm.access_bytes == 256  # Optane PMem's media line
    cpu = load_topology("cpu_cxl_nvme")
    assert cpu.gpu is None and cpu.byte_scm is not None and cpu.block_scm is not None


def test_presets_ship_inside_the_package(tmp_path: Path) -> None:
    """Found next to the installed module, not through a repository checkout's ``conf/``."""
    import torchrec_mtrains

    package = Path(torchrec_mtrains.__file__).parent
    assert preset_path("local") == package / "conf" / "hardware" / "local.yaml"
    # The library's presets leave the tier location to the job, one directory per run.
    assert load_topology("local").tier_root is None


def test_load_topology_takes_overrides_and_files(tmp_path: Path) -> None:
    host = load_topology("local", ["hardware.dram.capacity=48GB", "block_scm.queue_depth=8"])
    assert host.dram.capacity == "48GB"
    assert host.block_scm is not None and host.block_scm.queue_depth == 8
    mine = tmp_path / "mine.yaml"
    mine.write_text(preset_path("local").read_text().replace("name: local", "name: mine"))
    assert load_topology(mine).name == "mine"
    with pytest.raises(ValueError, match="does not exist"):
        load_topology(tmp_path / "none.yaml")
    with pytest.raises(ValueError, match="expected key=value"):
        load_topology("local", ["dram.capacity"])
    with pytest.raises(ValueError, match=r"dram\.capacty"):
        load_topology("local", ["dram.capacty=1GB"])


def test_invalid_configs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="not a size"):
        parse_size("12 parsecs")
    with pytest.raises(ValueError, match="capacity"):
        topology_from_config({"dram": {"capacity": "lots"}})
    with pytest.raises(ValueError, match="invalid hardware config"):
        topology_from_config({"dram": {"capacty": "1GB"}})
    with pytest.raises(ValueError, match="unknown hardware preset"):
        load_topology("no_such_host")
    assert parse_size("1.5KiB") == 1536 and parse_size("2GB") == 2 * 10**9


def test_block_geometry() -> None:
    # 4096 B rows aligned to 4096 B blocks: one block each, never partial.
    assert units_per_row(4096, 4096) == 1.0 and partial_units_per_row(4096, 4096) == 0.0
    # 260 B rows straddle a boundary with probability ~259/4096 (starts on multiples of 4).
    assert units_per_row(260, 4096) == pytest.approx(1 + 256 / 4096)
    assert partial_units_per_row(260, 4096) == pytest.approx(units_per_row(260, 4096))
    # Against a direct count over packed rows (row i starts at i * row_bytes).
    for row_bytes in (68, 260, 516, 5000, 5120, 12288):
        starts = np.arange(4096, dtype=np.int64) * row_bytes
        first, last = starts // 4096, (starts + row_bytes - 1) // 4096
        assert units_per_row(row_bytes, 4096) == pytest.approx(float((last - first + 1).mean()))
    # Rows of one batch sharing blocks share I/O: few rows -> ~no sharing, many -> all blocks.
    assert distinct_units(10, 1.0, 1e9) == pytest.approx(10, rel=1e-6)
    assert distinct_units(1e6, 1.0, 100) == pytest.approx(100)


def _work(rows: int = 1_000_000, dim: int = 64, unique: float = 2000) -> ShardWork:
    return ShardWork(
        rows=rows,
        cols=dim,
        state_width=1,
        element_bytes=4,
        samples=4096,
        lookups=4096,
        unique_rows=unique,
    )


def test_step_time_falls_with_hit_rate_and_block_costs_more_than_byte() -> None:
    host = small_host()
    times = [
        shard_step_time(
            Placement.CACHED_BLOCK_SCM, _work(), host, cache_rows=10_000, hit_rate=h
        ).total
        for h in (0.0, 0.5, 0.9, 1.0)
    ]
    assert times == sorted(times, reverse=True)
    byte = shard_step_time(Placement.CACHED_BYTE_SCM, _work(), host, cache_rows=10_000)
    block = shard_step_time(Placement.CACHED_BLOCK_SCM, _work(), host, cache_rows=10_000)
    assert block.io > byte.io > 0
    fused = shard_step_time(Placement.FUSED_DRAM, _work(), host)
    assert fused.io == 0 and fused.cache == 0 and fused.compute > 0


def test_block_read_amplification_counts_blocks_not_bytes() -> None:
    host = small_host()
    small = shard_step_time(
        Placement.CACHED_BLOCK_SCM, _work(dim=15), host, cache_rows=1, hit_rate=0.0
    )
    large = shard_step_time(
        Placement.CACHED_BLOCK_SCM, _work(dim=63), host, cache_rows=1, hit_rate=0.0
    )
    # 64 B and 256 B rows both cost about one 4 KiB block each: reads take nearly the same time.
    assert large.tier_read == pytest.approx(small.tier_read, rel=0.1)


def test_zipf_hit_rate_is_monotone_and_skew_helps() -> None:
    skewed = zipf_access("a", 10_000_000, 1.0, 1.1)
    uniform = zipf_access("b", 10_000_000, 1.0, 0.0)
    sizes = [1e3, 1e4, 1e5, 1e6, 1e7]
    rates = [skewed.hit_rate(c, 4096) for c in sizes]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(1.0, abs=1e-3)
    assert skewed.hit_rate(1e5, 4096) > 10 * uniform.hit_rate(1e5, 4096)
    assert uniform.hit_rate(5e6, 4096) == pytest.approx(0.5, abs=0.02)
    assert math.isclose(uniform.unique_rows(100), 100, rel_tol=1e-3)


# ------------------------------------------------------------------ store options from the host


@pytest.mark.parametrize("name", PRESETS)
def test_store_options_carry_the_figures_the_perf_model_uses(name: str) -> None:
    host = load_topology(name)
    options = store_options(host)
    assert host.block_scm is not None
    block = options["block_scm"]
    assert isinstance(block, LogBlockScmOptions)  # the block tier's default layout
    assert block.block_size == host.block_scm.block_size
    assert block.queue_depth == host.block_scm.queue_depth
    storage_tiers = [t for t in host.tiers() if t is not Tier.HBM]
    assert sorted(options) == sorted(t.value for t in storage_tiers)
    for tier in storage_tiers:  # every figure a store's options share with the hardware model
        for key in options[tier.value].hardware_fields:
            assert getattr(options[tier.value], key) == getattr(host.memory(tier), key), key


def test_store_options_follow_an_overridden_queue_depth() -> None:
    host = load_topology("local", ["hardware.block_scm.queue_depth=8"])
    assert store_options(host)["block_scm"] == LogBlockScmOptions(block_size=4096, queue_depth=8)


def test_store_options_follow_the_block_tiers_config() -> None:
    base = small_host()
    assert base.block_scm is not None
    block = dataclasses.replace(base.block_scm, queue_depth=8, block_size=8192)
    host = dataclasses.replace(base, block_scm=block, block_size=8192)
    assert store_options(host) == {
        "dram": DramOptions(),
        "byte_scm": ByteScmOptions(),
        "block_scm": LogBlockScmOptions(block_size=8192, queue_depth=8, max_pass_bytes=256 << 10),
    }


def test_without_a_block_tier_the_hosts_block_size_still_reaches_block_stores() -> None:
    host = dataclasses.replace(small_host(block_scm=None), block_size=16384)
    assert store_options(host)["block_scm"] == LogBlockScmOptions(block_size=16384)


def test_the_block_tiers_block_size_wins_over_the_hosts_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    base = small_host()
    assert base.block_scm is not None
    host = dataclasses.replace(base, block_scm=dataclasses.replace(base.block_scm, block_size=8192))
    with caplog.at_level(logging.WARNING):
        options = store_options(host)
    assert options["block_scm"] == LogBlockScmOptions(block_size=8192, max_pass_bytes=256 << 10)
    assert "block_scm.block_size=8192 differs from block_size=4096" in caplog.text


def test_the_log_layout_writes_back_for_less_than_in_place_and_opens_log_stores() -> None:
    """260-byte rows written back in place cost a read-modify-write of their blocks; the log
    (the default layout) appends them (plus compaction's copies, more the tighter the space
    bound)."""
    log_host = small_host()
    assert log_host.block_scm is not None and log_host.block_scm.layout == "log"
    flat_host = dataclasses.replace(
        log_host, block_scm=dataclasses.replace(log_host.block_scm, layout="flat")
    )
    flat = shard_step_time(Placement.CACHED_BLOCK_SCM, _work(), flat_host, cache_rows=1)
    log = shard_step_time(Placement.CACHED_BLOCK_SCM, _work(), log_host, cache_rows=1)
    assert 0 < log.tier_write < flat.tier_write / 4
    assert log.tier_read >= flat.tier_read  # rows spread over more blocks
    tight = dataclasses.replace(log_host.block_scm, max_space_amplification=1.2)
    tighter = shard_step_time(
        Placement.CACHED_BLOCK_SCM,
        _work(),
        dataclasses.replace(log_host, block_scm=tight),
        cache_rows=1,
    )
    assert tighter.tier_write > log.tier_write
    options = store_options(dataclasses.replace(log_host, block_scm=tight))
    assert options["block_scm"] == LogBlockScmOptions(
        block_size=tight.block_size,
        queue_depth=tight.queue_depth,
        max_space_amplification=1.2,
        max_pass_bytes=tight.max_pass_bytes,
    )
    loaded = load_topology("local", ["hardware.block_scm.layout=flat"])
    assert store_options(loaded)["block_scm"] == BlockScmOptions(queue_depth=128)
    with pytest.raises(ValueError, match="layout must be one of flat, log, got 'lsm'"):
        load_topology("local", ["hardware.block_scm.layout=lsm"])


@pytest.mark.parametrize("layout", ["flat", "log"])
def test_the_io_workers_cpu_per_row_bounds_a_block_tier_the_device_keeps_up_with(
    layout: str,
) -> None:
    """Rows cost the I/O worker CPU whatever the device's speed: with a device far faster than
    that CPU, the CPU sets the tier's time; with none given, nothing changes."""
    base = small_host()
    assert base.block_scm is not None
    fast = dataclasses.replace(
        base.block_scm,
        layout=layout,
        read_iops=1e12,
        write_iops=1e12,
        read_bandwidth_gbs=1e6,
        write_bandwidth_gbs=1e6,
        read_latency_ns=0.0,
        write_latency_ns=0.0,
        call_overhead_us=0.0,
    )
    work = _work()
    free = shard_step_time(
        Placement.CACHED_BLOCK_SCM, work, dataclasses.replace(base, block_scm=fast), cache_rows=1
    )
    busy = shard_step_time(
        Placement.CACHED_BLOCK_SCM,
        work,
        dataclasses.replace(base, block_scm=dataclasses.replace(fast, cpu_ns_per_row=5000.0)),
        cache_rows=1,
    )
    misses = work.unique_rows * (1.0 - 0.0)  # no hits with one cache row
    assert free.tier_read < 1e-6 and busy.tier_read == pytest.approx(misses * 5e-6, rel=1e-3)
    copies = 2.0 / (fast.max_space_amplification - 1.0) if layout == "log" else 0.0
    assert busy.tier_write == pytest.approx(misses * (1 + copies) * 5e-6, rel=1e-3)
    assert load_topology("local").block_scm.cpu_ns_per_row > 0  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="cpu_ns_per_row must be finite and >= 0"):
        dataclasses.replace(fast, cpu_ns_per_row=-1.0)
