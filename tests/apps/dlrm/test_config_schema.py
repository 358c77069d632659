"""The app's structured configs: misspelt or mistyped overrides fail by name, every schema
refuses a bad value of each option as it is made (one line naming the option, before anything is
built), the group files' values tie to the schemas' defaults, and ``--multirun`` gives every job
its own run directory."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import MISSING, DictConfig, OmegaConf

from apps.dlrm.config import (
    CONF_DIR,
    ModelConfig,
    PipelineConfig,
    RunConfig,
    SizeRulePlannerConfig,
    check_keys,
    to_app_config,
)
from apps.dlrm.data import (
    CONFIG_KINDS,
    CriteoNpyDataConfig,
    CriteoTsvDataConfig,
    SyntheticDataConfig,
)
from apps.dlrm.errors import ConfigError
from apps.dlrm.placement import LargeTables
from torchrec_mtrains.cache.policies import LRUPolicy, register_policy
from torchrec_mtrains.distributed.options import BoundsCheck
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


@register_policy
class _OwnPolicy(LRUPolicy):
    """A registered policy of the project's own that fbgemm's cache has no counterpart of."""

    name = "test-config-own"
    fbgemm_algorithm = None


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
        ("planner.min_cache_rows=0", "planner: min_cache_rows must be >= 1, got 0"),
    ],
)
def test_a_value_its_schema_refuses_is_named_with_its_node(override: str, named: str) -> None:
    with pytest.raises(ConfigError) as caught:
        to_app_config(_compose(override))
    assert named in str(caught.value)


SIZE_RULE = "planner=size_rule"
UVM = "planner.large_tables=uvm_caching"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["run.steps=-1"], "run.steps=-1: give a whole number >= 0, or null"),
        (["run.epochs=0"], "run.epochs=0: give a whole number >= 1, or null"),
        (
            ["run.steps=null", "run.epochs=null"],
            "run.steps=null and run.epochs=null: the run would never end; set run.epochs",
        ),
        (["run.eval_batches=-1"], "run.eval_batches=-1: give a whole number >= 0, or null"),
        (["run.keep_checkpoints=0"], "run.keep_checkpoints=0: give a whole number >= 1, or null"),
        (["run.full_checkpoint_every=0"], "run.full_checkpoint_every=0: give a whole number >= 1"),
        (["run.checkpoint_every=-1"], "run.checkpoint_every=-1: give a whole number >= 0 (0 = "),
        (["run.log_every=0"], "run.log_every=0: give a whole number >= 1"),
        (["run.num_threads=-1"], "run.num_threads=-1: give a whole number >= 0 (0 = torch's"),
        (["run.learning_rate=-0.1"], "run.learning_rate=-0.1: give a finite rate >= 0"),
        (["run.progress_every_s=0"], "run.progress_every_s=0.0: must be positive seconds"),
        (["run.device=gpu"], "run.device='gpu': expected one of auto, cpu, cuda"),
        (
            ["run.collective_timeout=soon"],
            "run.collective_timeout='soon' is not a duration; write e.g. 90s",
        ),
        (["run.bounds_check=fatal"], "run.bounds_check='fatal': expected one of error, warn ("),
        (
            ["run.malloc_trim_threshold=lots"],
            "run.malloc_trim_threshold='lots' is not a size; write e.g. 512GB",
        ),
        (
            ["run.malloc_trim_threshold=4GiB"],
            "run.malloc_trim_threshold='4GiB': give a size in [1MiB, 2GiB), or null for the C",
        ),
        (["pipeline.lookahead=-1"], "pipeline.lookahead=-1: give the number of batches to "),
        (["pipeline.read_ahead=-2"], "pipeline.read_ahead=-2: give the number of batches a "),
        (
            ["model.embedding_dim=0", "model.dense_arch_layer_sizes=[8,0]"],
            "model.embedding_dim=0: give a whole number >= 1",
        ),
        (
            ["model.num_embeddings_per_feature=[]"],
            "model.num_embeddings_per_feature=[]: give the rows of each table",
        ),
        (
            ["model.num_embeddings_per_feature=[5,0]"],
            "model.num_embeddings_per_feature=[5, 0]: every table needs >= 1 row",
        ),
        (
            ["model.dense_arch_layer_sizes=[64,8]"],
            "model.dense_arch_layer_sizes=[64, 8] must end in model.embedding_dim=16",
        ),
        (
            ["model.over_arch_layer_sizes=[64,2]"],
            "model.over_arch_layer_sizes=[64, 2] must end in 1 (the click logit)",
        ),
        (
            ["model.pooling_factors=[1,2]"],
            "model.pooling_factors has 2 entries; give one per table (26) or one",
        ),
        (["model.embedding_dims=[16,16]"], "model.embedding_dims has 2 entries"),
        (["model.zipf_exponents=[1,1]"], "model.zipf_exponents has 2 entries"),
        (
            [SIZE_RULE, "planner.dram_budget=lots"],
            "planner.dram_budget='lots' is not a size; write e.g. 512GB",
        ),
        (
            [SIZE_RULE, "planner.block_scm_min_bytes=64XB"],
            "planner.block_scm_min_bytes='64XB' is not a size",
        ),
        (
            [SIZE_RULE, "planner.cache_load_factor=0"],
            "planner: cache_load_factor must be in (0, 1], got 0.0",
        ),
        (
            [SIZE_RULE, "planner.cache_policy=fifo"],
            "planner: unknown cache_policy 'fifo'; expected one of: ",
        ),
        (
            [SIZE_RULE, "planner.large_tables=hbm"],
            "planner.large_tables='hbm': give one of tiered, uvm_caching",
        ),
        (
            [SIZE_RULE, UVM, f"planner.cache_policy={_OwnPolicy.name}"],
            f"planner.large_tables=uvm_caching with planner.cache_policy='{_OwnPolicy.name}': "
            f"cache policy '{_OwnPolicy.name}' has no counterpart in fbgemm's cache",
        ),
        (
            ["planner.dram_budget=lots"],
            "planner: planner.dram_budget='lots' is not a size; write e.g. 512GB",
        ),
        (["planner.byte_scm_budget=-5MB"], "planner: planner.byte_scm_budget='-5MB'"),
    ],
)
def test_each_option_refuses_a_bad_value_as_the_config_is_made(
    overrides: list[str], message: str
) -> None:
    """The one check of each option runs when the composed config is converted, before any
    file is written; its message (one line) names the option and what it may be."""
    cfg = _compose(*overrides)
    check_keys(cfg)
    with pytest.raises(ConfigError) as caught:
        to_app_config(cfg)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_typed_values_of_the_checked_options() -> None:
    app = to_app_config(
        _compose(
            SIZE_RULE,
            "planner.dram_budget=1.5GiB",
            "planner.block_scm_min_bytes=48MB",
            "run.collective_timeout=90s",
            "run.bounds_check=warn",
        )
    )
    assert app.run.collective_timeout_duration == timedelta(seconds=90)
    assert app.run.bounds_check_rule is BoundsCheck.WARN
    assert isinstance(app.planner, SizeRulePlannerConfig)
    assert app.planner.dram_budget_bytes == 3 << 29
    assert app.planner.block_scm_threshold_bytes == 48 * 10**6
    assert app.planner.large_tables_choice is LargeTables.TIERED
    assert app.run.malloc_trim_bytes is None  # the default: glibc's own settings
    for text, trim in (("64MiB", 64 * 2**20), ("256MiB", 256 * 2**20)):
        app = to_app_config(_compose(SIZE_RULE, f"run.malloc_trim_threshold={text}"))
        assert app.run.malloc_trim_bytes == trim


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("64MB", 64 * 10**6),
        ("64MiB", 64 << 20),
        ("1.5GiB", 3 << 29),
        ("2GB", 2 * 10**9),
        ("512", 512),
    ],
)
def test_size_options_parse_as_everywhere_else(text: str, size: int) -> None:
    # One parser for every size option: SI for KB/MB/GB, IEC for KiB/MiB/GiB.
    planner = SizeRulePlannerConfig(
        dram_budget=text, block_scm_min_bytes=text, cache_load_factor=0.1, large_tables="tiered"
    )
    assert planner.dram_budget_bytes == planner.block_scm_threshold_bytes == size


@pytest.mark.parametrize("text", ["lots", "MB", "-5MB", "64XB", "64m"])
def test_a_bad_size_names_the_option(text: str) -> None:
    with pytest.raises(ConfigError, match=r"^planner\.dram_budget="):
        SizeRulePlannerConfig(
            dram_budget=text,
            block_scm_min_bytes="1MB",
            cache_load_factor=0.1,
            large_tables="tiered",
        )


def test_a_registered_policy_of_our_own_is_taken_where_a_cache_of_ours_runs_it() -> None:
    own = f"planner.cache_policy={_OwnPolicy.name}"
    assert to_app_config(_compose(own)).planner.cache_policy == _OwnPolicy.name
    assert to_app_config(_compose(SIZE_RULE, own)).planner.cache_policy == _OwnPolicy.name
    for policy in ("lru", "lfu"):  # fbgemm's cache runs these two
        assert to_app_config(_compose(SIZE_RULE, UVM, f"planner.cache_policy={policy}"))


# Values a group file sets on purpose to other than its schema's default (the dataclass is also
# used directly, where another default suits): the app's choice, said here so that it stays one.
APP_CHOICES = {
    ("data/synthetic.yaml", "num_batches"),  # an epoch long enough for run.steps
    ("data/criteo_tsv.yaml", "eval_fraction"),  # hold rows out unless held-out files are given
    ("data/criteo_npy.yaml", "eval_fraction"),
}


def _schema_files() -> list[tuple[str, type]]:
    """(group file, schema) for each file under ``conf/`` whose defaults list names a schema
    of the ConfigStore directly (a file that names another file is a variant of it)."""
    schemas: dict[str, type] = {
        "tiered_schema": PlannerConfig,
        "size_rule_schema": SizeRulePlannerConfig,
        **{f"{kind}_schema": schema for kind, schema in CONFIG_KINDS.items()},
    }
    found = []
    for path in sorted(Path(CONF_DIR).glob("*/*.yaml")):
        defaults = OmegaConf.load(path).get("defaults", [])
        named = [d for d in defaults if isinstance(d, str) and d in schemas]
        if named:
            found.append((f"{path.parent.name}/{path.name}", schemas[named[0]]))
    return found


def test_every_schema_has_a_group_file_that_names_it() -> None:
    assert {schema for _, schema in _schema_files()} == {
        PlannerConfig,
        SizeRulePlannerConfig,
        *CONFIG_KINDS.values(),
    }


@pytest.mark.parametrize(("name", "schema"), _schema_files())
def test_a_group_file_restates_its_schemas_defaults_and_lists_every_key(
    name: str, schema: type
) -> None:
    """A value a group file restates is its schema's default (tiered.yaml lists all of
    PlannerConfig's, each with its comment), and the file lists every key of the schema, so it
    documents them all."""
    node = OmegaConf.load(Path(CONF_DIR) / name)
    values = OmegaConf.to_container(node, resolve=False)
    assert isinstance(values, dict)
    keys = [key for key in values if key != "defaults"]
    assert sorted(keys) == sorted(f.name for f in dataclasses.fields(schema)), name
    for f in dataclasses.fields(schema):
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        if default in (dataclasses.MISSING, MISSING) or OmegaConf.is_interpolation(node, f.name):
            continue  # the file is the value's one home / it follows another option
        value = values[f.name]
        if (name, f.name) in APP_CHOICES:
            assert value != default, (
                f"{name}: {f.name} is the default now; drop it from APP_CHOICES"
            )
            continue
        assert value == default, f"{name}: {f.name}={value!r}, its schema's default is {default!r}"


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
