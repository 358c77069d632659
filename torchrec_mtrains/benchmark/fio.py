"""The disk under a directory as fio measures it: what a block tier's figures are judged against.

Every job is 4 KiB random I/O through libaio with O_DIRECT on a file fio makes (and this removes)
in the directory, so the page cache plays no part, as for the block tier itself.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

__all__ = ["fio_job", "run_fio"]


def fio_job(
    directory: Path, rw: str, queue_depth: int, seconds: float, size: str = "1g"
) -> dict[str, float] | None:
    """One fio job (``rw`` is fio's ``randread`` or ``randwrite``) at ``queue_depth`` for
    ``seconds`` over a file of ``size``: ``{"iops", "lat_us"}``, or ``None`` without fio."""
    if shutil.which("fio") is None:
        return None
    target = directory / "fiofile"
    cmd = [
        "fio", "--name=f", f"--rw={rw}", "--bs=4k", f"--iodepth={queue_depth}",
        "--ioengine=libaio", "--direct=1", f"--size={size}", f"--runtime={seconds:g}",
        "--time_based", f"--filename={target}", "--output-format=json",
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
    finally:
        target.unlink(missing_ok=True)
    job = json.loads(done.stdout)["jobs"][0]["write" if "write" in rw else "read"]
    return {"iops": float(job["iops"]), "lat_us": float(job["lat_ns"]["mean"]) / 1000}


def run_fio(directory: Path, seconds: int, size: str) -> dict[str, float] | None:
    """Random 4 KiB reads at queue depth 32: the rate a block tier's misses are judged by."""
    return fio_job(directory, "randread", 32, seconds, size)
