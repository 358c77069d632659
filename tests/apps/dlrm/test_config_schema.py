"""The app's structured configs: misspelt or mistyped overrides fail by name, and ``--multirun``
gives every job its own run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import DictConfig

from apps.dlrm.config import (
    CONF_DIR,
    ModelConfig,
    PipelineConfig,
    RunConfig,
    SizeRulePlannerConfig,
    check_keys,
    to_app_config,
)
from apps.dlrm.data import CriteoNpyDataConfig, CriteoTsvDataConfig, SyntheticDataConfig
from apps.dlrm.errors import ConfigError
from torchrec_mtrains.planner import HostTopology, PlannerConfig, topology_from_config

REPO = Path(__file__).resolve().parents[3]
TINY_RUN = (
    "run.steps=2",
    "run.eval_batches=1",
    "run.progress=false",
    "run.final_checkpoint=false",
    "data.batch_size=32",
    "data.num_sparse_features=1",
    "model.num_embeddings_per_feature=[100]",
)


def _compose(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "override",
    [
        "run.steps=abc",
        "model.embedding_dim=x",
        "pipeline.lookahead=two",
        "data.zipf_exponents=[steep]",
        "planner.min_cache_rows=many",
        "hardware.block_scm.queue_depth=deep",
    ],
)
def test_a_mistyped_override_fails_at_composition_naming_the_key(override: str) -> None:
    with pytest.raises(ConfigCompositionException) as caught:
        _compose(override)
    assert override.split("=")[0] in str(caught.value) + str(caught.value.__cause__)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("+run.stpes=5", "run.stpes (did you mean run.steps?)"),
        ("+data.batchsize=8", "data.batchsize (did you mean data.batch_size?)"),
        (
            "+hardware.dram.capacty=1GB",
            "hardware.dram.capacty (did you mean hardware.dram.capacity?)",
        ),
        ("+planner.dram_budgt=1MB", "planner.dram_budgt (did you mean planner.dram_budget?)"),
        ("+lookahead=2", "unknown config key lookahead"),
    ],
)
def test_an_appended_unknown_key_is_refused_by_name(override: str, named: str) -> None:
    cfg = _compose(override)  # Hydra lets an explicit "+" through ...
    with pytest.raises(ConfigError, match="unknown config key") as caught:
        check_keys(cfg)  # ... the app does not
    assert named in str(caught.value)


@pytest.mark.parametrize(
    "overrides",
    [
        (),
        ("planner=size_rule",),
        ("data=criteo_tsv",),
        ("data=criteo_npy",),
        ("hardware=gpu_pmem_nvme", "model=criteo_kaggle"),
        ("hardware=cpu_cxl_nvme", "model=whatif_multi_tb", "planner=tiered"),
    ],
)
def test_every_shipped_choice_passes_the_schema(overrides: tuple[str, ...]) -> None:
    check_keys(_compose(*overrides))


@pytest.mark.parametrize(
    ("overrides", "data", "planner"),
    [
        ((), SyntheticDataConfig, PlannerConfig),
        (("planner=size_rule",), SyntheticDataConfig, SizeRulePlannerConfig),
        (("data=criteo_tsv",), CriteoTsvDataConfig, PlannerConfig),
        (("data=criteo_npy", "hardware=gpu_pmem_nvme"), CriteoNpyDataConfig, PlannerConfig),
    ],
)
def test_the_composed_config_converts_to_its_schemas_dataclasses(
    overrides: tuple[str, ...], data: type, planner: type
) -> None:
    cfg = _compose("model.num_embeddings_per_feature=[7,8]", *overrides)
    app = to_app_config(cfg)
    assert isinstance(app.run, RunConfig) and isinstance(app.pipeline, PipelineConfig)
    assert isinstance(app.model, ModelConfig)
    assert type(app.data) is data and type(app.planner) is planner
    assert isinstance(app.hardware, HostTopology)
    assert app.hardware == topology_from_config(cfg.hardware)
    assert app.data.num_embeddings_per_feature == [7, 8]  # interpolations resolved
    assert app.run.dir == str(cfg.run.dir)


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("hardware.ranks_per_host=0", "hardware: ranks_per_host must be >= 1, got 0"),
        ("planner.cache_policy=fifo", "planner: unknown cache_policy 'fifo'; expected one of: "),
    ],
)
def test_a_value_its_schema_refuses_is_named_with_its_node(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        to_app_config(_compose(override))
    assert named in str(caught.value)


@pytest.mark.slow
def test_multirun_puts_each_job_in_its_sweep_folder(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "apps.dlrm.train",
            "--multirun",
            *TINY_RUN,
            "pipeline.lookahead=0,1",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (sweep,) = (tmp_path / "runs" / "multirun").iterdir()
    for job, lookahead in ((0, 0), (1, 1)):
        metrics = json.loads((sweep / str(job) / "metrics.json").read_text())
        assert metrics["run_dir"] == str(sweep / str(job))
        assert metrics["lookahead"] == lookahead and metrics["steps"] == 2
