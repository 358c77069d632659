"""Smoke run of ``benchmarks/cache_bench.py`` at tiny sizes: every backend runs and plans alike
(same hit rate and evictions) and the JSON has its keys. Correctness only, never timings."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "cache_bench.py"


def test_cache_bench_smoke(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("cache_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cache_bench"] = module
    spec.loader.exec_module(module)
    out = tmp_path / "cache.json"
    assert module.main(["--smoke", "--policy", "lfu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert {r["backend"] for r in results} >= {"torch"}
    for r in results:
        assert r["ms_per_batch"] > 0 and r["gil_share"] >= 0.0
        assert set(r["ms_per_stage"]) == {
            "unique",
            "check_fits",
            "plan",
            "hold",
            "remap",
            "mark_dirty",
            "release",
        }
    assert len({(r["hit_rate"], r["evictions_per_batch"]) for r in results}) == 1
