"""The numba and torch paths of the cache give the same plans and state, and both follow the
reference victim order (``select_lowest``); the numba path's slot lists stay in that order."""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from torchrec_mtrains.cache import kernels
from torchrec_mtrains.cache.policies import (
    CachePolicy,
    LFUPolicy,
    LRUPolicy,
    RecencyFrequencyPolicy,
    make_policy,
    register_policy,
    select_lowest,
)
from torchrec_mtrains.cache.table_cache import (
    CachePlan,
    CacheTooSmallError,
    TableCache,
    compile_kernels,
)

needs_numba = pytest.mark.skipif(not kernels.NUMBA_AVAILABLE, reason="numba is not installed")
PLAN_FIELDS = ("slots", "load_ids", "load_slots", "evict_ids", "evict_slots", "evict_dirty")


def assert_same_plan(a: CachePlan, b: CachePlan) -> None:
    for name in PLAN_FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype, name
        assert torch.equal(x.cpu(), y.cpu()), (name, x, y)


def assert_same_state(a: TableCache, b: TableCache) -> None:
    for name in ("id_to_slot", "slot_to_id", "dirty", "pinned", "holds", "_reserved"):
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    assert (a._num_reserved, a._num_free, a._step) == (b._num_reserved, b._num_free, b._step)
    assert a.stats == b.stats
    pa, pb = a.policy, b.policy
    assert isinstance(pa, RecencyFrequencyPolicy) and isinstance(pb, RecencyFrequencyPolicy)
    assert torch.equal(pa._last_use.cpu(), pb._last_use.cpu())
    assert torch.equal(pa._count.cpu(), pb._count.cpu())
    assert pa._accesses_since_decay == pb._accesses_since_decay
    assert torch.equal(pa.victim_keys().cpu(), pb.victim_keys().cpu())


def assert_lists_sorted(policy: RecencyFrequencyPolicy) -> None:
    """Every slot sits once in bucket ``count`` (0 for LRU), each bucket in (last_use, slot)
    order: walking them gives exactly the reference victim order."""
    lists = policy.lists
    assert lists is not None
    count = policy._count.numpy()
    order: list[int] = []
    for b in range(lists.head.size):
        s, before = int(lists.head[b]), kernels.NIL
        while s != kernels.NIL:
            assert lists.prev[s] == before
            assert (count[s] if count.size else 0) == b
            order.append(s)
            before, s = s, int(lists.next[s])
        assert lists.tail[b] == before
    assert sorted(order) == list(range(policy.num_slots))
    keys = policy.victim_keys().numpy()
    assert order == sorted(order, key=lambda s: (int(keys[s]), s))


