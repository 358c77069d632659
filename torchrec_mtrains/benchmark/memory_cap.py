"""Memory caps for benchmark subprocesses: a cgroup per run, so the page cache cannot hide a
storage tier, and a runner that reports what the run used.

* :func:`cgroup_support` says whether this machine lets a process make memory cgroups, and why
  not (cgroup v1's ``memory.limit_in_bytes`` or v2's ``memory.max``; both need root).
* :class:`MemoryCgroup` is one such cgroup, capped or not (uncapped: to measure a peak).
* :func:`run_capped` runs a command in one and returns its exit code, wall time and peaks
  (``wait4``'s RSS, the cgroup's usage, the anonymous memory sampled while it ran).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["AnonPeak", "CgroupSupport", "MemoryCgroup", "cgroup_support", "run_capped"]

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


class AnonPeak:
    """Samples, every ``interval`` seconds, the anonymous memory (heap, tensors) of the app: the
    cgroup's ``rss`` (v1) / ``anon`` (v2) when it runs in one, else the process's ``RssAnon``.

    The process's own peak RSS counts the tier files' pages it maps while checkpointing: page
    cache the kernel reclaims at the cap (and shared libraries charged elsewhere), so it can
    exceed a cap the cgroup enforces. The anonymous peak is what the process itself needs."""

    def __init__(self, cgroup: MemoryCgroup | None, interval: float = 0.1) -> None:
        self.cgroup, self.interval, self.pid = cgroup, interval, 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def read(self) -> int:
        if self.cgroup is not None:
            stat = self.cgroup.stat()
            return int(stat.get("rss", stat.get("anon", 0)))
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = Path(f"/proc/{self.pid}/status").read_text()
            return int(text.split("RssAnon:")[1].split()[0]) * 1024
        return 0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self.read())

    def start(self, pid: int) -> None:
        self.pid = pid
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        return self.peak


def run_capped(
    cmd: list[str],
    support: CgroupSupport,
    name: str,
    cap: int | None,
    *,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> dict[str, Any]:
    """Runs ``cmd`` to its end in a memory cgroup named ``name``, capped at ``cap`` bytes
    (``None``: uncapped, to measure its peak), or outside any cgroup when ``support`` is not
    ok. Its output goes to ``log`` (stdout and stderr), else to this process's.

    Returns:
        ``returncode``, ``wall_s``, ``peak_rss_bytes`` and ``major_faults`` (``wait4``),
        ``peak_anon_bytes`` (:class:`AnonPeak`), and in a cgroup ``cgroup_peak_bytes``,
        ``cgroup_stat_at_exit`` (``cache``, ``rss``, ``mapped_file``) and ``oom_kills``.
    """
    out: dict[str, Any] = {"cap_bytes": cap}
    cg = MemoryCgroup(support, name, cap) if support.ok else None
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            sink = stack.enter_context(open(log, "w")) if log is not None else None
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                stdout=sink,
                stderr=subprocess.STDOUT if sink is not None else None,
                preexec_fn=cg.join_self if cg is not None else None,
                env=env,
            )
            anon = AnonPeak(cg)
            anon.start(proc.pid)
            try:
                _, status, usage = os.wait4(proc.pid, 0)
            except BaseException:
                proc.kill()
                proc.wait()
                raise
            finally:
                out["peak_anon_bytes"] = anon.stop()
            proc.returncode = os.waitstatus_to_exitcode(status)
        out["returncode"] = proc.returncode
        out["wall_s"] = time.perf_counter() - t0
        out["peak_rss_bytes"] = usage.ru_maxrss * 1024
        out["major_faults"] = usage.ru_majflt
        if cg is not None:
            out["cgroup_peak_bytes"] = cg.peak_bytes()
            out["cgroup_stat_at_exit"] = {
                k: v for k, v in cg.stat().items() if k in ("cache", "rss", "mapped_file")
            }
            out["oom_kills"] = cg.oom_kills()
    finally:
        if cg is not None:
            cg.remove()
    return out
