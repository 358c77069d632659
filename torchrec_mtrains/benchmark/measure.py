"""What a benchmark reads about its own process and machine, and how it writes its results.

* :class:`ProcessCounters` snapshots what the kernel counts for this process (storage bytes read
  and written, page faults, CPU time); :func:`thread_cpu_seconds` splits CPU time by thread
  role (training thread, tier I/O workers, the rest), or their time in the kernel.
* :func:`drop_file_cache` evicts files from the page cache, so one run cannot warm the next.
* :func:`add_malloc_option` and :func:`apply_malloc_option`: every variant trains with the same
  C allocator settings (:mod:`torchrec_mtrains.malloc`), as the DLRM app's
  ``run.malloc_trim_threshold`` sets them.
* :func:`synchronize` waits for a CUDA device's queued work at a timed window's ends (nothing on
  the CPU).
* :func:`median_windows` turns timed windows into samples/s; :func:`target` records a figure
  against its target; :func:`machine_info` and :func:`write_json` record what a run ran on and
  what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from torchrec_mtrains.distributed.tier_io import WORKER_THREAD_PREFIX
from torchrec_mtrains.malloc import (
    DEFAULT_TRIM_THRESHOLD,
    check_trim_threshold,
    reuse_freed_memory,
)
from torchrec_mtrains.planner.sizes import exact_size, parse_size

__all__ = [
    "ProcessCounters",
    "add_malloc_option",
    "apply_malloc_option",
    "disk_free_bytes",
    "drop_file_cache",
    "machine_info",
    "median_windows",
    "rss_bytes",
    "target",
    "thread_cpu_seconds",
    "write_json",
]


def add_malloc_option(parser: argparse.ArgumentParser, default: int | None) -> None:
    """``--malloc-trim-threshold SIZE|off``: once built, every variant reuses the host memory its
    steps free (:func:`torchrec_mtrains.malloc.reuse_freed_memory`); ``off``: glibc's own
    settings, under which a step's large tensors are paged in afresh every step and a variant's
    speed can depend on what its process freed before. ``default``: the benchmark's."""

    def parse(text: str) -> int | None:
        if text.strip().lower() == "off":
            return None
        try:
            size = parse_size(text, "--malloc-trim-threshold")
            check_trim_threshold(size)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return size

    parser.add_argument(
        "--malloc-trim-threshold",
        type=parse,
        default=default,
        metavar="SIZE|off",
        help="every variant, once built: free host memory the C library keeps for the next "
        f"steps, e.g. {exact_size(DEFAULT_TRIM_THRESHOLD)} (torchrec_mtrains.malloc); off: "
        f"glibc's own settings (default {exact_size(default) if default else 'off'})",
    )


def apply_malloc_option(trim_threshold: int | None) -> dict[str, int | None]:
    """What a variant does with ``--malloc-trim-threshold`` once built: ``reuse_freed_memory``
    unless ``None``; returns the record of it for the variant's JSON (``trim_threshold``: what
    was set, ``None`` for glibc's own settings or a C library that is not glibc)."""
    set_ = reuse_freed_memory(trim_threshold) if trim_threshold is not None else None
    return {"trim_threshold": set_.trim_threshold if set_ else None}


def drop_file_cache(paths: Iterable[Path]) -> int:
    """Writes back and evicts the page cache of every file under ``paths`` (files or
    directories); returns the number of files. Pages still mapped by a live process stay."""
    count = 0
    for root in paths:
        files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()]
        for path in files:
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                with contextlib.suppress(OSError):
                    os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    return count


def disk_free_bytes(path: Path) -> int:
    """Free bytes on the file system holding ``path`` (or its nearest existing parent)."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _proc_io() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            out[key.strip()] = int(value)
    return out


def rss_bytes() -> int:
    """Current resident set size (VmRSS) of this process."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _vm_hwm_bytes() -> int:
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class ProcessCounters:
    """A snapshot of this process's kernel counters; subtract two for an interval."""

    time_s: float
    cpu_s: float
    read_bytes: int  # storage reads caused by this process (page-cache misses, O_DIRECT)
    write_bytes: int  # storage writes (write-back of dirtied pages, O_DIRECT)
    major_faults: int  # page faults that waited for storage
    minor_faults: int

    @classmethod
    def now(cls) -> ProcessCounters:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        io = _proc_io()
        return cls(
            time_s=time.perf_counter(),
            cpu_s=ru.ru_utime + ru.ru_stime,
            read_bytes=io.get("read_bytes", 0),
            write_bytes=io.get("write_bytes", 0),
            major_faults=ru.ru_majflt,
            minor_faults=ru.ru_minflt,
        )

    def rates_since(self, before: ProcessCounters) -> dict[str, float]:
        """Rates over the interval from ``before`` to this snapshot."""
        dt = max(self.time_s - before.time_s, 1e-9)
        return {
            "seconds": dt,
            "cpu_utilization": (self.cpu_s - before.cpu_s) / dt,
            "read_mb_s": (self.read_bytes - before.read_bytes) / dt / 1e6,
            "write_mb_s": (self.write_bytes - before.write_bytes) / dt / 1e6,
            "major_faults_s": (self.major_faults - before.major_faults) / dt,
            "minor_faults_s": (self.minor_faults - before.minor_faults) / dt,
        }

    @staticmethod
    def peak_rss_bytes() -> int:
        return _vm_hwm_bytes()


def median_windows(window_seconds: list[float], samples_per_window: int) -> dict[str, Any]:
    """Samples/s of each timed window and their median."""
    rates = [samples_per_window / s for s in window_seconds if s > 0]
    return {
        "window_seconds": window_seconds,
        "window_samples_per_s": rates,
        "samples_per_s": statistics.median(rates) if rates else 0.0,
    }


def machine_info() -> dict[str, Any]:
    """What the run ran on: CPU count, memory, kernel, load average at the time of the call."""
    mem_total = 0
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_total = int(line.split()[1]) * 1024
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_bytes": mem_total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
    }


def write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def synchronize(device: torch.device) -> None:
    """Waits for ``device``'s queued work (a CUDA device; nothing to wait for on the CPU), so a
    window timed on the host holds the work it launched."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def thread_cpu_seconds(kernel_only: bool = False) -> dict[str, float]:
    """CPU seconds (user + system) of this process's threads so far, by role: the training
    (main) thread, the tier I/O workers, and the rest (gloo, OpenMP, ...). ``kernel_only``:
    the system part alone (e.g. a tier worker's block I/O in the kernel)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"main": 0.0, "tier_io": 0.0, "other": 0.0}
    workers = {
        t.native_id for t in threading.enumerate() if t.name.startswith(WORKER_THREAD_PREFIX)
    }
    main_id = threading.main_thread().native_id
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        fields = stat[stat.rindex(")") + 2 :].split()
        cpu = (int(fields[12]) + (0 if kernel_only else int(fields[11]))) / tick
        tid = int(task.name)
        role = "main" if tid == main_id else "tier_io" if tid in workers else "other"
        out[role] += cpu
    return out


def target(value: float | None, goal: float, at_most: bool = False) -> dict[str, Any]:
    """A measured ``value`` against its ``goal`` (a floor, or a ceiling ``at_most``): ``met``
    is None when nothing was measured."""
    met = None if value is None else (value <= goal if at_most else value >= goal)
    return {"value": value, "target": goal, "at_most": at_most, "met": met}
