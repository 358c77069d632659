"""TierStorage's per-tier options: typed, checked at construction, handed to the stores."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from torchrec_mtrains.distributed import TierStorage
from torchrec_mtrains.tiers import (
    BlockScmOptions,
    ByteScmOptions,
    DramOptions,
    IOEngineKind,
    LogBlockScmOptions,
    open_store,
)
from torchrec_mtrains.tiers.log_block_scm import LogBlockSCMStore
from torchrec_mtrains.types import RowLayout, Tier


def test_a_mapping_of_options_becomes_the_tiers_typed_options(tmp_path: Path) -> None:
    storage = TierStorage(
        root=str(tmp_path),
        tier_options={"block_scm": {"engine": "aio", "block_size": 8192, "queue_depth": 4}},
    )
    # The block tier's default layout is the log.
    expected = LogBlockScmOptions(block_size=8192, queue_depth=4, engine=IOEngineKind.AIO)
    assert storage.tier_options == {"block_scm": expected}
    assert storage.options_for(Tier.BLOCK_SCM) == expected
    flat = TierStorage(tier_options={"block_scm": {"layout": "flat", "queue_depth": 4}})
    assert flat.options_for(Tier.BLOCK_SCM) == BlockScmOptions(queue_depth=4)
    # Tiers left out get their defaults, typed as well.
    assert TierStorage().options_for(Tier.BLOCK_SCM) == LogBlockScmOptions()
    assert storage.options_for(Tier.BYTE_SCM) == ByteScmOptions()
    assert storage.options_for(Tier.DRAM) == DramOptions()


def test_given_options_are_resolved_once_when_the_storage_is_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each store asks the storage for its options: those given were resolved (checked, typed,
    given a layout) when the storage was made, and are handed out as they are."""
    import torchrec_mtrains.distributed.options as storage_options

    storage = TierStorage(tier_options={"block_scm": {"queue_depth": 4}})

    def resolved_again(*args: object) -> None:
        raise AssertionError(f"options resolved again: {args}")

    monkeypatch.setattr(storage_options, "placement_options", resolved_again)
    assert storage.options_for(Tier.BLOCK_SCM) is storage.tier_options["block_scm"]


def test_typed_options_are_kept_as_given() -> None:
    block = BlockScmOptions(queue_depth=8)
    storage = TierStorage(tier_options={Tier.BLOCK_SCM: block})  # type: ignore[dict-item]
    assert storage.options_for(Tier.BLOCK_SCM) is block


def test_bad_options_fail_at_construction_naming_the_tier_and_key() -> None:
    with pytest.raises(
        ValueError,
        match=r"tier 'log_block_scm': unknown option 'queue_dept'; allowed: block_size, queue_dep",
    ):
        TierStorage(tier_options={"block_scm": {"queue_dept": 8}})
    with pytest.raises(ValueError, match=r"tier 'log_block_scm' option 'queue_depth' must be >= 1"):
        TierStorage(tier_options={"block_scm": {"queue_depth": 0}})
    with pytest.raises(ValueError, match=r"tier 'block_scm' option 'queue_depth' must be >= 1"):
        TierStorage(tier_options={"block_scm": {"layout": "flat", "queue_depth": 0}})
    with pytest.raises(ValueError, match=r"tier 'byte_scm' takes ByteScmOptions, got Block"):
        TierStorage(tier_options={"byte_scm": BlockScmOptions()})
    with pytest.raises(ValueError, match="unknown tier 'tape'"):
        TierStorage(tier_options={"tape": {}})


def test_the_store_opened_from_the_storage_runs_with_its_options(tmp_path: Path) -> None:
    storage = TierStorage(root=str(tmp_path), tier_options={"block_scm": {"queue_depth": 8}})
    store = open_store(
        Tier.BLOCK_SCM.value,
        storage.directory(Tier.BLOCK_SCM, 0),
        "t",
        RowLayout(16, 4),
        mode=storage.open_mode,
        options=storage.options_for(Tier.BLOCK_SCM),
    )
    with store:
        assert isinstance(store, LogBlockSCMStore)
        assert store.queue_depth == 8 and store._engine.depth == 8


def test_storage_pickles_for_spawned_ranks() -> None:
    storage = TierStorage(tier_options={"block_scm": {"queue_depth": 8, "engine": "threads"}})
    again = pickle.loads(pickle.dumps(storage))
    assert again == storage
    assert again.options_for(Tier.BLOCK_SCM).engine is IOEngineKind.THREADS
