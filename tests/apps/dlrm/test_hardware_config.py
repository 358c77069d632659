"""The app's hardware node: presets shipped in the library, and where each run's tier files go."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from apps.dlrm.config import CONF_DIR, to_app_config
from apps.dlrm.model import tier_mounts, tier_root
from torchrec_mtrains.planner import available_presets, topology_from_config


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("preset", available_presets())
def test_every_library_preset_composes_and_keeps_tiers_in_the_run(preset: str) -> None:
    cfg = _compose(f"hardware={preset}", "run.dir=/data/runs/r1")
    assert cfg.hardware.name == preset
    assert topology_from_config(cfg.hardware).name == preset
    app = to_app_config(cfg)
    assert tier_root(app.hardware, Path(app.run.dir)) == Path("/data/runs/r1/tiers")  # per run
    assert tier_mounts(app.hardware) == {}


def test_tier_root_and_the_documented_dirs_override_form() -> None:
    cfg = _compose(
        "hardware.tier_root=/mnt/fast/tiers",
        "hardware.dirs={block_scm:/mnt/nvme0/run}",
    )
    app = to_app_config(cfg)
    assert tier_root(app.hardware, Path(app.run.dir)) == Path("/mnt/fast/tiers")
    assert tier_mounts(app.hardware) == {"block_scm": "/mnt/nvme0/run"}
    cfg = _compose("hardware.dirs.byte_scm=/mnt/pmem0/run")
    assert tier_mounts(to_app_config(cfg).hardware) == {"byte_scm": "/mnt/pmem0/run"}
