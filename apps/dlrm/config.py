"""The app's configuration schema, registered in Hydra's ConfigStore.

``conf/config.yaml`` and the group files under ``conf/`` hold the values and their comments;
the dataclasses here give every node its keys and types, so a misspelt or mistyped override
(``+run.stpes=5``, ``run.steps=abc``, ``model.embedding_dim=x``) stops composition with an error
naming the key instead of being carried along unused. Schemas:

* the root ``app_schema`` (:class:`AppConfig`): ``run`` here, ``model`` and ``pipeline`` typed
  by :class:`ModelConfig` / :class:`PipelineConfig`, ``hardware`` by the library's
  :class:`~torchrec_mtrains.planner.HostTopology`;
* ``data/<kind>_schema`` for each data source, and ``planner/tiered_schema``
  (:class:`~torchrec_mtrains.planner.PlannerConfig`) / ``planner/size_rule_schema``
  (:class:`SizeRulePlannerConfig`), which the group files name in their defaults lists.

Importing this module registers them (as :data:`CONF_DIR`'s users need them before composing).
A ``--multirun`` job's ``run.dir`` is its sweep folder (the ``run_dir`` resolver).

An entry point composes the config, refuses unknown keys (:func:`check_keys`) and converts it
once (:func:`to_app_config`); the code below it takes the typed parts it reads.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import MISSING, DictConfig, OmegaConf

from apps.dlrm.data import CONFIG_KINDS
from apps.dlrm.errors import ConfigError
from torchrec_mtrains.planner import HostTopology, PlannerConfig, topology_from_config

__all__ = [
    "CONF_DIR",
    "AppConfig",
    "ModelConfig",
    "PipelineConfig",
    "RunConfig",
    "SizeRulePlannerConfig",
    "check_keys",
    "register_configs",
    "to_app_config",
]

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
"""The app's Hydra config directory (``conf/`` of the repository)."""


@dataclass
class RunConfig:
    """``run``: the training loop, its outputs and its devices (values: ``conf/config.yaml``)."""

    dir: str = MISSING
    steps: int | None = MISSING
    epochs: int | None = MISSING
    eval_batches: int | None = MISSING
    learning_rate: float = MISSING
    seed: int = MISSING
    log_every: int = MISSING
    tensorboard: bool = MISSING
    checkpoint_every: int = MISSING
    final_checkpoint: bool = MISSING
    keep_checkpoints: int | None = MISSING
    full_checkpoint_every: int = MISSING
    resume: bool = MISSING
    replan: bool = MISSING
    progress: bool = MISSING
    progress_every_s: float = MISSING
    device: str = MISSING
    num_threads: int = MISSING
    collective_timeout: str = MISSING
    bounds_check: str = MISSING


@dataclass
class ModelConfig:
    """``model``: the DLRM's shape (``conf/model/*.yaml``). The optional per-table lists are
    what-if inputs: ``embedding_dims`` (else ``embedding_dim`` for all), ``pooling_factors``
    and ``zipf_exponents`` (else the data's, or the planner's defaults)."""

    embedding_dim: int = MISSING
    dense_arch_layer_sizes: list[int] = MISSING
    over_arch_layer_sizes: list[int] = MISSING
    num_embeddings_per_feature: list[int] = MISSING
    embedding_dims: list[int] | None = None
    pooling_factors: list[float] | None = None
    zipf_exponents: list[float] | None = None


@dataclass
class PipelineConfig:
    """``pipeline``: batches whose rows the tiers fetch ahead of the running one (0 = the
    plain loop), and batches a background thread builds ahead of the loop (0 = inline)."""

    lookahead: int = MISSING
    read_ahead: int = MISSING


@dataclass
class SizeRulePlannerConfig:
    """``planner=size_rule``: placement by table size (``conf/planner/size_rule.yaml``)."""

    name: str = "size_rule"
    dram_budget: str = MISSING
    block_scm_min_bytes: str = MISSING
    cache_load_factor: float = MISSING
    cache_policy: str = MISSING
    large_tables: str = MISSING  # "tiered" or "uvm_caching" (apps.dlrm.placement.LARGE_TABLES)


