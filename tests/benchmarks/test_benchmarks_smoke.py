"""Smoke runs of the workload benchmarks (W1, W2) at tiny sizes: they run every variant and
write their JSON (and W1's PNG) with the expected keys. Correctness only, never timings.

Where this process may not create a memory cgroup (not root, no memory controller) the
benchmarks skip the cap and say so; these tests accept either and check the report matches.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_w1_smoke(tmp_path: Path) -> None:
    out = tmp_path / "w1.json"
    # Two budgets: the second's runs must not start from files the first trained.
    args = ("--smoke", "--budgets", "0.15,0.5", "--out", str(out), "--dir", str(tmp_path))
    done = _run("w1_bench.py", *args, "--malloc-trim-threshold", "64MiB")
    r = json.loads(out.read_text())
    assert set(r) >= {"workload", "machine", "overhead_bytes", "A", "budgets", "summary", "probe"}
    assert r["A"]["ok"] and r["A"]["samples_per_s"] > 0
    # Every variant, once built, set to reuse the host memory its steps free.
    reuse = {"trim_threshold": 64 * 2**20}
    assert (
        r["A"]["malloc"] == r["probe"]["malloc"] == r["budgets"]["0.15"]["ours"]["malloc"] == reuse
    )
    pair = r["budgets"]["0.15"]
    for variant in ("B", "ours"):
        run = pair[variant]
        assert run["ok"], run
        assert run["samples_per_s"] > 0 and len(run["window_samples_per_s"]) == 2
        assert run["peak_rss_bytes"] > 0 and "io" in run
    v = pair["B"]["verification"]  # B trained on the mapped files, not on a copy
    assert v["tbe_weights_are_the_mapping"] and v["file_rows_equal_kernel_rows"]
    assert v["rows_checked_on_file"] > 0
    ours = pair["ours"]
    assert 0.0 <= ours["hit_rate"] <= 1.0 and ours["tiers"]["lookups"] > 0
    assert ours["stall_share"] is not None and ours["block_reads"]["rows"] > 0
    assert "block_scm" in ours["plan"]
    # The tier worker's CPU a step, split: reads and write-backs, each with its kernel part.
    parts, worker = ours["worker_cpu_parts_ms_per_step"], ours["cpu_ms_per_step"]["tier_io"]
    assert parts["read_cpu"] > 0 and parts["write_cpu"] > 0
    for what in ("read", "write"):
        assert 0 <= parts[f"{what}_kernel"] <= parts[f"{what}_cpu"] + 0.05, parts
    assert 0 <= ours["kernel_cpu_ms_per_step"]["tier_io"] <= worker + 0.05
    assert "CPU a step of ours at 15%: training thread" in done.stdout
    # Beside the measured hit rates, the same caches replayed and MIN's on the same batches.
    bounds = ours["hit_rate_bounds"]
    assert bounds["lookahead"] == 2 and bounds["tables"]
    for name, t in bounds["tables"].items():
        hits = t["hits"]
        assert hits["min"] >= max(hits["replayed"], hits["seen_ahead"]), name
        if t["lookups"] == t["measured_lookups"]:  # the same batches: the replay is the cache
            assert hits["replayed"] == hits["measured"] <= hits["min"], name
        # The best online: expected hits of the most probable rows, within the lookups.
        assert 0 < hits["best_online"] < t["lookups"], name
    assert "MIN (Belady's optimal" in done.stdout and "MIN seeing 2" in done.stdout
    assert f"all {len(bounds['tables'])} tables" in done.stdout
    row = r["summary"]["table"][0]
    assert row["ours_min_hit_rate"] == bounds["overall"]["min"] > 0
    assert row["ours_best_online_hit_rate"] == bounds["overall"]["best_online"] > 0
    assert row["best_online_blocks_per_step"] > 0  # (its IOPS-bound rate needs the disk's)
    assert "best online" in done.stdout and "without knowing future batches" in done.stdout
    assert row["ours_vs_A"] > 0 and row["ours_vs_B"] > 0
    assert set(r["summary"]["targets"]) >= {"ours_vs_A_at_15pct", "ours_vs_B_at_15pct"}
    if r["capped"]:
        assert pair["cap_bytes"] > r["overhead_bytes"] and ours["cap_bytes"] == pair["cap_bytes"]
    else:
        assert r["cap_skipped_reason"] and "memory cap skipped" in done.stdout
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "ours/A" in done.stdout and "A (FUSED, all DRAM, no cap)" in done.stdout
    # Every variant trained what A trains: from A's weights, its first losses are A's.
    first = r["A"]["first_losses"]
    assert len(first) >= 10 and len(set(first)) > 1
    for budget in ("0.15", "0.5"):
        for variant in ("B", "ours"):
            assert r["budgets"][budget][variant]["first_losses"][: len(first)] == first, variant
    for variant in ("B", "ours"):
        assert done.stdout.count(f"[{variant}] first {len(first)} losses are A's, bit for bit") == 2
    assert not list(tmp_path.glob("w1_bench_*"))  # work files removed
    assert row["ours_blocks_per_step"] > 0  # the block I/O ours' steps needed
    # An earlier run's summary and plot are recomputed from its JSON alone.
    again = tmp_path / "again.json"
    _run("w1_bench.py", "--render", str(out), "--out", str(again))
    assert json.loads(again.read_text())["summary"] == r["summary"]
    assert again.with_suffix(".png").exists()


def test_a_variant_that_trains_another_model_is_stopped() -> None:
    from torchrec_mtrains.benchmark.losses import LossMismatch, check_losses

    check_losses("ours", [0.5, 0.25, 0.125], [0.5, 0.25, 0.125])
    with pytest.raises(LossMismatch, match=r"ours: step 1 loss 0\.3, A's 0\.25"):
        check_losses("ours", [0.5, 0.3, 0.125], [0.5, 0.25, 0.125])
    check_losses("ours", [0.5, 0.25 * (1 + 1e-7)], [0.5, 0.25], rtol=1e-6)  # CUDA's tolerance
    with pytest.raises(LossMismatch, match="beyond 1e-06 relative"):
        check_losses("ours", [0.5, 0.25 * (1 + 1e-5)], [0.5, 0.25], rtol=1e-6)


def test_w1_opens_its_block_stores_with_the_presets_options(tmp_path: Path) -> None:
    """W1's stores are opened as the app opens them (store_options of the host the planner
    costs), so the local preset's queue depth, not the store's own default, reaches them."""
    from apps.dlrm.workloads import w1
    from torchrec_mtrains.distributed.runtime import process_group
    from torchrec_mtrains.planner.presets import load_topology
    from torchrec_mtrains.tiers.options import LogBlockScmOptions

    wl = w1.Workload.smoke()
    preset = load_topology("local").block_scm
    assert preset is not None and preset.queue_depth != LogBlockScmOptions().queue_depth
    with process_group():
        built = w1.build_tiered(wl, tmp_path, int(0.15 * wl.embedding_bytes), 2, smoke=True)
        stores = [shard.store for group in w1.tiered_groups(built.model) for shard in group.shards]
        assert stores
        for store in stores:
            assert store.options.queue_depth == preset.queue_depth, store
            assert store.options.block_size == preset.block_size
        for group in w1.tiered_groups(built.model):
            group.close()


def test_w2_smoke(tmp_path: Path) -> None:
    out = tmp_path / "w2.json"
    done = _run("w2_bench.py", "--smoke", "--out", str(out), "--dir", str(tmp_path))
    r = json.loads(out.read_text())
    assert r["app"]["returncode"] == 0 and r["summary"]["trained"]
    m = r["metrics"]
    assert m["steps"] == 6 and m["samples_per_s"] > 0 and 0.0 <= m["cache_hit_rate"] <= 1.0
    assert any(t["tier_bytes_read"] > 0 for t in m["tables"].values())  # tables on a tier
    assert "block_scm" in r["plan"] and "byte_scm " not in r["plan"]
    assert r["app"]["peak_rss_bytes"] > 0 and r["table_bytes"] > 0
    assert 0 < r["app"]["peak_anon_bytes"] <= r["app"]["peak_rss_bytes"]
    if r["capped"]:
        assert r["app"]["cgroup_peak_bytes"] <= r["cap_bytes"]
        assert r["summary"]["cgroup_peak_under_cap"]
    else:
        assert "memory cap skipped" in done.stdout
    assert "W2 results" in done.stdout
    assert not list(tmp_path.glob("w2_bench_*"))  # run directory removed
    # A (every table FUSED in DRAM) ran first; the tiered run trained its losses exactly.
    ref = r["reference"]
    assert "tiered" not in ref["plan"] and "tiered" in r["plan"]
    assert m["train_losses_first"] == ref["first_losses"] and len(set(ref["first_losses"])) > 1
    assert r["losses_checked"] == 6 and "first 6 losses are A's" in done.stdout
    # U (TorchRec's UVM caching on the same tables) needs CUDA: reported as not run.
    assert "CUDA only" in r["U"]["not_run"]
    assert "FUSED_UVM_CACHING): not run: " in done.stdout


def test_w2_u_is_an_app_run_the_cpu_refuses_naming_cuda(tmp_path: Path) -> None:
    """U's command line composes into the app's config (every key exists); without CUDA the
    app refuses it before writing anything, naming the option, and U reports that line."""
    w2 = _load("w2_bench")
    args = argparse.Namespace(
        model="w2_large",
        batch_size=128,
        smoke=True,
        steps=2,
        threads=1,
        dram_budget="1MiB",
        uvm_cache_load_factor=0.15,
        override=[],
    )
    cmd = w2.uvm_command(args, tmp_path / "uvm")
    assert "planner.large_tables=uvm_caching" in cmd and not w2.on_cuda(args)
    assert w2.on_cuda(argparse.Namespace(override=["run.device=cuda"]))
    u = w2.run_uvm(args, tmp_path, None, w2.cgroup_support())
    assert u["returncode"] == 2, u.get("log_tail")
    assert u["error"].startswith("error: planner.large_tables=uvm_caching: TorchRec's FUSED_")
    assert u["trained_steps"] == 0 and u["samples_per_s"] is None
    assert not (tmp_path / "uvm").exists()  # refused before the run wrote anything


def test_w2_check_names_the_first_step_that_differs() -> None:
    w2 = _load("w2_bench")
    assert w2.check_losses([0.5, 0.25], [0.5, 0.25]) is None
    assert w2.check_losses([0.5, 0.3], [0.5, 0.25]) == "step 1: loss 0.3, A's 0.25"
    assert "trained 1 steps, A 2" in w2.check_losses([0.5], [0.5, 0.25])


def test_multi_read_smoke(tmp_path: Path) -> None:
    """Both ways read the same rows and report their costs; nothing is left on disk."""
    out = tmp_path / "multi_read.json"
    done = _run("multi_read_bench.py", "--smoke", "--dir", str(tmp_path), "--out", str(out))
    r = json.loads(out.read_text())
    assert r["same_rows"]
    for way in ("alone", "together"):
        assert r[way]["ms_per_batch"] > 0 and r[way]["io_calls_per_batch"] > 0
    assert "together / alone" in done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["multi_read.json"]


def test_gpu_bench_smoke_on_the_cpu(tmp_path: Path) -> None:
    """The GPU benchmark's every part but CUDA: A, the three tiers, the disk's rate, a profile
    after the timed windows, JSON, PNG; U is reported as CUDA-only."""
    out = tmp_path / "gpu.json"
    args = ("--device", "cpu", "--smoke", "--profile-steps", "1")
    _run("gpu_bench.py", *args, "--out", str(out), "--dir", str(tmp_path))
    r = json.loads(out.read_text())
    runs = r["batches"]["256"]
    assert runs["U"]["ok"] is False and "CUDA only" in runs["U"]["skipped"]
    assert runs["A"]["ok"] and runs["A"]["samples_per_s"] > 0
    for variant in ("ours_dram", "ours_byte_scm", "ours_block_scm"):
        run = runs[variant]
        assert run["ok"], run
        assert run["malloc"] == runs["A"]["malloc"] == {"trim_threshold": None}  # off by default
        assert (
            run["losses_vs_A"] == "bit for bit" and run["first_losses"] == runs["A"]["first_losses"]
        )
        assert 0.0 <= run["hit_rate"] <= 1.0 and run["h2d_bytes_per_step"] > 0
        assert run["stall_share"] is not None and run["tier"] in variant
        assert r["summary"]["256"][variant]["vs_A"] > 0
    assert runs["ours_block_scm"]["read_blocks_per_step"] > 0
    # warmed up until the caches were full; the profile names the operators a step ran
    for variant in ("ours_dram", "ours_byte_scm", "ours_block_scm"):
        assert runs[variant]["caches_full_before_timing"] is True
    assert runs["A"]["caches_full_before_timing"] is True  # no cache: nothing to fill
    assert "by self_cpu_time_total" in runs["A"]["profile"]
    assert "[lookup]" in runs["ours_dram"]["profile"]
    assert r["disk"]["iops"] > 0 and r["summary"]["256"]["ours_block_scm_iops_bound_samples_per_s"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert not list(tmp_path.rglob("*.rows")), "each variant's tier files are removed after it"


def test_gpu_check_runs_the_cuda_tests_then_the_benchmark_into_one_folder(tmp_path: Path) -> None:
    """The GPU host's one command, on the CPU: the CUDA tests (all skipped here), the benchmark
    with the options given after the folder, then W3 in the time kept for it (its options
    overridden to run small on the CPU), every file the host's run brings back."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_WORKERS": "1"}
    env["GPU_CHECK_TMP"] = str(tmp_path)
    env["GPU_CHECK_W3_SECONDS"] = "60"
    env["GPU_CHECK_W3_ARGS"] = (
        "--device cpu --steps 4 --warmup 2 --window-steps 2 --batch-size 32 --vocab 2000 "
        "--live-rows 400 --hash-rows 128 --dim 8 --cache-load-factor 0.5 --eval-batches 1 "
        "--check-steps 2 --mc-eviction-interval 1 --increment-steps 2"
    )
    args = ["--device", "cpu", "--smoke", "--variants", "A"]
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "200", str(out), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {
        "nvidia-smi.txt", "versions.txt", "cuda_tests.log", "cuda_tests.xml", "gpu.json",
        "gpu.png", "gpu_bench.log", "w3.json", "w3.png", "w3.log", "summary.txt",
    }  # fmt: skip
    assert "skipped" in (out / "cuda_tests.log").read_text()
    runs = json.loads((out / "gpu.json").read_text())["batches"]["256"]
    assert runs["A"]["ok"] and "profile" in runs["A"]
    assert (
        (out / "summary.txt")
        .read_text()
        .startswith("cuda tests: exit 0; gpu_bench: exit 0; w3: exit 0 (60 s kept)")
    )
    assert json.loads((out / "w3.json").read_text())["args"]["steps"] == 4  # the override


