"""Choosing the compute device and the process-group backend once per rank; ending the group."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchrec_mtrains.distributed.runtime import (
    backend_for,
    free_port,
    process_group,
    resolve_device,
    with_index,
)


def test_auto_picks_cuda_only_when_a_gpu_is_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="device=cuda but no GPU is visible"):
        resolve_device("cuda")


def test_each_local_rank_gets_its_own_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="local rank 2 has no GPU of its own: this host has 2"):
        resolve_device("cuda")


def test_a_bare_cuda_device_is_the_current_one(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.cuda.set_device refuses torch.device("cuda"): the runtime indexes it first.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert with_index(torch.device("cuda")) == torch.device("cuda", 3)
    assert with_index(torch.device("cuda", 1)) == torch.device("cuda", 1)
    assert with_index(torch.device("cpu")) == torch.device("cpu")


@pytest.mark.cuda
def test_a_bare_cuda_device_forms_a_group_and_a_copy_stream() -> None:
    import threading

    from torchrec_mtrains.distributed.copy_streams import RowCopyStreams

    if dist.is_initialized():
        pytest.skip("a process group is already formed in this process")
    with process_group(torch.device("cuda")) as group:
        assert group.device == torch.device("cuda", torch.cuda.current_device())
    streams = RowCopyStreams(torch.device("cuda"))
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            streams.enter_worker()
        except BaseException as e:  # reported on the test's thread
            errors.append(e)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors


def test_unknown_device_and_backends() -> None:
    with pytest.raises(ValueError, match="device='gpu': expected one of auto, cpu, cuda"):
        resolve_device("gpu")
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"


def _tie(group: Any) -> None:
    """Leaves ``group`` referenced only from an unreachable reference cycle, as TorchRec's
    sharded modules, optimizers and ShardedTensors leave the default group."""
    cycle: dict[str, Any] = {"group": group}
    cycle["self"] = cycle


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists threads through /proc")
def test_leaving_the_group_ends_its_backend_though_a_cycle_holds_it() -> None:
    before = _threads()
    with process_group():
        group = dist.distributed_c10d._get_default_group()
        alive = weakref.ref(group)
        started = _threads() - before  # gloo's worker and I/O threads, the store's server
        _tie(group)
        del group
        dist.all_reduce(torch.ones(8))
    assert started
    assert alive() is None
    # The backend's threads are told to end when the group goes; they may take a moment to
    # exit (a backend kept alive by the cycle would keep them until the interpreter ends).
    deadline = time.monotonic() + 10.0
    while started & _threads() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not started & _threads()


# Rank 1 joins rank 0's last all_reduces late, so they complete on gloo's worker threads after
# rank 0 dropped their tensors, while rank 0's main thread keeps the GIL (sys.setswitchinterval
# stands in for workers starved of CPU): each worker, dropping a tensor's last reference, waits
# for the GIL. Were the group still alive when the interpreter finalizes, its destructor would let
# a waiting worker take the GIL then, and CPython ends it with pthread_exit inside a noexcept
# destructor: "terminate called without an active exception", SIGABRT. The collector runs only
# when called (and at exit), never by chance in between.
_RANK = """
import gc, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from torchrec_mtrains.distributed.runtime import end_process_group, init_process_group

gc.set_threshold(10**9)
rank, port = int(sys.argv[1]), int(sys.argv[2])
init_process_group(torch.device("cpu"), timedelta(seconds=60), rank=rank, world_size=2, port=port)
cycle = {"group": dist.distributed_c10d._get_default_group()}
cycle["self"] = cycle
del cycle
dist.barrier()
if rank == 0:
    sys.setswitchinterval(100.0)
    for _ in range(32):
        dist.all_reduce(torch.ones(1000), async_op=True)
else:
    time.sleep(0.5)
    for _ in range(32):
        dist.all_reduce(torch.ones(1000))
%s
end = time.monotonic() + 2.5
while time.monotonic() < end:
    pass
"""


@pytest.mark.slow
@pytest.mark.parametrize("teardown", ["end_process_group()", "dist.destroy_process_group()"])
def test_ranks_exit_cleanly_while_gloo_still_releases_the_last_collectives(teardown: str) -> None:
    """With :func:`end_process_group`, or torch's own teardown (the collection at exit)."""
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK % teardown, str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    ended = [rank.communicate(timeout=120) for rank in ranks]
    for rank, (out, err) in zip(ranks, ended, strict=True):
        assert rank.returncode == 0, out + err
        assert "terminate called" not in err
