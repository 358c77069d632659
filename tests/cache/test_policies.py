"""The policy registry as configs and plans use it: one check of a policy name, one default, and
the policies fbgemm's cache (TorchRec's FUSED_UVM_CACHING) can stand for."""

from __future__ import annotations

import pytest
from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm

from torchrec_mtrains.cache.policies import (
    DEFAULT_POLICY,
    POLICIES,
    LFUPolicy,
    LRUPolicy,
    fbgemm_cache_algorithm,
    make_policy,
    register_policy,
    registered_policy,
)
from torchrec_mtrains.distributed.options import TieredTableOptions
from torchrec_mtrains.planner import PlannerConfig


@register_policy
class _OwnPolicy(LRUPolicy):
    """A policy of the project's own that fbgemm's cache has no counterpart of."""

    name = "test-policies-own"
    fbgemm_algorithm = None


def test_a_registered_name_gives_its_class() -> None:
    assert registered_policy("lru") is LRUPolicy and registered_policy("lfu") is LFUPolicy
    assert registered_policy(_OwnPolicy.name) is _OwnPolicy


@pytest.mark.parametrize("name", ["fifo", "LRU", ""])
def test_an_unknown_name_is_refused_naming_what_and_the_registered_ones(name: str) -> None:
    allowed = ", ".join(sorted(POLICIES))
    with pytest.raises(ValueError) as caught:
        registered_policy(name, "cache_policy")
    assert str(caught.value) == f"unknown cache_policy {name!r}; expected one of: {allowed}"
    # Every reader of a policy name refuses it with the same words.
    for refuse in (
        lambda: make_policy(name, 4),
        lambda: TieredTableOptions(cache_policy=name),
    ):
        with pytest.raises(ValueError, match=f"^unknown cache policy {name!r}; expected one of: "):
            refuse()
    with pytest.raises(ValueError, match=f"^unknown cache_policy {name!r}; expected one of: "):
        PlannerConfig(cache_policy=name)


def test_one_default_policy() -> None:
    assert DEFAULT_POLICY in POLICIES
    assert PlannerConfig().cache_policy == TieredTableOptions().cache_policy == DEFAULT_POLICY


def test_fbgemms_cache_stands_for_lru_and_lfu_only() -> None:
    assert fbgemm_cache_algorithm("lru") is CacheAlgorithm.LRU
    assert fbgemm_cache_algorithm("lfu") is CacheAlgorithm.LFU
    with pytest.raises(ValueError) as caught:
        fbgemm_cache_algorithm(_OwnPolicy.name)
    assert str(caught.value) == (
        f"cache policy {_OwnPolicy.name!r} has no counterpart in fbgemm's cache, which "
        "TorchRec's FUSED_UVM_CACHING kernel uses; it runs lfu, lru only"
    )
    with pytest.raises(ValueError, match=r"^unknown cache policy 'fifo'"):
        fbgemm_cache_algorithm("fifo")