def test_gpu_bench_reports_no_figure_of_a_variant_that_trains_another_model(
    tmp_path: Path,
) -> None:
    bench = _load("gpu_bench")
    from apps.dlrm.workloads.w1 import Workload

    wl = Workload.smoke()
    spec = bench.WorkerSpec(
        variant="ours_dram",
        device="cpu",
        workload=dataclasses.asdict(wl),
        warmup=1,
        windows=1,
        window_steps=1,
        directory=str(tmp_path / "tiers"),
        out=str(tmp_path / "ours_dram.json"),
        cache_load_factor=0.15,
        min_rows=10_000,
        lookahead=2,
        threads=1,
        check_steps=2,
        reference_losses=[0.5, 0.5],  # not what W1's first steps train to
    )
    record = bench.launch(spec, tmp_path, timeout_s=200)
    assert record["ok"] is False and "samples_per_s" not in record
    assert "ours_dram: step 0 loss" in record["error"] and "trains another model" in record["error"]


def test_u_puts_the_big_tables_on_torchrecs_uvm_caching_at_the_cache_load_factor() -> None:
    """U's plan, made without a GPU: the tables of >= 1M rows (W1's five) on FUSED_UVM_CACHING
    with the cache load factor and TorchRec's prefetch pipeline, the rest FUSED."""
    from apps.dlrm.workloads import w1

    wl = w1.Workload.full()
    _, plan = w1.uvm_cached_plan(wl, 0.15, 1_000_000)
    big = w1.big_tables(wl, 1_000_000)
    assert len(big) == 5
    for name, sharding in plan.items():
        if name in big:
            assert sharding.compute_kernel == "fused_uvm_caching"
            assert sharding.cache_params is not None
            assert sharding.cache_params.load_factor == 0.15
            assert sharding.cache_params.prefetch_pipeline
        else:
            assert sharding.compute_kernel == "fused" and sharding.cache_params is None


