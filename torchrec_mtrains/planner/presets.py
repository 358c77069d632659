"""The hardware presets shipped with the package (``torchrec_mtrains/conf/hardware/*.yaml``), a
hardware config read into a :class:`HostTopology`, the host as the compute device sees it, and the
options the tier stores open with, taken from the host the planner costs (:func:`store_options`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from torchrec_mtrains.tiers import (
    TIERS,
    TierOptions,
    layouts_of,
    placement_options,
)
from torchrec_mtrains.types import Tier

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


from torchrec_mtrains.planner.topology import BlockTierConfig, GpuConfig, HostTopology

logger = logging.getLogger(__name__)

PRESETS_PACKAGE = "torchrec_mtrains.conf"
"""The package whose ``hardware/`` folder holds the presets (a Hydra ``pkg://`` search path)."""


def topology_from_config(node: DictConfig | Mapping[str, Any]) -> HostTopology:
    """Validates a hardware config (e.g. the app's ``cfg.hardware``) against the schema.

    Raises:
        ValueError: naming the offending key for unknown keys, wrong types or invalid values.
    """
    schema = OmegaConf.structured(HostTopology)
    try:
        # Resolve in place first: a node of a composed config (``cfg.hardware``) interpolates
        # keys of its parents (``${run.dir}``), which a detached merge could not see.
        data = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node
        merged = OmegaConf.merge(schema, data)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:  # carries the full key of the offending value
        raise ValueError(f"invalid hardware config: {e}") from None
    if not isinstance(obj, HostTopology):
        raise TypeError(f"hardware config built a {type(obj).__name__}, not HostTopology")
    return obj


def store_options(host: HostTopology) -> dict[str, TierOptions]:
    """The options the tiered kernel opens ``host``'s storage tiers with, tier name -> options
    (for ``TierStorage(tier_options=...)``).

    Each registered tier the host describes gets its options type with the fields it lists as
    ``hardware_fields`` copied from the tier's hardware config (for ``block_scm``: ``block_size``
    and ``queue_depth`` of :class:`BlockTierConfig`), so a store runs with exactly the figures
    the perf model costs its I/O with; other options keep their defaults. A host without a
    block tier still gets ``block_scm`` options (its default layout) with its ``block_size``
    (the size-rule planner places tables on block SCM without a hardware model of it).

    Raises:
        ValueError: when a tier's hardware config lacks a field its options take from it, or
            a value is not valid for the store (naming the tier and the option).
    """
    out: dict[str, TierOptions] = {}
    for tier in host.tiers():
        store_cls = TIERS.get(tier.value)
        if store_cls is None:  # HBM holds caches, not stores
            continue
        config = host.memory(tier)
        if isinstance(config, BlockTierConfig):  # the store of its file layout
            store_cls = layouts_of(tier.value)[config.layout]
        options_type = store_cls.options_type
        missing = [f for f in options_type.hardware_fields if not hasattr(config, f)]
        if missing:
            raise ValueError(
                f"host {host.name!r}: {options_type.__qualname__} takes {', '.join(missing)} "
                f"from the {tier.value} hardware config, which has none"
            )
        out[tier.value] = options_type.from_mapping(
            {f: getattr(config, f) for f in options_type.hardware_fields}
        )
    if host.block_scm is None:
        out[Tier.BLOCK_SCM.value] = placement_options(
            Tier.BLOCK_SCM.value, {"block_size": host.block_size}
        )
    elif host.block_scm.block_size != host.block_size:
        logger.warning(
            "host %r: block_scm.block_size=%d differs from block_size=%d; the block stores use "
            "%d, as the perf model does",
            host.name,
            host.block_scm.block_size,
            host.block_size,
            host.block_scm.block_size,
        )
    return out


def on_compute_device(
    topology: HostTopology, device_type: str, gpu: GpuConfig | None = None
) -> HostTopology:
    """``topology`` as a job computing on ``device_type`` sees it: the device is chosen once,
    per run, and the plan must follow it whatever the preset describes.

    * ``cpu``: a preset's GPUs are dropped (caches in DRAM, TorchRec's kernels on the CPU).
    * ``cuda``: a preset without GPUs gets ``gpu`` (what :func:`detected_gpu` reads off the
      machine), one rank per GPU; a preset with GPUs is kept as it describes them.

    Raises:
        ValueError: for another device type, or CUDA with neither a preset GPU nor ``gpu``.
    """
    if device_type == "cpu":
        return topology if topology.gpu is None else dataclasses.replace(topology, gpu=None)
    if device_type != "cuda":
        raise ValueError(f"compute device {device_type!r}: expected cpu or cuda")
    if topology.gpu is not None:
        return topology
    if gpu is None:
        raise ValueError(
            f"host {topology.name!r} describes no GPU and none was given: pass the GPU "
            "(detected_gpu()) or use a preset with a gpu section"
        )
    logger.info(
        "hardware %r has no gpu section: planning for %d x %s (%s of HBM; bandwidths are the "
        "GpuConfig defaults)",
        topology.name,
        gpu.count,
        gpu.name or "GPU",
        gpu.hbm_capacity,
    )
    return dataclasses.replace(topology, gpu=gpu, ranks_per_host=gpu.count)


def detected_gpu(count: int | None = None) -> GpuConfig:
    """The GPUs of this machine as a :class:`GpuConfig`: ``count`` of them (default: every
    visible one) with the first one's name and memory; other figures keep their defaults."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("no GPU is visible to this process")
    props = torch.cuda.get_device_properties(0)
    return GpuConfig(
        count=count or torch.cuda.device_count(),
        name=str(props.name),
        hbm_capacity=f"{int(props.total_memory)}B",
    )


def _preset_folder() -> Traversable:
    return resources.files(PRESETS_PACKAGE) / "hardware"


def available_presets() -> list[str]:
    """Names of the hardware presets shipped with the package."""
    return sorted(
        p.name.removesuffix(".yaml") for p in _preset_folder().iterdir() if p.name.endswith(".yaml")
    )


def preset_path(name: str) -> Path:
    """The YAML file of preset ``name``.

    Raises:
        ValueError: for an unknown preset, listing the available ones.
    """
    found = _preset_folder() / f"{name}.yaml"
    if not found.is_file():
        raise ValueError(
            f"unknown hardware preset {name!r}; available: {', '.join(available_presets())}"
        )
    return Path(str(found))


def load_topology(name_or_path: str | Path, overrides: Sequence[str] = ()) -> HostTopology:
    """A preset (by name) or a hardware YAML file (by path), with dotted overrides applied.

    Args:
        name_or_path: a preset name (:func:`available_presets`) or the path of a YAML file in
            the presets' format.
        overrides: ``key=value`` strings, with or without the ``hardware.`` prefix the app's
            Hydra overrides carry, e.g. ``["hardware.dram.capacity=64GiB"]``.

    Raises:
        ValueError: for an unknown preset, a missing file, a malformed override or an invalid
            value, naming it.
    """
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = preset_path(str(name_or_path))
    elif not path.is_file():
        raise ValueError(f"hardware file {path} does not exist")
    dotlist = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"hardware override {item!r}: expected key=value")
        dotlist.append(f"{key.removeprefix('hardware.')}={value}")
    try:
        node = OmegaConf.merge(OmegaConf.load(path), OmegaConf.from_dotlist(dotlist))
    except OmegaConfBaseException as e:
        raise ValueError(f"hardware {path}: {e}") from None
    assert isinstance(node, DictConfig)
    return topology_from_config(node)


def register_configs(group: str = "hardware") -> None:
    """Stores the schema in Hydra's ConfigStore as ``<group>/schema``, so a preset can extend it
    with ``defaults: [schema]`` and be type-checked at composition time."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group=group, name="schema", node=HostTopology)
