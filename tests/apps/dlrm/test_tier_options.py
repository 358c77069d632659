"""The app opens its tier stores with the hardware config's figures, the ones its planner uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from apps.dlrm.config import CONF_DIR, to_app_config  # importing it registers the schemas
from apps.dlrm.model import build_model, build_storage
from torchrec_mtrains.pipeline import tiered_groups
from torchrec_mtrains.planner import topology_from_config
from torchrec_mtrains.tiers import LogBlockScmOptions
from torchrec_mtrains.tiers.log_block_scm import LogBlockSCMStore
from torchrec_mtrains.types import Tier

# Four 4,000-row tables (272 KB with their optimizer state) are too big for the DRAM budgets
# below and go to block SCM under either planner; the 100-row ones stay on the fused kernel.
SIZES = [4000, 2000] + [100] * 20 + [4000, 2000, 4000, 4000]
PLANNERS = {
    "size_rule": [
        "planner=size_rule",
        "planner.dram_budget=200KB",
        "planner.block_scm_min_bytes=200KB",
        "planner.cache_load_factor=0.25",
    ],
    "tiered": [
        "planner=tiered_capacity_bound",
        "planner.dram_budget=600KB",  # also the log index (4 B a row) and I/O buffers
        "planner.byte_scm_budget=300KB",
        "planner.min_cache_rows=64",
        "hardware.block_scm.max_pass_bytes=65536",  # a tiny host's I/O passes
    ],
}


@pytest.fixture(autouse=True)
def _fresh_hydra() -> Iterator[None]:
    GlobalHydra.instance().clear()
    yield
    GlobalHydra.instance().clear()


def _config(run_dir: Path, *overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(
            config_name="config",
            overrides=[
                f"model.num_embeddings_per_feature=[{','.join(map(str, SIZES))}]",
                "data.batch_size=64",
                f"run.dir={run_dir}",
                *overrides,
            ],
        )


def test_the_storage_takes_block_size_and_queue_depth_from_the_hardware(tmp_path: Path) -> None:
    cfg = _config(tmp_path, "hardware.block_scm.queue_depth=8")
    app = to_app_config(cfg)
    storage = build_storage(app.hardware, Path(app.run.dir), resume=False)
    host = topology_from_config(cfg.hardware)
    assert host.block_scm is not None and host.block_scm.queue_depth == 8
    assert storage.options_for(Tier.BLOCK_SCM) == LogBlockScmOptions(
        block_size=host.block_scm.block_size, queue_depth=8
    )


@pytest.mark.parametrize("planner", sorted(PLANNERS))
def test_block_stores_run_at_the_queue_depth_the_planner_assumed(
    tmp_path: Path, planner: str, one_rank_process_group: None
) -> None:
    cfg = _config(tmp_path, *PLANNERS[planner], "hardware.block_scm.queue_depth=8")
    host = topology_from_config(cfg.hardware)  # what the tiered planner's perf model reads
    assert host.block_scm is not None
    model, _, plan_text = build_model(
        to_app_config(cfg), 1, resume=False, device=torch.device("cpu")
    )
    stores = [
        shard.store
        for group in tiered_groups(model)
        for shard in group.shards
        if shard.store.serves_tier == Tier.BLOCK_SCM.value
    ]
    assert stores, f"no table went to block SCM:\n{plan_text}"
    for store in stores:
        assert isinstance(store, LogBlockSCMStore)  # the block tier's default layout
        assert store.queue_depth == host.block_scm.queue_depth == 8
        assert store._engine.depth == 8  # the I/Os the engine keeps in flight
        assert store.block_size == host.block_scm.block_size
    for group in tiered_groups(model):
        for shard in group.shards:
            shard.store.close()