@dataclass
class AppConfig:
    """The composed config's top level; ``data`` and ``planner`` vary by choice, so their
    group files name their own schema. Built by :func:`to_app_config`, ``data`` is one of
    :data:`~apps.dlrm.data.CONFIG_KINDS`' dataclasses and ``planner`` a
    :class:`~torchrec_mtrains.planner.PlannerConfig` or :class:`SizeRulePlannerConfig` (the
    schema says ``Any``: OmegaConf has no unions of dataclasses)."""

    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = MISSING
    data: Any = MISSING
    hardware: HostTopology = MISSING
    planner: Any = MISSING
    pipeline: PipelineConfig = MISSING


def _run_dir(default: str) -> str:
    """``default`` for a single run; under ``--multirun`` the job's own sweep folder, so jobs
    started in the same second do not share (and refuse) one run directory."""
    if HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN:
        return str(HydraConfig.get().runtime.output_dir)
    return default


def _unknown_keys(node: DictConfig, prefix: str) -> list[tuple[str, list[str]]]:
    """(full key, known keys of its node) for every key no schema declares, depth first."""
    schema = OmegaConf.get_type(node)
    if not (isinstance(schema, type) and dataclasses.is_dataclass(schema)):
        return []
    known = [f.name for f in dataclasses.fields(schema)]
    found = [(f"{prefix}{key}", known) for key in node if key not in known]
    for key in known:
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_none():
            found += _unknown_keys(child, f"{prefix}{key}.")
    return found


def to_app_config(cfg: DictConfig) -> AppConfig:
    """The composed config as its schema's dataclasses, each node converted once, with its
    interpolations resolved. An entry point calls it after :func:`check_keys`; everything
    below takes the typed parts it reads.

    Raises:
        ConfigError: a value the node's own check refuses (``hardware.ranks_per_host=0``,
            ``planner.cache_policy=x``), named by its node; or a ``data`` / ``planner`` group
            file that names no schema.
    """

    def node(key: str) -> Any:
        try:
            if key == "hardware":  # the library's own conversion, as the torchx component's
                return topology_from_config(cfg.hardware)
            return OmegaConf.to_object(cfg[key])
        except ValueError as e:  # the dataclasses' own checks (__post_init__)
            raise ConfigError(f"{key}: {e}") from None

    app = AppConfig(
        run=node("run"),
        model=node("model"),
        data=node("data"),
        hardware=node("hardware"),
        planner=node("planner"),
        pipeline=node("pipeline"),
    )
    if not isinstance(app.data, tuple(CONFIG_KINDS.values())):
        raise ConfigError(
            f"data: its group file names no schema (defaults: [<kind>_schema], kinds "
            f"{', '.join(CONFIG_KINDS)}); got a {type(app.data).__name__}"
        )
    if not isinstance(app.planner, PlannerConfig | SizeRulePlannerConfig):
        raise ConfigError(
            "planner: its group file names no schema (defaults: [tiered_schema] or "
            f"[size_rule_schema]); got a {type(app.planner).__name__}"
        )
    return app


def check_keys(cfg: DictConfig) -> None:
    """Refuses keys no schema declares. Composition already refuses ``run.stpes=5``; this
    catches what an explicit ``+`` added (``+run.stpes=5``), which Hydra lets through.

    Raises:
        ConfigError: naming the first unknown key and the closest known one.
    """
    unknown = _unknown_keys(cfg, "")
    if not unknown:
        return
    key, known = unknown[0]
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, known, n=1)
    hint = f" (did you mean {key[: -len(leaf)]}{close[0]}?)" if close else ""
    raise ConfigError(
        f"unknown config key {key}{hint}: nothing reads it. Known keys there: {', '.join(known)}"
    )


def register_configs() -> None:
    """Stores the schemas (idempotent: the ConfigStore replaces same-named entries)."""
    store = ConfigStore.instance()
    store.store(name="app_schema", node=AppConfig)
    for kind, schema in CONFIG_KINDS.items():
        store.store(group="data", name=f"{kind}_schema", node=schema)
    store.store(group="planner", name="tiered_schema", node=PlannerConfig)
    store.store(group="planner", name="size_rule_schema", node=SizeRulePlannerConfig)
    if not OmegaConf.has_resolver("run_dir"):
        OmegaConf.register_new_resolver("run_dir", _run_dir)


register_configs()
