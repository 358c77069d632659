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
once (:func:`to_app_config`); the code below it takes the typed parts it reads. Each schema
checks its own values as it is made (``__post_init__``, which ``OmegaConf.to_object`` runs), so
a bad value stops the run before anything is built, with one message naming the option
(``run.bounds_check='fatal': expected one of error, warn ...``) whoever reads it. An option whose
YAML value is a string but whose meaning is typed (a mode, a size, a duration) keeps the string
and gives the typed value as a property (``RunConfig.bounds_check_rule``).
Checks across nodes (the model's tables against the data's features) stay with their readers.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import MISSING, DictConfig, OmegaConf
from torchrec.modules.embedding_configs import (
    CountBasedEvictionPolicy,
    CountTimestampMixedEvictionPolicy,
    FeatureL2NormBasedEvictionPolicy,
    FeatureScoreBasedEvictionPolicy,
    NoEvictionPolicy,
    TimestampBasedEvictionPolicy,
)

from apps.dlrm.data import CONFIG_KINDS
from apps.dlrm.errors import ConfigError
from apps.dlrm.placement import LargeTables
from torchrec_mtrains.cache.policies import (
    DEFAULT_POLICY,
    fbgemm_cache_algorithm,
    registered_policy,
)
from torchrec_mtrains.distributed.options import BoundsCheck
from torchrec_mtrains.distributed.runtime import DEVICE_CHOICES, parse_duration
from torchrec_mtrains.malloc import check_trim_threshold
from torchrec_mtrains.planner import HostTopology, PlannerConfig, topology_from_config
from torchrec_mtrains.planner.sizes import parse_size

__all__ = [
    "CONF_DIR",
    "AppConfig",
    "ModelConfig",
    "PipelineConfig",
    "RunConfig",
    "SizeRulePlannerConfig",
    "VirtualTablesConfig",
    "check_keys",
    "register_configs",
    "to_app_config",
]

CONF_DIR = str(Path(__file__).resolve().parents[2] / "conf")
"""The app's Hydra config directory (``conf/`` of the repository)."""

_T = TypeVar("_T")


