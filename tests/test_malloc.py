"""reuse_freed_memory: a step's host tensors stay mapped from one step to the next."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from torchrec_mtrains.malloc import _glibc, reuse_freed_memory

needs_glibc = pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")

# A "step" allocates and writes 24 tensors of 1-3 MiB and one of 40 MiB (above the largest mmap
# threshold glibc takes), then frees them all, as a training step's activations and gradients
# come and go. Faults are counted over the steps after the first few.
_STEPS = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from torchrec_mtrains.malloc import reuse_freed_memory
    if sys.argv[1] == "reuse":
        reuse_freed_memory()
    def step():
        ts = [torch.ones((256 * (1 + i % 3), 1024)) for i in range(24)]
        ts.append(torch.ones((10 * 1024, 1024)))
        return sum(float(t[0, 0]) for t in ts)
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(json.dumps((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10))
    """
)


def _run(code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=True
    )
    return done.stdout.strip().splitlines()[-1]


@needs_glibc
def test_a_steps_tensors_stop_faulting_in_again() -> None:
    # 88 MiB a step: paged in afresh each step under glibc's own settings (it unmaps or trims
    # what is freed), reused from the heap with reuse_freed_memory.
    default, reused = float(_run(_STEPS, "default")), float(_run(_STEPS, "reuse"))
    assert default > 5_000, default  # the failure the setting exists for, still there
    # (0 in most runs; 1,024 in some, a 4 MiB region paged in again each step)
    assert reused < default / 5, (default, reused)


@needs_glibc
def test_returns_what_it_set() -> None:
    # In a process of its own: the setting is the process's.
    code = "from torchrec_mtrains.malloc import reuse_freed_memory as r; print(r(2**21))"
    assert _run(code) == "MallocSettings(trim_threshold=2097152)"


@pytest.mark.parametrize("bad", [-1, 0, 2**20 - 1, 2**31, True])
def test_refuses_a_trim_threshold_out_of_range(bad: int) -> None:
    with pytest.raises(ValueError, match="malloc trim threshold"):
        reuse_freed_memory(bad)
