"""The app's model: the DLRM, its sharding plan (size rule or the tiered planner), the tier
storage the plan's tiered tables use, and the optimizers, built from the typed config
(:class:`~apps.dlrm.config.AppConfig`, or the parts of it each function reads)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_training import OptimType
from torchrec.datasets.criteo import CAT_FEATURE_COUNT, INT_FEATURE_COUNT
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import EmbeddingModuleShardingPlan, ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from apps.dlrm.config import AppConfig, ModelConfig, RunConfig, SizeRulePlannerConfig
from apps.dlrm.data import DataConfig, SyntheticDataConfig
from apps.dlrm.errors import ConfigError
from apps.dlrm.placement import format_placements, size_rule_plan
from torchrec_mtrains.distributed import (
    TieredEmbeddingBagCollectionSharder,
    TieredParameterSharding,
    TierStorage,
)
from torchrec_mtrains.distributed.options import BoundsCheck
from torchrec_mtrains.distributed.runtime import local_world_size
from torchrec_mtrains.initializers import IdSeededUniform, RowSeededUniform
from torchrec_mtrains.planner import HostTopology, PlannerConfig, plan_tables
from torchrec_mtrains.planner.presets import detected_gpu, on_compute_device, store_options
from torchrec_mtrains.planner.sizes import format_size
from torchrec_mtrains.planner.types import BufferBudgetError
from torchrec_mtrains.profiler import AccessProfile
from torchrec_mtrains.tiers.base import OpenMode

logger: logging.Logger = logging.getLogger(__name__)

EBC_PATH = "model.sparse_arch.embedding_bag_collection"


def tier_root(hardware: HostTopology, run_dir: Path) -> Path:
    """``hardware.tier_root``, or this run's own ``<run.dir>/tiers`` when the preset leaves it
    unset (so two runs never share tier files by accident)."""
    return Path(hardware.tier_root) if hardware.tier_root else run_dir / "tiers"


def tier_mounts(hardware: HostTopology) -> dict[str, str]:
    """The tiers ``hardware.dirs`` places elsewhere (a PMem or NVMe mount), tier -> directory."""
    return {str(k): str(v) for k, v in hardware.dirs.items() if v}


def build_storage(hardware: HostTopology, run_dir: Path, resume: bool) -> TierStorage:
    """Where the tier files go (``hardware.tier_root`` unless ``hardware.dirs`` names a tier)
    and how the stores are opened: with the hardware topology's figures (``store_options``),
    e.g. ``hardware.block_scm.queue_depth``, the ones the tiered planner plans with.

    A new run creates its files (an existing one is an error); a resumed run opens them and
    creates a missing one, which loading the checkpoint then fills with every row (the
    checkpoint holds them all), so a deleted tier file does not make the run unresumable. Such
    a file is not initialized first: the load writes every row of it."""
    try:
        return TierStorage(
            root=str(tier_root(hardware, run_dir)),
            dirs=tier_mounts(hardware),
            # The planner's figures (block size, queue depth), so the stores run as it assumed.
            tier_options=store_options(hardware),
            open_mode=OpenMode.OPEN_OR_CREATE if resume else OpenMode.CREATE,
            initialize_created=not resume,
        )
    except ValueError as e:
        raise ConfigError(f"hardware: {e}") from None


def sparse_features(data: DataConfig) -> int:
    """Sparse features (tables) per sample: the synthetic source's setting, Criteo's 26."""
    return data.num_sparse_features if isinstance(data, SyntheticDataConfig) else CAT_FEATURE_COUNT


def dense_features(data: DataConfig) -> int:
    """Dense features per sample: the synthetic source's setting, Criteo's 13."""
    return data.num_dense_features if isinstance(data, SyntheticDataConfig) else INT_FEATURE_COUNT


def table_sizes(model: ModelConfig, data: DataConfig) -> list[int]:
    """The model's table sizes, one per sparse feature of the data (the model config checks
    its own values; this is the one check across the two).

    Raises:
        ConfigError: when the model has more or fewer tables than the data has features.
    """
    sizes = list(model.num_embeddings_per_feature)
    features = sparse_features(data)
    if len(sizes) != features:
        raise ConfigError(
            f"model.num_embeddings_per_feature has {len(sizes)} entries but the data has "
            f"{features} sparse features: give one size per feature"
        )
    return sizes


def cache_knob(planner: PlannerConfig | SizeRulePlannerConfig) -> str:
    """The planner option that sizes the caches, and its value, for an error to name."""
    if isinstance(planner, SizeRulePlannerConfig):
        return f"planner.cache_load_factor (now {planner.cache_load_factor})"
    return f"planner.min_cache_factor (now {planner.min_cache_factor})"


def build_model(
    app: AppConfig,
    world_size: int,
    resume: bool,
    device: torch.device,
    before_build: Callable[[EmbeddingModuleShardingPlan, Mapping[str, Sequence[int]]], None]
    | None = None,
) -> tuple[DistributedModelParallel, CombinedOptimizer, str]:
    """The sharded DLRM on ``device`` (tiered tables' rows on their tiers, their caches and
    every other table on ``device``), its combined optimizer and the plan printout.

    ``before_build(plan, hot_rows)`` runs once the plan is made and before any tier file is
    created or opened (the hot rows are each tiered table's pinned ones): checks that can
    refuse the plan belong there, so a refused run leaves no tier file behind.

    ``app`` is the run's typed config (:func:`~apps.dlrm.config.to_app_config` of a composed
    one).
    """
    sizes = table_sizes(app.model, app.data)
    dim = app.model.embedding_dim
    seed = app.run.seed
    # Each row's initial values depend on the seed and the row alone (RowSeededUniform), not
    # on the plan: runs of one model under other plans, budgets or world sizes start alike.
    tables = table_configs(app.model, sizes, dim, seed)
    if app.model.virtual.features and not isinstance(app.planner, PlannerConfig):
        raise ConfigError(
            f"model.virtual.features={list(app.model.virtual.features)}: virtual tables are "
            "placed by the tiered planner only; pass planner=tiered (or another tiered preset)"
        )
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    model = DLRMTrain(
        DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=dense_features(app.data),
            dense_arch_layer_sizes=list(app.model.dense_arch_layer_sizes),
            over_arch_layer_sizes=list(app.model.over_arch_layer_sizes),
            dense_device=device,
        )
    )
    lr = app.run.learning_rate
    planner = app.planner
    tiered_planner = isinstance(planner, PlannerConfig)
    sharder = TieredEmbeddingBagCollectionSharder(
        build_storage(app.hardware, Path(app.run.dir), resume),
        offer_tiered_kernel=tiered_planner,
        fused_params={"optimizer": OptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": lr},
        bounds_check=app.run.bounds_check_rule,
    )
    try:
        if tiered_planner:
            plan, plan_text = tiered_plan(app, ebc, sharder, world_size, device)
        else:
            # Budgets are per host, as the tiered planner's are.
            hosts = -(-world_size // max(1, min(world_size, local_world_size())))
            plan, placements = size_rule_plan(
                ebc,
                sharder,
                world_size,
                dram_budget=planner.dram_budget_bytes * hosts,
                block_scm_min_bytes=planner.block_scm_threshold_bytes,
                cache_load_factor=planner.cache_load_factor,
                cache_policy=planner.cache_policy,
                device_type=device.type,
                large_tables=planner.large_tables_choice,
            )
            plan_text = format_placements(placements)
    except ConfigError:
        raise
    except PlannerError as e:  # nothing fits: name the tiers that overflow and the knobs
        over = [" ".join(line.split()) for line in str(e).splitlines() if "OVER" in line]
        raise ConfigError(
            f"planner: the tables fit no placement on {world_size} rank(s): "
            f"{'; '.join(over) or str(e).splitlines()[0]} (tier, rank, demand, capacity). "
            f"Raise planner.dram_budget (now {planner.dram_budget or 'the hardware'}) "
            "or planner.byte_scm_budget, pick a hardware preset with more memory, add ranks, "
            "or shrink model.num_embeddings_per_feature."
        ) from None
    except BufferBudgetError as e:
        block_scm = app.hardware.block_scm
        max_pass_bytes = block_scm.max_pass_bytes if block_scm is not None else None
        raise ConfigError(
            f"planner: the block tier's I/O buffers ({format_size(e.held)} a rank: "
            f"hardware.block_scm.max_pass_bytes={max_pass_bytes}, two "
            f"passes) leave no DRAM for tables ({format_size(e.dram)} a rank). Raise "
            f"planner.dram_budget (now {planner.dram_budget or 'the hardware'}) or "
            "lower hardware.block_scm.max_pass_bytes."
        ) from None
    except ValueError as e:  # the options' own checks
        raise ConfigError(f"planner: {e}") from None
    if before_build is not None:
        before_build(plan, dict(sharder.hot_rows or {}))
    dmp = DistributedModelParallel(
        model,
        device=device,
        plan=ShardingPlan({EBC_PATH: plan}),
        sharders=[sharder],
    )
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=lr),
    )
    optimizer = CombinedOptimizer([dmp.fused_optimizer, dense])
    return dmp, optimizer, plan_text


def table_configs(
    model: ModelConfig, sizes: Sequence[int], dim: int, seed: int
) -> list[EmbeddingBagConfig]:
    """The DLRM's tables, one per sparse feature: ``t_cat_<i>`` of ``sizes[i]`` rows, each
    row's initial values a function of the seed and the row alone (``RowSeededUniform``), so
    runs of one model under other plans, budgets or world sizes start alike. A virtual table
    (``model.virtual.features``) has ``sizes[i]`` ids and makes an id's row from the id alone
    (``IdSeededUniform``), in ``±sqrt(1 / max_live_rows)``: TorchRec's range for a table of
    that many rows (its default for the id space, ``±sqrt(1 / 2**40)``, would start every
    row at zero)."""
    virtual = model.virtual
    bounds = dict(zip(virtual.features, virtual.bounds()))
    tables = []
    for i, n in enumerate(sizes):
        extra: dict[str, Any] = {}
        if i in bounds:
            scale = math.sqrt(1.0 / bounds[i])
            extra = dict(
                init_fn=IdSeededUniform(seed=seed * 1000 + i, dim=dim, low=-scale, high=scale),
                use_virtual_table=True,
                total_num_buckets=virtual.total_num_buckets,
                virtual_table_eviction_policy=virtual.policy(),
            )
        else:
            scale = math.sqrt(1.0 / n)
            extra["init_fn"] = RowSeededUniform(
                seed=seed * 1000 + i, dim=dim, low=-scale, high=scale
            )
        tables.append(
            EmbeddingBagConfig(
                name=f"t_cat_{i}",
                embedding_dim=dim,
                num_embeddings=n,
                feature_names=[f"cat_{i}"],
                **extra,
            )
        )
    return tables


def virtual_bounds(model: ModelConfig) -> dict[str, int]:
    """``model.virtual.max_live_rows`` by table name."""
    virtual = model.virtual
    return {f"t_cat_{f}": bound for f, bound in zip(virtual.features, virtual.bounds())}


def check_batch_ids(
    run: RunConfig, model: ModelConfig, data: DataConfig, features: KeyedJaggedTensor, what: str
) -> None:
    """Refuses a batch (the first one, checked before any tier file exists) holding an id
    outside its table, naming the feature, the table and the options that disagree; with
    ``run.bounds_check=warn`` such ids are looked up as row 0 instead, so nothing is refused.

    Raises:
        ConfigError: for the first such feature.
    """
    if run.bounds_check_rule is BoundsCheck.WARN:
        return
    sizes = [int(n) for n in model.num_embeddings_per_feature]
    values, offsets = features.values(), features.offset_per_key()
    for i, key in enumerate(features.keys()):
        index = int(key.rsplit("_", 1)[-1]) if key.rsplit("_", 1)[-1].isdigit() else i
        if offsets[i] == offsets[i + 1] or index >= len(sizes):
            continue
        ids = values[offsets[i] : offsets[i + 1]]
        lo, hi = int(ids.min()), int(ids.max())
        if lo >= 0 and hi < sizes[index]:
            continue
        data_sizes = list(data.num_embeddings_per_feature)
        data_note = (
            f" while data.num_embeddings_per_feature={data_sizes}" if data_sizes != sizes else ""
        )
        raise ConfigError(
            f"{what} holds row id {lo if lo < 0 else hi} for feature {key!r}, outside table "
            f"t_cat_{index}'s {sizes[index]} rows (model.num_embeddings_per_feature[{index}]="
            f"{sizes[index]}{data_note}): make the data's ids fit the model's tables (data "
            f"kind {data.kind}), give the tables as many rows as the data has, or pass "
            "run.bounds_check=warn to look such ids up as row 0, as TorchRec does."
        )


def check_cache_sizes(
    planner: PlannerConfig | SizeRulePlannerConfig,
    data: DataConfig,
    plan: EmbeddingModuleShardingPlan,
    features: KeyedJaggedTensor,
    hot_rows: Mapping[str, Sequence[int]],
) -> None:
    """Refuses a plan whose cache of a tiered table shard cannot hold the distinct rows a
    batch (this rank's first, so at least as many as training will need) asks of it besides
    its pinned rows: training would fail on the first step, after the tier files exist.

    Raises:
        ConfigError: naming the table, both sizes and the options to change.
    """
    ids_of: dict[str, torch.Tensor] = {}
    values, offsets = features.values(), features.offset_per_key()
    for i, key in enumerate(features.keys()):
        ids_of[f"t_{key}"] = values[offsets[i] : offsets[i + 1]]
    for name, ps in plan.items():
        if not isinstance(ps, TieredParameterSharding) or name not in ids_of:
            continue
        ids = torch.unique(ids_of[name].to(torch.int64))
        for shard in getattr(ps.sharding_spec, "shards", None) or []:
            start, rows = int(shard.shard_offsets[0]), int(shard.shard_sizes[0])
            mine = ids[(ids >= start) & (ids < start + rows)]
            pinned = sum(1 for r in hot_rows.get(name, ()) if start <= r < start + rows)
            room = ps.tier_options.cache_rows(rows)
            if int(mine.numel()) + pinned <= room:
                continue
            raise ConfigError(
                f"table {name!r}: its cache of {room} rows cannot hold the first batch's "
                f"{int(mine.numel())} distinct rows{f' besides {pinned} pinned' if pinned else ''}"
                f" (found before creating any tier file). Raise {cache_knob(planner)} or lower "
                f"data.batch_size (now {data.batch_size})."
            )


def tiered_plan(
    app: AppConfig,
    ebc: EmbeddingBagCollection,
    sharder: TieredEmbeddingBagCollectionSharder,
    world_size: int,
    device: torch.device,
) -> tuple[Any, str]:
    """The profile-driven planner's plan, and the profile's hot rows pinned in the caches of
    the tables it put on a tier (up to an eighth of each cache)."""
    config: PlannerConfig = app.planner
    # The look-ahead pipeline keeps lookahead + 1 batches resident at once and overlaps tier
    # I/O with compute: the planner must size caches and estimate step time for that.
    config = config.for_lookahead(app.pipeline.lookahead)
    # Virtual tables' bounds: the model's, unless planner.max_live_rows names the table.
    config = dataclasses.replace(
        config, max_live_rows={**virtual_bounds(app.model), **config.max_live_rows}
    )
    profile = AccessProfile.from_json(config.profile) if config.profile else None
    local = min(world_size, local_world_size())
    topology = app.hardware
    gpu = detected_gpu(local) if device.type == "cuda" and topology.gpu is None else None
    topology = on_compute_device(topology, device.type, gpu)
    table_plan = plan_tables(
        ebc,
        topology,
        world_size,
        app.data.batch_size,
        profile,
        sharder,
        local_world_size=local,
        config=config,
        poolings=_poolings(app.model, app.data, [c.name for c in ebc.embedding_bag_configs()]),
    )
    if profile is not None and config.pin_hot_rows:
        rows = {c.name: c.num_embeddings for c in ebc.embedding_bag_configs()}
        hot: dict[str, list[int]] = {}
        for name, ps in table_plan.plan.items():
            if not isinstance(ps, TieredParameterSharding) or name not in profile:
                continue
            if ps.tier_options.max_live_rows is not None:
                continue  # a virtual table's hot ids get rows when first trained, not pinned
            shards = max(1, len(ps.ranks or [0]))
            room = ps.tier_options.cache_rows(rows[name] // shards) // 8
            hot[name] = list(profile[name].hot_rows[:room])
        sharder.hot_rows = hot
    return table_plan.plan, str(table_plan.summary)


def pooling_factors(model: ModelConfig, data: DataConfig) -> list[float]:
    """Ids per sample the planner assumes where no profile says: ``model.pooling_factors``,
    else the data's ``data.pooling_factors`` (one value for all tables, or one per table)."""
    data_factors = data.pooling_factors if isinstance(data, SyntheticDataConfig) else None
    found = model.pooling_factors or data_factors
    return [float(v) for v in found or []]


def _poolings(model: ModelConfig, data: DataConfig, names: list[str]) -> dict[str, float]:
    """:func:`pooling_factors` by table name; none if unset or of the wrong length."""
    values = pooling_factors(model, data)
    if len(values) == 1:
        values *= len(names)
    return dict(zip(names, values)) if len(values) == len(names) else {}
