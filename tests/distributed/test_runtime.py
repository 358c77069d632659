"""Choosing the compute device and the process-group backend once per rank."""

from __future__ import annotations

import pytest
import torch

from torchrec_mtrains.distributed.runtime import backend_for, resolve_device


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


def test_unknown_device_and_backends() -> None:
    with pytest.raises(ValueError, match="device='gpu': expected one of auto, cpu, cuda"):
        resolve_device("gpu")
    assert backend_for(torch.device("cuda", 0)) == "nccl"
    assert backend_for(torch.device("cpu")) == "gloo"
