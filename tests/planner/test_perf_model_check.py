"""The perf-model benchmark runs end to end and prints predictions next to measurements."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("process_group")
def test_perf_model_check_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location(
        "perf_model_check", REPO / "benchmarks" / "perf_model_check.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["perf_model_check"] = module
    spec.loader.exec_module(module)
    assert module.main(["check", "--quick", "--dir", str(tmp_path), "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "measured" in out and "error" in out