def test_tier_bench_smoke_with_skewed_write_backs_and_no_flush(tmp_path: Path) -> None:
    """The write-back phase as training between checkpoints: Zipf ids, no flush until the
    end; the log tier compacts (its file is bounded) and the CPU per batch is reported."""
    out = tmp_path / "tiers.json"
    args = ("--dir", str(tmp_path), "--tiers", "log_block_scm", "dram", "--rows", "20000")
    args += ("--dim", "8", "--batch", "512", "--seconds", "0.3", "--flush-every", "0")
    _run("tier_bench.py", *args, "--zipf", "1.1", "--max-space-amplification", "1.5", "--no-fio",
         "--out", str(out))  # fmt: skip
    r = json.loads(out.read_text())["tiers"]
    for tier in ("log_block_scm", "dram"):
        w = r[tier]["writeback"]
        assert w["batches"] > 0 and w["cpu_ms_per_batch"] > 0 and w["rows_s"] > 0
    assert r["log_block_scm"]["writeback"]["log"]["compacted_rows"] > 0


def test_tier_bench_smoke_compares_the_engines(tmp_path: Path) -> None:
    """The engine comparison alone (no tier phases): every engine at every depth, alone and
    under the block store, with CPU per read and IOPS, and the same rows read by all."""
    out = tmp_path / "engines.json"
    args = ("--dir", str(tmp_path), "--tiers", "--engine", "aio,uring,threads", "--depths", "4,8")
    args += ("--engine-gib", "0.01", "--seconds", "0.2", "--repeats", "2", "--batch", "256")
    done = _run("tier_bench.py", *args, "--no-fio", "--out", str(out))
    r = json.loads(out.read_text())
    assert not r["tiers"] and r["machine"]["kernel"] and r["date"]
    e = r["engines"]
    assert e["same_rows"] and e["depths"] == [4, 8] and e["cpu_target_us"] > 0
    assert set(e["runs"]) == {"aio", "uring", "threads"}
    for engine, by_depth in e["runs"].items():
        for run in by_depth.values():
            if "not_run" in run:  # a kernel that refuses io_uring: said why, not measured
                assert engine == "uring" and "refuses the uring engine" in run["not_run"]
                continue
            assert run["engine_used"] == engine
            for way in ("engine", "store"):
                assert len(run[way]["repeats"]) == 2
                assert run[way]["iops_median"] > 0 and run[way]["cpu_us_median"] > 0
                assert run[way]["cpu_us_min"] <= run[way]["cpu_us_median"]
    assert "| engine | QD |" in done.stdout and "| uring | 8 |" in done.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["engines.json"]  # work file removed


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_w3_smoke(device: str, tmp_path: Path) -> None:
    out = tmp_path / "w3.json"
    # on CUDA the losses are held within the CUDA parity tests' tolerance
    equal = "losses equal" if device == "cpu" else "losses within 1e-06 relative"
    done = _run(
        "w3_bench.py",
        # 22 batches of ~95 new ids a table: past the bound of 1,500 live rows
        *("--steps", "12", "--warmup", "10", "--batch-size", "256", "--vocab", "20000"),
        *("--window-steps", "5"),
        *("--live-rows", "1500", "--hash-rows", "512", "--dim", "16", "--eval-batches", "2"),
        *("--cache-load-factor", "0.5", "--device", device),
        *("--out", str(out), "--dir", str(tmp_path)),
    )
    assert f"check: ours = FUSED over 4,096 rows per table for 10 steps: {equal}" in done.stdout
    assert (
        "check: A'' = TorchRec's managed collisions over FUSED (1,024 slots per table, ids below "
        f"4,096) for 30 steps: {equal}" in done.stdout
    )
    # the hashed model through TorchRec's own pipeline trains as the plain loop does
    assert (
        "check: A'p = A' (TorchRec's TrainPipelineSparseDist against the plain loop) over the 12 "
        f"timed steps: {equal}" in done.stdout
    )
    assert json.loads(out.read_text())["args"]["device"] == device
    result = json.loads(out.read_text())
    assert result["malloc"] == {"trim_threshold": 256 * 2**20}  # every variant, once built
    for variant in ("A'", "A'p", "A''", "ours"):
        assert {"samples_per_s", "eval_ne", "eval_auc"} <= set(result[variant])
        # 12 timed steps in windows of 5, taken in turns
        assert len(result[variant]["window_samples_per_s"]) == 3
    for variant in ("A'p", "A''", "ours"):
        assert len(result[variant]["window_ratios"]) == 3
        assert f"{variant} / A' per window of 5 steps" in done.stdout
    assert len(result["ours"]["window_ratios_to_pipelined"]) == 3
    assert "ours / A'p per window of 5 steps" in done.stdout
    assert result["A'"]["eval_ne"] == result["A'p"]["eval_ne"]  # the same model trained
    # A''s hashed tables' bytes; the caches of A'' and ours (half of 1,500 rows a table), their
    # maps, and the remapping tensors of A'' (its sorted raw ids and counts, 16 bytes a slot)
    assert result["A'"]["dram_bytes"] == result["A'p"]["dram_bytes"] == 2 * 512 * (16 * 4 + 4)
    assert result["ours"]["dram_bytes"] > 2 * 750 * (16 * 4 + 4)
    assert result["A''"]["dram_bytes"] > 2 * 750 * (16 * 4 + 4) + 2 * 1500 * 16
    rate = result["A''"]["samples_per_s"]
    assert f"A''      {rate:10,.0f}" in done.stdout
    assert ("host memory" if device == "cpu" else "HBM") in done.stdout
    # started again with huge pages for tensors, as W1's variants run
    assert result["thp"] and "huge pages for tensors (THP_MEM_ALLOC_ENABLE=1): on" in done.stdout
    tables = result["ours"]["tables"]
    assert set(tables) == {"user", "item"}
    # TorchRec's keep-the-highest-scored policy, its decay recorded as applied
    assert (result["args"]["eviction"], result["args"]["decay_rate"]) == ("score", 0.99)
    for name, stats in tables.items():  # the bound held: ids past it were evicted
        assert stats["live_rows"] <= 1500 and stats["rows_evicted"] > 0
        # a round keeps 0.75 of the bound (1,125), and at most 0.95 (1,425) wait for the next
        assert 1125 <= stats["live_rows"] <= 1425 + 95
        assert stats["rows_made"] == stats["live_rows"] + stats["rows_evicted"]
        # every distinct id was made at least once (ids seen only in the check are not)
        assert 0 < result["distinct_ids"][name] <= stats["rows_made"]
    assert "distinct raw ids over the run's batches" in done.stdout
    checkpoint = result["ours"]["checkpoint"]
    assert checkpoint["live_rows"] == sum(t["live_rows"] for t in tables.values())
    # live rows only, not the bound (at this size dcp's own files weigh: W3 runs the real one)
    assert checkpoint["bytes"] < 2 * 1500 * (16 * 4 + 4 + 8) * 1.5
    assert out.with_suffix(".png").stat().st_size > 0
    assert not list(tmp_path.glob("w3-*"))  # tier files removed