def random_workload(
    seed: int, num_rows: int, num_slots: int, steps: int, batch: int
) -> Iterator[tuple[str, object]]:
    """Operations as the tiered tables issue them (plan, hold, mark dirty, release), plus the
    rarer pins, flushes, lookups and clears, with batches that sometimes do not fit."""
    rng = random.Random(seed)
    for step in range(steps):
        n = rng.randint(1, batch)
        if rng.random() < 0.3:  # a skewed batch: mostly hot rows
            ids = [int(rng.paretovariate(1.1)) % num_rows for _ in range(n)]
        else:
            ids = [rng.randrange(num_rows) for _ in range(n)]
        yield "plan", sorted(set(ids))
        if rng.random() < 0.03:
            yield "pin", rng.randrange(3)
        if rng.random() < 0.05:
            yield "mark_clean", None
        if step in (steps // 2, steps // 2 + 1) and rng.random() < 0.5:
            yield "clear", None


def run_both(policy: str, seed: int, num_rows: int, num_slots: int, steps: int, batch: int) -> int:
    """Runs one workload on both backends, comparing after every operation; returns how many
    plans evicted."""
    a = TableCache("t", num_rows, num_slots, policy, backend="numba")
    b = TableCache("t", num_rows, num_slots, policy, backend="torch")
    if policy == "lfu":  # age often, so halving and bucket merges are exercised
        for c in (a, b):
            c.policy = LFUPolicy(num_slots, use_kernels=c.backend == "numba", decay_interval=7)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    evicting = 0
    for op, arg in random_workload(seed, num_rows, num_slots, steps, batch):
        if op == "plan":
            ids = torch.tensor(arg, dtype=torch.int64)
            errors = []
            for c in (a, b):
                try:
                    c.check_fits(ids)
                    errors.append("")
                except CacheTooSmallError as e:
                    errors.append(str(e))
            assert errors[0] == errors[1]
            if errors[0]:
                with pytest.raises(CacheTooSmallError):
                    a.plan(ids)
                with pytest.raises(CacheTooSmallError):
                    b.plan(ids)
            else:
                pa, pb = a.plan(ids), b.plan(ids)
                assert_same_plan(pa, pb)
                evicting += int(pa.evict_slots.numel() > 0)
                a.hold(pa.slots)
                b.hold(pb.slots)
                half = pa.slots[: pa.slots.numel() // 2]
                a.mark_dirty(half)
                b.mark_dirty(half)
                held.append((pa.slots, pb.slots))
                if len(held) > 2:  # look-ahead 1: two batches in flight
                    sa, sb = held.pop(0)
                    a.release(sa)
                    b.release(sb)
        elif op == "pin":
            resident = torch.nonzero(a.slot_to_id >= 0).flatten()
            if resident.numel():
                pick = resident[torch.randperm(resident.numel())[: int(arg) + 1]]
                a.pin(pick)
                b.pin(pick)
        elif op == "mark_clean":
            a.mark_clean()
            b.mark_clean()
        elif op == "clear":
            a.clear()
            b.clear()
            held.clear()
        assert_same_state(a, b)
        assert isinstance(a.policy, RecencyFrequencyPolicy)
    assert_lists_sorted(a.policy)
    return evicting


@needs_numba
@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize(
    ("seed", "num_rows", "num_slots", "batch"),
    [(0, 200, 40, 12), (1, 5000, 300, 120), (2, 64, 64, 30), (3, 1000, 7, 3)],
)
def test_numba_and_torch_plan_alike(
    policy: str, seed: int, num_rows: int, num_slots: int, batch: int
) -> None:
    assert run_both(policy, seed, num_rows, num_slots, steps=250, batch=batch) > 0 or (
        num_rows <= num_slots
    )


@needs_numba
@pytest.mark.parametrize("cls", [LRUPolicy, LFUPolicy])
def test_policy_api_alike_with_and_without_kernels(cls: type[RecencyFrequencyPolicy]) -> None:
    """The policies' own methods, called in any order (on_insert alone, several calls in one
    step, repeated slots), keep the lists sorted and choose the reference victims."""
    g = torch.Generator().manual_seed(0)
    n = 50
    with_k = cls(n, use_kernels=True, decay_interval=5)
    without = cls(n, use_kernels=False, decay_interval=5)
    for step in range(1, 200):
        for _ in range(int(torch.randint(1, 4, (1,), generator=g))):
            slots = torch.randint(0, n, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g)
            if torch.rand(1, generator=g) < 0.3:
                with_k.on_insert(slots, step)
                without.on_insert(torch.unique(slots), step)
            else:
                with_k.on_access(torch.unique(slots), step)
                without.on_access(torch.unique(slots), step)
        assert torch.equal(with_k.victim_keys(), without.victim_keys())
        assert_lists_sorted(with_k)
        protected = torch.rand(n, generator=g) < 0.4
        k = int(torch.randint(1, int((~protected).sum()) + 1, (1,), generator=g))
        assert torch.equal(
            with_k.choose_victims(k, protected), without.choose_victims(k, protected)
        )


@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
def test_select_lowest_is_stable_sort_order(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 60, (1,), generator=g))
        keys = torch.randint(0, 5, (n,), generator=g).to(dtype)  # many ties
        protected = torch.rand(n, generator=g) < 0.3
        free = int((~protected).sum())
        if free == 0:
            continue
        k = int(torch.randint(1, free + 1, (1,), generator=g))
        masked = keys.masked_fill(protected, torch.inf if dtype.is_floating_point else 10)
        expected = torch.argsort(masked, stable=True)[:k]
        assert torch.equal(select_lowest(keys, k, protected), expected)


@pytest.mark.parametrize("backend", ["numba", "torch"])
def test_refused_batch_and_bad_ids_change_nothing(backend: str) -> None:
    if backend == "numba" and not kernels.NUMBA_AVAILABLE:
        pytest.skip("numba is not installed")
    cache = TableCache("t", 20, 4, backend=backend)
    cache.hold(cache.plan(torch.tensor([0, 1, 2])).slots)
    before = (cache.id_to_slot.clone(), cache.stats.lookups, cache._step)
    with pytest.raises(CacheTooSmallError, match="3 slots are pinned or held"):
        cache.plan(torch.tensor([5, 6]))
    with pytest.raises(IndexError):
        cache.plan(torch.tensor([3, 20]))
    with pytest.raises(IndexError):
        cache.check_fits(torch.tensor([-1]))
    assert torch.equal(cache.id_to_slot, before[0])
    assert (cache.stats.lookups, cache._step) == before[1:]
    with pytest.raises(IndexError):
        cache.hold(torch.tensor([4]))
    assert cache._num_reserved == 3


def test_backend_choice() -> None:
    auto = TableCache("t", 10, 4)
    assert auto.backend == ("numba" if kernels.NUMBA_AVAILABLE else "torch")
    assert TableCache("t", 10, 4, backend="torch").backend == "torch"
    with pytest.raises(ValueError, match="backend must be one of"):
        TableCache("t", 10, 4, backend="cupy")

    class Fifo(CachePolicy):  # a policy of its own: torch path only
        name = "test-fifo"

        def __init__(self, num_slots: int) -> None:
            super().__init__(num_slots)
            self.born = torch.zeros(num_slots, dtype=torch.float64)

        def on_access(self, slots: torch.Tensor, step: int) -> None:
            pass

        def on_insert(self, slots: torch.Tensor, step: int) -> None:
            self.born[slots] = float(step)

        def priority(self) -> torch.Tensor:
            return self.born

    register_policy(Fifo)
    cache = TableCache("t", 10, 2, "test-fifo")
    assert cache.backend == "torch"
    cache.plan(torch.tensor([1, 2]))
    assert cache.plan(torch.tensor([3])).evict_ids.tolist() == [1]  # oldest, then lowest slot
    cache.clear()  # rebuilds the policy by name
    assert isinstance(cache.policy, Fifo)
    if kernels.NUMBA_AVAILABLE:
        with pytest.raises(ValueError, match="numba backend needs"):
            TableCache("t", 10, 2, "test-fifo", backend="numba")
    assert isinstance(make_policy("lru", 3), LRUPolicy)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_cuda_bookkeeping_plans_like_the_cpu(policy: str) -> None:
    """The torch path on CUDA tensors gives the CPU path's plans (numba where it is there)."""
    cpu = TableCache("t", 3000, 200, policy)
    gpu = TableCache("t", 3000, 200, policy, device="cuda")
    assert gpu.backend == "torch" and gpu.id_to_slot.is_cuda
    g = torch.Generator().manual_seed(0)
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    for _ in range(150):
        ids = torch.unique(torch.randint(0, 3000, (60,), generator=g) % 700)
        pc, pg = cpu.plan(ids), gpu.plan(ids.cuda())
        assert_same_plan(pc, pg)
        cpu.hold(pc.slots)
        gpu.hold(pg.slots)
        held.append((pc.slots, pg.slots))
        if len(held) > 2:
            sc, sg = held.pop(0)
            cpu.release(sc)
            gpu.release(sg)
    assert cpu.stats == gpu.stats and cpu.stats.evictions > 0


def test_kernels_sorted_unique_matches_numpy() -> None:
    if not kernels.NUMBA_AVAILABLE:
        pytest.skip("numba is not installed")
    a = np.array([5, 1, 5, 3, 1, 9], dtype=np.int64)
    assert kernels._sorted_unique(a).tolist() == [1, 3, 5, 9]


@pytest.mark.skipif(not kernels.NUMBA_AVAILABLE, reason="needs numba")
def test_compiling_the_kernels_first_leaves_nothing_to_compile_in_training() -> None:
    """The first training batches would otherwise wait for numba (counted as tier stall)."""
    compile_kernels()
    dispatchers = [f for f in vars(kernels).values() if hasattr(f, "signatures")]
    before = [len(f.signatures) for f in dispatchers]
    for policy in ("lru", "lfu"):
        cache = TableCache("t", num_rows=1000, num_slots=64, policy=policy, backend="numba")
        rng = np.random.default_rng(1)
        for _ in range(300):  # past LFU's decay interval
            ids = torch.from_numpy(np.unique(rng.zipf(1.2, 40) % 1000)).to(torch.int64)
            cache.check_fits(ids)
            plan = cache.plan(ids)
            cache.hold(plan.slots)
            cache.mark_dirty(plan.slots)
            cache.release(plan.slots)
        cache.dirty_rows()
    assert [len(f.signatures) for f in dispatchers] == before
    assert compile_kernels() == 0.0  # once a process
