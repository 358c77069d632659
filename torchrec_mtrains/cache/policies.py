"""Eviction policies for the row cache, registered by name.

A policy only ranks cache slots; :class:`~torchrec_mtrains.cache.table_cache.TableCache` owns the
id <-> slot maps and decides which slots are protected (rows of the batch being loaded, rows of
batches in flight, the pinned hot set). Policies work on whole tensors of slots so that one
batch costs a handful of vectorized operations, not a Python loop over ids.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import ClassVar

import torch


class CachePolicy(ABC):
    """Ranks slots for eviction: lower priority is evicted first.

    Args:
        num_slots: cache capacity in rows.
    """

    name: ClassVar[str]

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots

    @abstractmethod
    def on_access(self, slots: torch.Tensor, step: int) -> None:
        """Records that ``slots`` (unique) were used by the batch numbered ``step``."""

    @abstractmethod
    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        """Resets the history of ``slots``, which now hold newly loaded rows."""

    @abstractmethod
    def priority(self) -> torch.Tensor:
        """Returns a float64 priority per slot; the lowest are evicted first."""

    def choose_victims(self, count: int, protected: torch.Tensor) -> torch.Tensor:
        """Returns ``count`` slot indices to evict, never one whose ``protected`` flag is set.

        The caller guarantees enough unprotected slots exist."""
        if count <= 0:
            return torch.empty(0, dtype=torch.int64)
        prio = self.priority().masked_fill(protected, float("inf"))
        if count * 8 < self.num_slots:
            return torch.topk(prio, count, largest=False, sorted=False).indices
        return torch.argsort(prio, stable=True)[:count]


class LRUPolicy(CachePolicy):
    """Least recently used: evicts the slots whose last access is oldest."""

    name = "lru"

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self._last_use = torch.full((num_slots,), -1, dtype=torch.int64)

    def on_access(self, slots: torch.Tensor, step: int) -> None:
        self._last_use[slots] = step

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        self._last_use[slots] = step

    def priority(self) -> torch.Tensor:
        return self._last_use.to(torch.float64)


class LFUPolicy(CachePolicy):
    """Least frequently used, ties broken by recency.

    Counts are halved every ``decay_interval`` accesses of the cache so that rows that were hot
    long ago do not stay forever (a standard aging scheme for LFU caches)."""

    name = "lfu"

    def __init__(self, num_slots: int, decay_interval: int = 1_000) -> None:
        super().__init__(num_slots)
        self._count = torch.zeros(num_slots, dtype=torch.int64)
        self._last_use = torch.full((num_slots,), -1, dtype=torch.int64)
        self._decay_interval = decay_interval
        self._accesses_since_decay = 0

    def on_access(self, slots: torch.Tensor, step: int) -> None:
        self._count[slots] += 1
        self._last_use[slots] = step
        self._accesses_since_decay += 1
        if self._accesses_since_decay >= self._decay_interval:
            self._count //= 2
            self._accesses_since_decay = 0

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        self._count[slots] = 0
        self._last_use[slots] = step

    def priority(self) -> torch.Tensor:
        # Frequency dominates; recency (bounded below 1) only breaks ties.
        recency = (self._last_use + 1).to(torch.float64) / (float(self._last_use.max()) + 2.0)
        return self._count.to(torch.float64) + recency


_POLICIES: dict[str, type[CachePolicy]] = {}
POLICIES: Mapping[str, type[CachePolicy]] = MappingProxyType(_POLICIES)
"""Read-only view of the registered cache policies, by name."""


def register_policy(cls: type[CachePolicy], *, clobber: bool = False) -> type[CachePolicy]:
    """Registers a policy class under ``cls.name``; raises on a duplicate unless ``clobber``."""
    if cls.name in _POLICIES and _POLICIES[cls.name] is not cls and not clobber:
        raise ValueError(f"cache policy {cls.name!r} is already registered")
    _POLICIES[cls.name] = cls
    return cls


def make_policy(name: str, num_slots: int) -> CachePolicy:
    """Builds the policy registered as ``name``; raises ``ValueError`` listing valid names."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown cache policy {name!r}; expected one of: {', '.join(sorted(POLICIES))}"
        ) from None
    return cls(num_slots)


register_policy(LRUPolicy)
register_policy(LFUPolicy)