def _check_count(
    key: str, value: int | None, minimum: int, meaning: str = "", *, nullable: bool = False
) -> None:
    """Refuses a count option ``key`` that is not a whole number >= ``minimum`` (or null,
    where ``nullable``); ``meaning`` replaces the generic hint."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        hint = meaning or f"give a whole number >= {minimum}{', or null' if nullable else ''}"
        raise ConfigError(f"{key}={value!r}: {hint}")


def _parsed(parse: Callable[[Any, str], _T], value: Any, key: str) -> _T:
    """``parse(value, key)`` (the library's parsers of sizes and durations, whose errors name
    ``key`` and what they read), its ``ValueError`` as a :class:`ConfigError`."""
    try:
        return parse(value, key)
    except ValueError as e:
        raise ConfigError(str(e)) from None


@dataclass
class RunConfig:
    """``run``: the training loop, its outputs and its devices (values: ``conf/config.yaml``).
    Checked as it is made; :attr:`collective_timeout_duration` and :attr:`bounds_check_rule`
    give ``collective_timeout`` and ``bounds_check`` typed."""

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
    malloc_trim_threshold: str | None = MISSING

    def __post_init__(self) -> None:
        _check_count("run.steps", self.steps, 0, nullable=True)
        _check_count("run.epochs", self.epochs, 1, nullable=True)
        if self.steps is None and self.epochs is None:
            raise ConfigError(
                "run.steps=null and run.epochs=null: the run would never end; set run.epochs "
                "(passes over the training data) or run.steps (steps in all)"
            )
        _check_count("run.eval_batches", self.eval_batches, 0, nullable=True)
        _check_count("run.keep_checkpoints", self.keep_checkpoints, 1, nullable=True)
        _check_count("run.full_checkpoint_every", self.full_checkpoint_every, 1)
        _check_count(
            "run.checkpoint_every",
            self.checkpoint_every,
            0,
            "give a whole number >= 0 (0 = only at the end)",
        )
        _check_count("run.log_every", self.log_every, 1)
        _check_count(
            "run.num_threads",
            self.num_threads,
            0,
            "give a whole number >= 0 (0 = torch's default, one per core)",
        )
        if not (self.learning_rate >= 0 and math.isfinite(self.learning_rate)):
            raise ConfigError(f"run.learning_rate={self.learning_rate!r}: give a finite rate >= 0")
        if not (self.progress_every_s > 0 and math.isfinite(self.progress_every_s)):
            raise ConfigError(
                f"run.progress_every_s={self.progress_every_s}: must be positive seconds"
            )
        if self.device not in DEVICE_CHOICES:
            raise ConfigError(
                f"run.device={self.device!r}: expected one of {', '.join(DEVICE_CHOICES)}"
            )
        # Parsed here, so that a bad value stops the config; the properties give them typed.
        _ = (self.collective_timeout_duration, self.bounds_check_rule, self.malloc_trim_bytes)

    @property
    def collective_timeout_duration(self) -> timedelta:
        """``collective_timeout`` as a duration (90s, 5min; a bare number is seconds)."""
        return _parsed(parse_duration, self.collective_timeout, "run.collective_timeout")

    @property
    def malloc_trim_bytes(self) -> int | None:
        """``malloc_trim_threshold`` in bytes (``None``: glibc's own settings), checked as
        :func:`~torchrec_mtrains.malloc.reuse_freed_memory` takes it."""
        if self.malloc_trim_threshold is None:
            return None
        key = "run.malloc_trim_threshold"
        size = _parsed(parse_size, self.malloc_trim_threshold, key)
        try:
            check_trim_threshold(size)
        except ValueError:
            raise ConfigError(
                f"{key}={self.malloc_trim_threshold!r}: give a size in [1MiB, 2GiB), or null "
                "for the C library's own settings"
            ) from None
        return size

    @property
    def bounds_check_rule(self) -> BoundsCheck:
        """``bounds_check``: what a batch with an id outside its table does, for every table
        (``error``: the run stops naming the table, the feature and the id; ``warn``:
        TorchRec's default, a warning and row 0 looked up instead)."""
        try:
            return BoundsCheck.parse(self.bounds_check)
        except ValueError:
            allowed = ", ".join(m.value for m in BoundsCheck)
            raise ConfigError(
                f"run.bounds_check={self.bounds_check!r}: expected one of {allowed} (error stops "
                "the run at a batch holding an id outside its table; warn looks up row 0 "
                "instead, as TorchRec does)"
            ) from None


EVICTION_POLICIES = {
    "none": NoEvictionPolicy,
    "count": CountBasedEvictionPolicy,
    "ttl": TimestampBasedEvictionPolicy,
    "mixed": CountTimestampMixedEvictionPolicy,
    "l2": FeatureL2NormBasedEvictionPolicy,
    "score": FeatureScoreBasedEvictionPolicy,
}
"""``model.virtual.eviction`` -> the TorchRec policy it configures."""


@dataclass
class VirtualTablesConfig:
    """``model.virtual``: tables whose ids are raw, up to their ``num_embeddings_per_feature``
    entry (e.g. 2**40), made into rows on first use and evicted by TorchRec's policies
    (``use_virtual_table=True``; see docs/virtual_tables.md). Only the tiered planner places
    them.

    Attributes:
        features: the sparse features (indices) whose tables are virtual.
        max_live_rows: the most ids each holds at once (one value, or one per feature in
            ``features``): it sizes the table's store, cache and id map, as
            ``planner.max_live_rows.<table>`` does (which wins where both are set).
        total_num_buckets: TorchRec's buckets of the id space, which row-wise shards hold
            whole (null: the tables are planned table-wise).
        eviction: none, count, ttl, mixed, l2 or score (TorchRec's
            ``CountBasedEvictionPolicy``, ``TimestampBasedEvictionPolicy``,
            ``CountTimestampMixedEvictionPolicy``, ``FeatureL2NormBasedEvictionPolicy``,
            ``FeatureScoreBasedEvictionPolicy`` with auto collection, every value scoring 1:
            a round keeps the ``keep_count`` ids scored highest, their decayed uses, ties to
            the most lately used; ``NoEvictionPolicy``).
        trigger_count: a round runs before a batch once a table holds more ids than this
            (TorchRec's ``training_id_eviction_trigger_count``; 0: only when a batch's new ids
            do not fit).
        threshold: count and mixed: a decayed count below it goes; l2: a weight norm below it.
        decay_rate: count, mixed and score: each round multiplies every count (score) by it.
        ttl_mins: ttl and mixed: ids last trained longer ago than this go.
        keep_count: score: the ids a round keeps, per table shard (TorchRec's
            ``training_id_keep_count``).
    """

    features: list[int] = field(default_factory=list)
    max_live_rows: list[int] = field(default_factory=list)
    total_num_buckets: int | None = None
    eviction: str = "count"
    trigger_count: int = 0
    threshold: float = 1.0
    decay_rate: float = 0.5
    ttl_mins: int = 0
    keep_count: int = 0

    def check(self, sizes: list[int]) -> None:
        """Refuses features, bounds or a policy that do not fit the model's ``sizes``."""
        features = list(self.features)
        bad = [f for f in features if isinstance(f, bool) or not 0 <= f < len(sizes)]
        if bad or len(set(features)) != len(features):
            raise ConfigError(
                f"model.virtual.features={features}: give distinct indices of sparse features "
                f"(0 to {len(sizes) - 1})"
            )
        if not features:
            return
        bounds = list(self.max_live_rows)
        if len(bounds) not in (1, len(features)) or any(b < 1 for b in bounds):
            raise ConfigError(
                f"model.virtual.max_live_rows={bounds}: give the most ids a virtual table holds "
                f"at once (>= 1), one for all or one per feature in model.virtual.features"
            )
        for f, bound in zip(features, self.bounds()):
            if bound > sizes[f]:
                raise ConfigError(
                    f"model.virtual.max_live_rows: {bound} for t_cat_{f} exceeds its id space "
                    f"(model.num_embeddings_per_feature[{f}]={sizes[f]})"
                )
            buckets = self.total_num_buckets
            if buckets is not None and (buckets < 1 or sizes[f] % buckets):
                raise ConfigError(
                    f"model.virtual.total_num_buckets={buckets} must divide t_cat_{f}'s id "
                    f"space (model.num_embeddings_per_feature[{f}]={sizes[f]})"
                )
        if self.eviction not in EVICTION_POLICIES:
            raise ConfigError(
                f"model.virtual.eviction={self.eviction!r}: expected one of "
                f"{', '.join(EVICTION_POLICIES)}"
            )
        _check_count("model.virtual.trigger_count", self.trigger_count, 0)
        _check_count("model.virtual.ttl_mins", self.ttl_mins, 0)
        score = self.eviction == "score"
        _check_count(
            "model.virtual.keep_count",
            self.keep_count,
            1 if score else 0,
            "eviction=score keeps this many ids a table at each round: give a whole number >= 1"
            if score
            else "",
        )
        if not (0.0 < self.decay_rate <= 1.0 and self.threshold >= 0.0):
            raise ConfigError(
                f"model.virtual: decay_rate={self.decay_rate} must be in (0, 1] and "
                f"threshold={self.threshold} >= 0"
            )

    def bounds(self) -> list[int]:
        """``max_live_rows`` per feature of ``features``."""
        bounds = [int(b) for b in self.max_live_rows]
        return bounds * len(self.features) if len(bounds) == 1 else bounds

    def policy(self) -> Any:
        """The TorchRec eviction policy object ``eviction`` and its settings configure."""
        kind = EVICTION_POLICIES[self.eviction]
        if kind is NoEvictionPolicy:
            return NoEvictionPolicy()
        settings: dict[str, Any] = {"training_id_eviction_trigger_count": self.trigger_count}
        if kind in (CountBasedEvictionPolicy, CountTimestampMixedEvictionPolicy):
            settings.update(eviction_threshold=self.threshold, decay_rate=self.decay_rate)
        if kind in (TimestampBasedEvictionPolicy, CountTimestampMixedEvictionPolicy):
            settings.update(eviction_ttl_mins=self.ttl_mins)
        if kind is FeatureL2NormBasedEvictionPolicy:
            settings.update(eviction_threshold=self.threshold)
        if kind is FeatureScoreBasedEvictionPolicy:
            settings.update(
                training_id_keep_count=self.keep_count,
                decay_rate=self.decay_rate,
                enable_auto_feature_score_collection=True,
                feature_score_default_value=1.0,
            )
        return kind(**settings)


@dataclass
class ModelConfig:
    """``model``: the DLRM's shape (``conf/model/*.yaml``). The optional per-table lists are
    what-if inputs: ``embedding_dims`` (else ``embedding_dim`` for all), ``pooling_factors``
    and ``zipf_exponents`` (else the data's, or the planner's defaults). ``virtual``: the
    tables whose ids are raw (:class:`VirtualTablesConfig`; none by default)."""

    embedding_dim: int = MISSING
    dense_arch_layer_sizes: list[int] = MISSING
    over_arch_layer_sizes: list[int] = MISSING
    num_embeddings_per_feature: list[int] = MISSING
    embedding_dims: list[int] | None = None
    pooling_factors: list[float] | None = None
    zipf_exponents: list[float] | None = None
    virtual: VirtualTablesConfig = field(default_factory=VirtualTablesConfig)

    def __post_init__(self) -> None:
        _check_count("model.embedding_dim", self.embedding_dim, 1)
        sizes = list(self.num_embeddings_per_feature)
        if not sizes:
            raise ConfigError(
                "model.num_embeddings_per_feature=[]: give the rows of each table, one per "
                "sparse feature"
            )
        if any(n < 1 for n in sizes):
            raise ConfigError(
                f"model.num_embeddings_per_feature={sizes}: every table needs >= 1 row"
            )
        dim = self.embedding_dim
        dense = list(self.dense_arch_layer_sizes)
        if not dense or dense[-1] != dim:
            raise ConfigError(
                f"model.dense_arch_layer_sizes={dense} must end in model.embedding_dim={dim}: "
                "the dense output is combined with the embeddings"
            )
        over = list(self.over_arch_layer_sizes)
        if not over or over[-1] != 1:
            raise ConfigError(f"model.over_arch_layer_sizes={over} must end in 1 (the click logit)")
        for key in ("embedding_dims", "pooling_factors", "zipf_exponents"):
            values = getattr(self, key)
            if values is not None and len(values) not in (1, len(sizes)):
                raise ConfigError(
                    f"model.{key} has {len(values)} entries; give one per table "
                    f"({len(sizes)}) or one"
                )
        self.virtual.check(sizes)


@dataclass
class PipelineConfig:
    """``pipeline``: batches whose rows the tiers fetch ahead of the running one (0 = the
    plain loop), and batches a background thread builds ahead of the loop (0 = inline)."""

    lookahead: int = MISSING
    read_ahead: int = MISSING

    def __post_init__(self) -> None:
        _check_count(
            "pipeline.lookahead",
            self.lookahead,
            0,
            "give the number of batches to prefetch ahead of the running one (0 = the plain "
            "training loop, no look-ahead)",
        )
        _check_count(
            "pipeline.read_ahead",
            self.read_ahead,
            0,
            "give the number of batches a background thread builds ahead of the training loop "
            "(0 = built on the training thread)",
        )


@dataclass
class SizeRulePlannerConfig:
    """``planner=size_rule``: placement by table size (``conf/planner/size_rule.yaml``).
    Checked as it is made; :attr:`dram_budget_bytes`, :attr:`block_scm_threshold_bytes` and
    :attr:`large_tables_choice` give the sizes and the choice typed. ``cache_policy`` defaults
    to the library's one default (:data:`~torchrec_mtrains.cache.policies.DEFAULT_POLICY`)."""

    name: str = "size_rule"
    dram_budget: str = MISSING
    block_scm_min_bytes: str = MISSING
    cache_load_factor: float = MISSING
    cache_policy: str = DEFAULT_POLICY
    large_tables: str = MISSING  # apps.dlrm.placement.LargeTables: tiered or uvm_caching

    def __post_init__(self) -> None:
        # Parsed here, so that a bad value stops the config; the properties give them typed.
        _ = (self.dram_budget_bytes, self.block_scm_threshold_bytes, self.large_tables_choice)
        if not 0.0 < self.cache_load_factor <= 1.0:  # worded as the library's tables word it
            raise ValueError(f"cache_load_factor must be in (0, 1], got {self.cache_load_factor}")
        registered_policy(self.cache_policy, "cache_policy")
        if self.large_tables_choice == LargeTables.UVM_CACHING:
            try:
                fbgemm_cache_algorithm(self.cache_policy)
            except ValueError as e:
                raise ConfigError(
                    f"planner.large_tables=uvm_caching with planner.cache_policy="
                    f"{self.cache_policy!r}: {e}. Give one of those, or "
                    "planner.large_tables=tiered (the tiered caches run any registered policy)"
                ) from None

    @property
    def dram_budget_bytes(self) -> int:
        """``dram_budget`` in bytes (per host)."""
        return _parsed(parse_size, self.dram_budget, "planner.dram_budget")

    @property
    def block_scm_threshold_bytes(self) -> int:
        """``block_scm_min_bytes`` in bytes: a tiered table at least this big goes to block SCM."""
        return _parsed(parse_size, self.block_scm_min_bytes, "planner.block_scm_min_bytes")

    @property
    def large_tables_choice(self) -> LargeTables:
        """``large_tables``: where the tables past ``dram_budget`` go."""
        try:
            return LargeTables(self.large_tables)
        except ValueError:
            allowed = ", ".join(m.value for m in LargeTables)
            raise ConfigError(
                f"planner.large_tables={self.large_tables!r}: give one of {allowed}"
            ) from None


@dataclass
class AppConfig:
    """The composed config's top level; ``data`` and ``planner`` vary by choice, so their
    group files name their own schema. Built by :func:`to_app_config`, ``data`` is one of
    :data:`~apps.dlrm.data.CONFIG_KINDS`' dataclasses and ``planner`` a
    :class:`~torchrec_mtrains.planner.PlannerConfig` or :class:`SizeRulePlannerConfig` (the
    schema says ``Any``: OmegaConf has no unions of dataclasses)."""

    run: RunConfig = MISSING
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
    interpolations resolved and its values checked (the dataclasses' ``__post_init__``). An
    entry point calls it after :func:`check_keys`; everything below takes the typed parts it
    reads.

    Raises:
        ConfigError: a value the node's own check refuses: the app's schemas name the option
            (``run.bounds_check='fatal': ...``), the library's are named by their node
            (``hardware: ranks_per_host must be >= 1, got 0``); or a ``data`` / ``planner``
            group file that names no schema.
    """

    def node(key: str) -> Any:
        try:
            if key == "hardware":  # the library's own conversion, as the torchx component's
                return topology_from_config(cfg.hardware)
            return OmegaConf.to_object(cfg[key])
        except ConfigError:  # the app's schemas: the message names the option
            raise
        except ValueError as e:  # the library's dataclasses (PlannerConfig, HostTopology)
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
