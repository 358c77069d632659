"""Helpers shared by the workload benchmarks (``w1_bench.py``, ``w2_bench.py``).

* :class:`MemoryCgroup` caps a subprocess's memory (page cache included) with a cgroup, so the
  page cache cannot hide a storage tier: cgroup v1's ``memory.limit_in_bytes`` or v2's
  ``memory.max``. :func:`cgroup_support` says whether this machine allows it, and why not.
* :func:`drop_file_cache` evicts files from the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``)
  so one run cannot warm the next.
* :class:`ProcessCounters` reads what the kernel counts for this process: bytes read and written
  by storage I/O (``/proc/self/io``), major page faults, CPU time, peak RSS.
* :func:`run_fio` is ``tier_bench.py``'s fio helper: random 4 KiB reads at queue depth 32.
* :func:`median_windows` turns timed windows into samples/s.

Nothing here is imported by the library; benchmark scripts import it as a sibling module.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE) not in sys.path:  # tier_bench is a sibling script, not a package module
    sys.path.insert(0, str(_HERE))

from tier_bench import run_fio  # noqa: E402

__all__ = [
    "CgroupSupport",
    "MemoryCgroup",
    "ProcessCounters",
    "cgroup_support",
    "disk_free_bytes",
    "drop_file_cache",
    "machine_info",
    "median_windows",
    "rss_bytes",
    "run_fio",
    "write_json",
]

V1_ROOT = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class CgroupSupport:
    """Whether a memory cgroup can be made here: ``version`` 1 or 2 and the parent directory,
    or ``version`` 0 and ``reason`` saying why not."""

    version: int
    parent: Path | None
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.version in (1, 2)


def _cgroup2_mount() -> Path | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[2] == "cgroup2":
                return Path(parts[1])
    return None


def cgroup_support() -> CgroupSupport:
    """Finds a memory controller this process may create child cgroups under."""
    if sys.platform != "linux":
        return CgroupSupport(0, None, f"memory cgroups need Linux, this is {sys.platform}")
    if os.geteuid() != 0:
        return CgroupSupport(0, None, "creating a memory cgroup needs root (run as root)")
    if (V1_ROOT / "memory.limit_in_bytes").exists():
        if os.access(V1_ROOT, os.W_OK):
            return CgroupSupport(1, V1_ROOT)
        return CgroupSupport(0, None, f"{V1_ROOT} is not writable")
    mount = _cgroup2_mount()
    if mount is None:
        return CgroupSupport(0, None, "no cgroup v1 memory controller and no cgroup2 mount")
    controllers = (mount / "cgroup.controllers").read_text().split()
    if "memory" not in controllers:
        return CgroupSupport(0, None, f"the memory controller is not available in {mount}")
    subtree = mount / "cgroup.subtree_control"
    if "memory" not in subtree.read_text().split():
        try:
            subtree.write_text("+memory")
        except OSError as e:
            return CgroupSupport(0, None, f"cannot enable +memory in {subtree}: {e.strerror}")
    return CgroupSupport(2, mount)


class MemoryCgroup:
    """A memory cgroup for one benchmark subprocess; a context manager that removes it.

    Args:
        support: from :func:`cgroup_support` (must be ``ok``).
        name: directory name (made unique with this process's id).
        limit_bytes: the cap (RSS + page cache + kernel memory charged to the group), or
            ``None`` for no cap (to measure a process's peak usage).

    Example::

        with MemoryCgroup(cgroup_support(), "w1_ours", 2 << 30) as cg:
            subprocess.run(cmd, preexec_fn=cg.join_self, check=True)
            print(cg.peak_bytes())
    """

    def __init__(self, support: CgroupSupport, name: str, limit_bytes: int | None) -> None:
        if not support.ok or support.parent is None:
            raise RuntimeError(f"memory cgroups unavailable: {support.reason}")
        self.version = support.version
        self.path = support.parent / f"mtrains_bench_{os.getpid()}_{name}"
        self.limit_bytes = limit_bytes
        self.path.mkdir()
        try:
            if limit_bytes is not None:
                key = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
                (self.path / key).write_text(str(int(limit_bytes)))
            if self.version == 1:
                # The OOM killer, not a hang, when a capped process cannot fit.
                with contextlib.suppress(OSError):
                    (self.path / "memory.oom_control").write_text("0")
                with contextlib.suppress(OSError):
                    (self.path / "memory.swappiness").write_text("0")
        except OSError:
            self.remove()
            raise

    def __enter__(self) -> MemoryCgroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def join_self(self) -> None:
        """Moves the calling process into the cgroup (use as ``preexec_fn``)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak_bytes(self) -> int | None:
        """Highest usage seen (v1 ``max_usage_in_bytes``, v2 ``memory.peak`` when present)."""
        key = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        with contextlib.suppress(OSError, ValueError):
            return int((self.path / key).read_text())
        return None

    def stat(self) -> dict[str, int]:
        """``memory.stat`` as a dict (v1: ``cache``, ``rss``, ``mapped_file``, ...)."""
        out: dict[str, int] = {}
        with contextlib.suppress(OSError):
            for line in (self.path / "memory.stat").read_text().splitlines():
                key, _, value = line.partition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = int(value)
        return out

    def oom_kills(self) -> int:
        """OOM kills in this cgroup (v1 ``memory.oom_control``, v2 ``memory.events``)."""
        name = "memory.oom_control" if self.version == 1 else "memory.events"
        with contextlib.suppress(OSError):
            for line in (self.path / name).read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Removes the cgroup; waits briefly for exited members to leave it."""
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)


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


@contextlib.contextmanager
def timer(into: dict[str, float], key: str) -> Iterator[None]:
    """Adds the block's wall time to ``into[key]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[key] = into.get(key, 0.0) + time.perf_counter() - t0


def wrap_timed(fn: Callable[..., Any], into: dict[str, float], key: str) -> Callable[..., Any]:
    """``fn`` with its wall time added to ``into[key]`` on every call."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[key] = into.get(key, 0.0) + time.perf_counter() - t0

    return wrapped
