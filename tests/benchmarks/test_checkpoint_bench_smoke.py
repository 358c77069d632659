"""benchmarks/checkpoint_bench.py end to end on tiny tables: a full and an incremental
checkpoint of one W2-shaped run, then a resume that rebuilds every deleted tier file from the
chain with the same rows, and the flat layout's full checkpoint as the baseline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_checkpoint_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "ckpt.json"
    script = REPO / "benchmarks" / "checkpoint_bench.py"
    done = subprocess.run(
        [sys.executable, str(script), "--smoke", "--out", str(out), "--dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["full"]["parent"] is None and r["incremental"]["parent"] == "step_00000003"
    assert 0 < r["incremental"]["changed_rows"] < r["w2"]["num_rows"]
    assert r["incremental"]["bytes"] < r["full"]["bytes"] / 4
    assert r["resume"]["returncode"] == 0 and r["resume"]["tier_files"] > 0
    assert r["resume"]["exact"], r["resume"]
    assert "rebuilt with the same rows -> EXACT" in done.stdout
    # The flat layout's full checkpoint of the same steps, timed as the baseline.
    assert r["flat_full"]["parent"] is None and r["flat_full"]["bytes"] > 0
    assert r["full_seconds_default_over_flat"] > 0
    assert not list(tmp_path.glob("w2_bench_*"))  # run directory removed
