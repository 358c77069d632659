"""The compute device and the process group of a training process, chosen once.

A job runs one rank per GPU on CUDA hosts (NCCL) and one or more ranks per host on CPU (gloo).
Under ``torchrun`` (and so ``torchx run``) every rank finds its rank, world size and local rank
in the environment; a process started alone forms a one-rank group on a free loopback port.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger: logging.Logger = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def local_rank() -> int:
    """This process's rank on its host (``LOCAL_RANK`` under torchrun; 0 alone)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """Ranks on this host (``LOCAL_WORLD_SIZE`` under torchrun; 1 alone)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def resolve_device(choice: str = "auto") -> torch.device:
    """The device this rank computes on.

    Args:
        choice: ``auto`` (CUDA when a GPU is visible, else the CPU), ``cpu`` or ``cuda``. On
            CUDA each local rank gets its own GPU, ``cuda:<LOCAL_RANK>``.

    Raises:
        ValueError: for another choice, for ``cuda`` without a visible GPU, or when this
            host runs more ranks than it has GPUs.
    """
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device={choice!r}: expected one of {', '.join(DEVICE_CHOICES)}")
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            "device=cuda but no GPU is visible to this process (torch.cuda.is_available() is "
            "False); use device=cpu or device=auto"
        )
    rank, gpus = local_rank(), torch.cuda.device_count()
    if rank >= gpus:
        raise ValueError(
            f"local rank {rank} has no GPU of its own: this host has {gpus} GPU(s) and runs "
            f"{local_world_size()} rank(s); start at most one rank per GPU"
        )
    return torch.device("cuda", rank)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA ranks, gloo for CPU ranks."""
    return "nccl" if device.type == "cuda" else "gloo"


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class ProcessGroupInfo:
    """Where this process stands in the job.

    Attributes:
        rank / world_size: in the default process group.
        device: the compute device (see :func:`resolve_device`).
        created: whether :func:`init_process_group` formed the group (and so should end it).
    """

    rank: int
    world_size: int
    device: torch.device
    created: bool


def init_process_group(
    device: torch.device,
    timeout: timedelta | None = None,
    *,
    backend: str | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    port: int | None = None,
) -> ProcessGroupInfo:
    """Joins the job's default process group with the backend for ``device``, or forms a
    one-rank group when the process was started alone; reuses a group that already exists.

    Args:
        device: this rank's compute device; on CUDA it becomes the current device first, as
            NCCL's collectives need.
        timeout: how long a collective may wait for the other ranks (torch's default if None).
        backend: the group's backend, default :func:`backend_for` ``device``
            (``cpu:gloo,cuda:nccl`` gives one group that reduces tensors of both kinds).
        rank / world_size / port: join ``world_size`` processes meeting on loopback ``port``
            (ranks a test or benchmark spawned itself); by default the torchrun environment
            says where to meet, and a process started alone forms a group of one.

    Raises:
        ValueError: when only some of ``rank``, ``world_size`` and ``port`` are given.
    """
    explicit = (rank, world_size, port)
    if any(v is not None for v in explicit) and any(v is None for v in explicit):
        raise ValueError(
            f"rank={rank}, world_size={world_size}, port={port}: give all three to meet on "
            "loopback, or none to use the torchrun environment"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), device, False)
    backend = backend or backend_for(device)
    if rank is not None and world_size is not None:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    elif "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    logger.debug(
        "rank %d of %d on %s (%s)", dist.get_rank(), dist.get_world_size(), device, backend
    )
    return ProcessGroupInfo(dist.get_rank(), dist.get_world_size(), device, True)


@contextlib.contextmanager
def process_group(
    device: torch.device | None = None, timeout: timedelta | None = None, **where: Any
) -> Iterator[ProcessGroupInfo]:
    """:func:`init_process_group` (``device`` default: the CPU) for the ``with`` block; the
    group is destroyed at its end if this call formed it.

    Example::

        with process_group() as group:  # DistributedModelParallel needs a group, even of one
            model = DistributedModelParallel(module, device=group.device)
    """
    info = init_process_group(device or torch.device("cpu"), timeout, **where)
    try:
        yield info
    finally:
        if info.created and dist.is_initialized():
            dist.destroy_process_group()
