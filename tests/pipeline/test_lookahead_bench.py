"""benchmarks/lookahead_bench.py end to end on tiny tables: both runs, the same training, JSON."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_benchmark_runs_both_modes_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location(
        "lookahead_bench", REPO / "benchmarks" / "lookahead_bench.py"
    )
    assert spec is not None and spec.loader is not None
    lookahead_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lookahead_bench)
    out = tmp_path / "out.json"
    args = ["--rows", "20000", "--batch-size", "128", "--warmup", "2", "--steps", "4"]
    result = lookahead_bench.main(
        [*args, "--lookahead", "2", "--dir", str(tmp_path), "--out", str(out)]
    )

    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    plain, ahead = result["runs"]
    assert (plain["lookahead"], ahead["lookahead"]) == (0, 2)
    assert plain["steps"] == ahead["steps"] == 4
    assert result["same_final_loss"]  # look-ahead trains exactly what the plain loop does
    for r in (plain, ahead):
        assert r["step_ms"] > 0 and 0 <= r["stall_share"] <= 1
        assert r["rows_fetched_per_step"] > 0
    assert "block_scm" in plain["plan"]
    printed = capsys.readouterr().out
    assert "stall %" in printed and "plain / look-ahead" in printed
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # tier files removed
