"""Typed per-tier options: registered with their store, checked key by key, reaching the store."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest
from tier_helpers import TIER_NAMES

from torchrec_mtrains.tiers import (
    TIERS,
    BlockScmOptions,
    ByteScmOptions,
    DramOptions,
    IOEngineKind,
    OpenMode,
    RowStoreError,
    TierOptions,
    open_store,
    register_tier,
    resolve_options,
)
from torchrec_mtrains.tiers.block_scm import BlockSCMStore
from torchrec_mtrains.tiers.dram import DramStore
from torchrec_mtrains.types import RowLayout


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_every_tier_registers_its_own_frozen_options(tier: str) -> None:
    options_type = TIERS[tier].options_type
    assert issubclass(options_type, TierOptions) and options_type.tier == tier
    defaults = options_type()
    assert resolve_options(tier) == defaults
    for name in options_type.option_names():
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(defaults, name, getattr(defaults, name))
    # Options the planner also models must be fields of the options.
    assert set(options_type.hardware_fields) <= set(options_type.option_names())


@pytest.mark.parametrize("tier", TIER_NAMES)
def test_an_unknown_key_names_the_tier_the_key_and_the_allowed_keys(tier: str) -> None:
    allowed = ", ".join(TIERS[tier].options_type.option_names()) or "(none)"
    message = f"tier '{tier}': unknown option 'queue_dept'; allowed: {allowed}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        resolve_options(tier, {"queue_dept": 8})


def test_block_options_list_their_keys_when_one_is_misspelt() -> None:
    with pytest.raises(
        ValueError,
        match=r"tier 'block_scm': unknown options 'depth', 'blocksize'; allowed: block_size, "
        r"queue_depth, direct, engine, max_io_bytes, max_pass_bytes",
    ):
        BlockScmOptions.from_mapping({"block_size": 4096, "depth": 8, "blocksize": 1})


@pytest.mark.parametrize(
    ("options_type", "values", "message"),
    [
        (BlockScmOptions, {"block_size": 1000}, "'block_size' must be a power of two >= 512"),
        (BlockScmOptions, {"queue_depth": 0}, "'queue_depth' must be >= 1, got 0"),
        (BlockScmOptions, {"queue_depth": "8"}, "'queue_depth' must be an integer, got '8'"),
        (BlockScmOptions, {"queue_depth": True}, "'queue_depth' must be an integer, got True"),
        (BlockScmOptions, {"direct": 1}, "'direct' must be true or false, got 1"),
        (
            BlockScmOptions,
            {"engine": "spdk"},
            "'engine' must be one of 'auto', 'uring', 'aio', 'threads', got 'spdk'",
        ),
        (BlockScmOptions, {"max_io_bytes": 512}, r"'max_io_bytes' \(512\) must be >= block_size"),
        (BlockScmOptions, {"max_pass_bytes": 0}, "'max_pass_bytes' must be >= 1"),
        (ByteScmOptions, {"numa_node": -1}, "'numa_node' must be >= 0 or None, got -1"),
        (ByteScmOptions, {"map_sync": "yes"}, "'map_sync' must be true or false or None"),
    ],
)
def test_bad_values_name_the_tier_and_the_option(
    options_type: type[TierOptions], values: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=f"^tier '{options_type.tier}' option {message}"):
        options_type.from_mapping(values)


def test_values_are_converted_to_the_annotated_types() -> None:
    options = BlockScmOptions.from_mapping({"engine": "threads", "queue_depth": 8})
    assert options.engine is IOEngineKind.THREADS
    assert options == BlockScmOptions(queue_depth=8, engine=IOEngineKind.THREADS)
    assert options.as_dict()["engine"] == "threads"
    assert ByteScmOptions(numa_node=None, map_sync=False).map_sync is False


@pytest.mark.parametrize(
    "options",
    [
        {"engine": "threads", "block_size": 8192, "queue_depth": 4},  # a mapping, as callers had
        BlockScmOptions(block_size=8192, queue_depth=4, engine=IOEngineKind.THREADS),
    ],
    ids=["mapping", "typed"],
)
def test_the_block_store_runs_with_the_options_it_is_given(
    tmp_path: Path, options: dict[str, Any] | BlockScmOptions
) -> None:
    with open_store("block_scm", tmp_path, "t", RowLayout(100, 8), options=options) as store:
        assert isinstance(store, BlockSCMStore)
        assert store.options == BlockScmOptions(8192, 4, engine=IOEngineKind.THREADS)
        assert (store.block_size, store.queue_depth, store.engine) == (8192, 4, "threads")
        assert store._engine.depth == 4  # the I/Os actually kept in flight
        assert store.data_offset == 8192


def test_stores_default_their_options(tmp_path: Path) -> None:
    with BlockSCMStore(tmp_path, "t", RowLayout(10, 4)) as store:
        assert store.options == BlockScmOptions()
        assert store.queue_depth == BlockScmOptions().queue_depth == store._engine.depth


def test_options_of_another_tier_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tier 'dram' takes DramOptions, got BlockScmOptions"):
        open_store("dram", tmp_path, "t", RowLayout(4, 2), options=BlockScmOptions())
    with pytest.raises(ValueError, match=r"tier 'block_scm' takes BlockScmOptions"):
        BlockSCMStore(tmp_path, "t", RowLayout(4, 2), options=DramOptions())  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())  # refused before any file was made
    with pytest.raises(ValueError, match=r"unknown option 'queue_depth'; allowed: numa_node"):
        open_store("byte_scm", tmp_path, "t", RowLayout(4, 2), options={"queue_depth": 4})


def test_open_store_takes_the_mode_beside_the_options(tmp_path: Path) -> None:
    open_store("dram", tmp_path, "t", RowLayout(4, 2), options={}).close()
    with pytest.raises(RowStoreError, match="mode=create"):
        open_store("dram", tmp_path, "t", RowLayout(4, 2), mode=OpenMode.CREATE)


def test_register_needs_options_for_the_same_tier() -> None:
    @dataclasses.dataclass(frozen=True)
    class TapeOptions(TierOptions):
        tier: ClassVar[str] = "tape"

    class NoOptions(DramStore):
        name: ClassVar[str] = "tape"
        options_type: ClassVar[Any] = None

    class Mismatched(DramStore):
        name: ClassVar[str] = "tape"  # options_type still DramOptions, whose tier is dram

    class Tape(DramStore):
        name: ClassVar[str] = "tape"
        options_type: ClassVar[type[TierOptions]] = TapeOptions

    with pytest.raises(ValueError, match="NoOptions must set the class attribute 'options_type'"):
        register_tier(NoOptions)
    with pytest.raises(ValueError, match="whose tier is 'dram', not 'tape'"):
        register_tier(Mismatched)
    assert "tape" not in TIERS
    from torchrec_mtrains.tiers import registry

    try:
        register_tier(Tape)
        assert resolve_options("tape", {}) == TapeOptions()
    finally:
        registry._REGISTRY.pop("tape", None)