def test_thread_contention_smoke(tmp_path: Path) -> None:
    out = tmp_path / "contention.json"
    done = _run(
        "thread_contention_bench.py",
        *("--steps", "2", "--rounds", "2", "--warmup", "2", "--batch-size", "128"),
        *("--hash-rows", "512", "--check-steps", "2", "--switch-interval", "0.001"),
        *("--out", str(out)),
    )
    assert "losses equal to the steps alone" in done.stdout
    result = json.loads(out.read_text())
    assert result["switch_interval_s"] == 0.001
    assert set(result["median_ms_per_step"]) == {"alone", "compiled", "rows", "numpy", "python"}
    assert all(len(v) == 2 for v in result["ms_per_step"].values())  # one per round
    assert result["vs_alone"]["alone"] == 1.0
    for name in ("alone", "compiled", "rows", "numpy", "python"):  # (no timing: a smoke run)
        assert f"\n{name:10} {result['median_ms_per_step'][name]:10.2f}" in done.stdout


def test_eviction_round_smoke(tmp_path: Path) -> None:
    out = tmp_path / "round.json"
    done = _run(
        "eviction_round_bench.py",
        *("--live-rows", "4096", "--repeats", "3", "--out", str(out)),
    )
    assert "check: select chose the 1,024 rows the full sort chose" in done.stdout
    assert "check: numpy's paths give the compiled ones' results (" in done.stdout
    result = json.loads(out.read_text())
    assert result["rows_evicted"] == 1024  # a quarter of the live rows
    names = {"candidates", "candidates_numpy", "select", "select_numpy", "sort", "remove"}
    assert set(result["median_ms"]) == names
    assert all(len(v) == 3 for v in result["ms"].values())
    for ratio in ("select_vs_sort", "select_vs_numpy", "candidates_vs_numpy"):
        assert result[ratio] > 0  # (no timing asserted: a smoke run)
