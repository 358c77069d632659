"""Eviction policies for the row cache, registered by name.

A policy only ranks cache slots; :class:`~torchrec_mtrains.cache.table_cache.TableCache` owns the
id <-> slot maps and decides which slots are protected (rows of the batch being loaded, rows of
batches in flight, the pinned hot set).

Victim order is fully determined, so that a run's plans are reproducible: the victims are the
unprotected slots with the lowest ``(victim_keys()[slot], slot)``, in that order
(:func:`select_lowest`, the reference). LRU's key is the step of last use; LFU's is the access
count, then the step of last use.

The built-in policies run on any device with torch ops. On the CPU, with numba, they also keep
their slots in lists sorted in victim order and update them with compiled kernels
(:mod:`~torchrec_mtrains.cache.kernels`) that release the GIL; a victim choice then costs the
victims, not the cache size. Both paths give the same victims and state; the tests compare them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar

import numpy as np
import torch

from torchrec_mtrains.cache import kernels

if TYPE_CHECKING:
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm


def select_lowest(keys: torch.Tensor, count: int, protected: torch.Tensor) -> torch.Tensor:
    """The ``count`` indices whose ``protected`` flag is clear with the lowest ``(keys, index)``,
    in that order: the victim order every policy and backend follows. Costs a few linear
    passes over ``keys`` on its device (no host sync beyond ``count``)."""
    if count <= 0:
        return torch.empty(0, dtype=torch.int64, device=keys.device)
    top = torch.inf if keys.is_floating_point() else torch.iinfo(keys.dtype).max
    keys = keys.masked_fill(protected, top)
    kth = torch.kthvalue(keys, count).values
    below = torch.nonzero(keys < kth).flatten()
    tied = torch.nonzero(keys == kth).flatten()[: count - int(below.numel())]
    chosen = torch.cat([below, tied])  # ascending index within each part
    return chosen[torch.sort(keys[chosen], stable=True).indices]


class CachePolicy(ABC):
    """Ranks slots for eviction: lower keys are evicted first, ties by slot index.

    Args:
        num_slots: cache capacity in rows.
        device: where the policy's per-slot state lives (the cache's bookkeeping device).
    """

    name: ClassVar[str]
    fbgemm_algorithm: ClassVar[str | None] = None
    """The member of fbgemm's ``CacheAlgorithm`` that evicts as this policy does, for tables on
    TorchRec's FUSED_UVM_CACHING kernel (fbgemm's own cache); None where fbgemm has none (a
    subclass that evicts otherwise than its parent sets it again)."""

    def __init__(self, num_slots: int, device: torch.device | str | None = None) -> None:
        self.num_slots = num_slots
        self.device = torch.device("cpu" if device is None else device)

    @abstractmethod
    def on_access(self, slots: torch.Tensor, step: int) -> None:
        """Records that ``slots`` (unique) were used by the batch numbered ``step``."""

    @abstractmethod
    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        """Resets the history of ``slots``, which now hold newly loaded rows."""

    @abstractmethod
    def priority(self) -> torch.Tensor:
        """Returns a float64 priority per slot; the lowest are evicted first."""

    def victim_keys(self) -> torch.Tensor:
        """Per-slot sort keys of the victim order (lowest first, ties by slot). Defaults to
        :meth:`priority`; exact integer keys avoid float ties."""
        return self.priority()

    def choose_victims(self, count: int, protected: torch.Tensor) -> torch.Tensor:
        """Returns ``count`` slot indices to evict, never one whose ``protected`` flag is set, in
        eviction order. The caller guarantees enough unprotected slots exist."""
        return select_lowest(self.victim_keys(), count, protected)


@dataclass
class SlotLists:
    """Per-bucket doubly linked slot lists in victim order, and numpy views of the policy's
    ``last_use`` and ``count`` (made once: the per-call glue holds the GIL), for the compiled
    kernels."""

    prev: np.ndarray
    next: np.ndarray
    head: np.ndarray
    tail: np.ndarray
    last_use: np.ndarray
    count: np.ndarray


class RecencyFrequencyPolicy(CachePolicy):
    """Shared state of LRU and LFU: each slot's step of last use and, when ``counting``, its
    access count; victim order ``(count, last_use, slot)``.

    Args:
        num_slots: cache capacity in rows.
        device: where the state lives.
        use_kernels: keep slot lists and update them with the compiled kernels (CPU only);
            ``None`` uses them whenever possible.
        decay_interval: (counting policies) accesses between two halvings of the counts.
    """

    counting: ClassVar[bool] = False
    # count < 2**22 and last_use + 1 < 2**41: the (count, last_use) key packs into an int64.
    _LAST_USE_BITS: ClassVar[int] = 41

    def __init__(
        self,
        num_slots: int,
        device: torch.device | str | None = None,
        *,
        use_kernels: bool | None = None,
        decay_interval: int = 1_000,
    ) -> None:
        super().__init__(num_slots, device)
        if self.counting and not 1 <= decay_interval < 2**21:
            raise ValueError(f"decay_interval must be in [1, 2**21), got {decay_interval}")
        if num_slots >= 2**31:
            raise ValueError(f"a cache of {num_slots} slots is too large (at most 2**31 - 1)")
        self._last_use = torch.full((num_slots,), -1, dtype=torch.int64, device=self.device)
        # (LRU: empty, which tells the kernels not to count)
        self._count = torch.zeros(
            num_slots if self.counting else 0, dtype=torch.int64, device=self.device
        )
        self._decay_interval = decay_interval if self.counting else 0
        self._accesses_since_decay = 0
        possible = kernels_possible(self.device)
        if use_kernels and not possible:
            raise ValueError(
                f"cache policy {self.name!r}: compiled kernels need numba and CPU bookkeeping "
                f"(device {self.device})"
            )
        self.lists: SlotLists | None = None
        if possible if use_kernels is None else use_kernels:
            # Counts stay below 2 * decay_interval: one bucket per possible count.
            buckets = 2 * self._decay_interval + 1 if self.counting else 1
            last_use, count = self._last_use.numpy(), self._count.numpy()
            self.lists = SlotLists(*kernels.build_lists(last_use, count, buckets), last_use, count)

    @property
    def uses_kernels(self) -> bool:
        return self.lists is not None

    def on_access(self, slots: torch.Tensor, step: int) -> None:
        if self.lists is not None:
            self._touch(slots, step, insert=False)
            return
        if self.counting:
            self._count[slots] += 1
        self._last_use[slots] = step
        if self.counting:
            self._accesses_since_decay += 1
            if self._accesses_since_decay >= self._decay_interval:
                self._count //= 2
                self._accesses_since_decay = 0

    def on_insert(self, slots: torch.Tensor, step: int) -> None:
        if self.lists is not None:
            self._touch(slots, step, insert=True)
            return
        if self.counting:
            self._count[slots] = 0
        self._last_use[slots] = step

    def _touch(self, slots: torch.Tensor, step: int, insert: bool) -> None:
        assert self.lists is not None
        status, self._accesses_since_decay = kernels.touch(
            (slots if slots.dtype == torch.int64 else slots.to(torch.int64)).contiguous().numpy(),
            step,
            insert,
            self.lists.last_use,
            self.lists.count,
            self.lists.prev,
            self.lists.next,
            self.lists.head,
            self.lists.tail,
            self._accesses_since_decay,
            self._decay_interval,
        )
        if status != kernels.OK:
            raise IndexError(f"cache policy {self.name!r}: slot out of range [0, {self.num_slots})")

    def victim_keys(self) -> torch.Tensor:
        if not self.counting:
            return self._last_use
        return (self._count << self._LAST_USE_BITS) | (self._last_use + 1)

    def choose_victims(self, count: int, protected: torch.Tensor) -> torch.Tensor:
        if self.lists is None or count <= 0:
            return super().choose_victims(count, protected)
        out = np.empty(count, np.int64)
        flags = protected.contiguous().numpy()
        found = kernels.walk_victims(count, flags, flags, self.lists.next, self.lists.head, out)
        if found < count:
            raise ValueError(f"only {found} unprotected slots, {count} victims asked for")
        return torch.from_numpy(out)


class LRUPolicy(RecencyFrequencyPolicy):
    """Least recently used: evicts the slots whose last access is oldest."""

    name = "lru"
    fbgemm_algorithm = "LRU"

    def priority(self) -> torch.Tensor:
        return self._last_use.to(torch.float64)


class LFUPolicy(RecencyFrequencyPolicy):
    """Least frequently used, ties broken by recency.

    Counts are halved every ``decay_interval`` accesses of the cache so that rows that were hot
    long ago do not stay forever (a standard aging scheme for LFU caches); this also bounds a
    count below ``2 * decay_interval``."""

    name = "lfu"
    fbgemm_algorithm = "LFU"
    counting = True

    def priority(self) -> torch.Tensor:
        # Frequency dominates; recency (bounded below 1) only breaks ties.
        recency = (self._last_use + 1).to(torch.float64) / (float(self._last_use.max()) + 2.0)
        return self._count.to(torch.float64) + recency


def kernels_possible(device: torch.device | str | None) -> bool:
    """Whether the compiled kernels can run on bookkeeping tensors on ``device``."""
    return kernels.NUMBA_AVAILABLE and torch.device("cpu" if device is None else device).type == (
        "cpu"
    )


_POLICIES: dict[str, type[CachePolicy]] = {}
POLICIES: Mapping[str, type[CachePolicy]] = MappingProxyType(_POLICIES)
"""Read-only view of the registered cache policies, by name."""


def register_policy(cls: type[CachePolicy], *, clobber: bool = False) -> type[CachePolicy]:
    """Registers a policy class under ``cls.name``; raises on a duplicate unless ``clobber``."""
    if cls.name in _POLICIES and _POLICIES[cls.name] is not cls and not clobber:
        raise ValueError(f"cache policy {cls.name!r} is already registered")
    _POLICIES[cls.name] = cls
    return cls


def registered_policy(name: str, what: str = "cache policy") -> type[CachePolicy]:
    """The policy class registered as ``name``: the one check of a policy name, wherever a
    config or a plan names one.

    Raises:
        ValueError: naming ``what`` and the registered names.
    """
    if not isinstance(name, str) or name not in POLICIES:
        raise ValueError(f"unknown {what} {name!r}; expected one of: {', '.join(sorted(POLICIES))}")
    return POLICIES[name]


def fbgemm_cache_algorithm(name: str) -> CacheAlgorithm:
    """fbgemm's cache algorithm for the policy registered as ``name``, for a table on TorchRec's
    FUSED_UVM_CACHING kernel, whose cache is fbgemm's and knows only LRU and LFU.

    Raises:
        ValueError: for an unknown name, or a policy fbgemm's cache cannot run (naming the
            policies it can), rather than letting fbgemm's default (LRU) stand in for it.
    """
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

    algorithm = registered_policy(name).fbgemm_algorithm
    if algorithm is None:
        runs = sorted(n for n, cls in POLICIES.items() if cls.fbgemm_algorithm is not None)
        raise ValueError(
            f"cache policy {name!r} has no counterpart in fbgemm's cache, which TorchRec's "
            f"FUSED_UVM_CACHING kernel uses; it runs {', '.join(runs)} only"
        )
    return CacheAlgorithm[algorithm]


def make_policy(
    name: str,
    num_slots: int,
    *,
    device: torch.device | str | None = None,
    use_kernels: bool | None = None,
) -> CachePolicy:
    """Builds the policy registered as ``name``; raises ``ValueError`` listing valid names.

    A policy class of its own gets ``device`` only when it is not the CPU, so one whose
    constructor takes just ``num_slots`` still works there."""
    cls = registered_policy(name)
    if issubclass(cls, RecencyFrequencyPolicy):
        return cls(num_slots, device, use_kernels=use_kernels)
    if device is not None and torch.device(device).type != "cpu":
        return cls(num_slots, device)
    return cls(num_slots)


register_policy(LRUPolicy)
register_policy(LFUPolicy)

DEFAULT_POLICY: str = LFUPolicy.name
"""The policy of a table's cache, and of a planner's tables, where none is named. LFU: on W1's
Zipf ids it keeps more of the rows the batches come back to than LRU (hit rate 0.643 against
0.579 at the 5% DRAM budget, 0.787 against 0.781 at 15%; Belady's optimum 0.788 and 0.814),
so fewer block reads a step (8,726 against 10,061 at 5%); docs/benchmarks.md."""
