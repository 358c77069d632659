"""The tiered planner: places embedding tables on HBM, DRAM, byte SCM and block SCM and sizes
their caches from measured locality, as TorchRec planner components.

* :mod:`.topology` - one host's memory hierarchy (Hydra structured config; presets shipped
  in ``torchrec_mtrains/conf/hardware``, read by :func:`load_topology`);
* :mod:`.perf_model` - per-step time of a table shard on a placement;
* :mod:`.access` - access statistics from a profile, the uniform fallback, or a Zipf law;
* :mod:`.enumerators`, :mod:`.shard_estimators`, :mod:`.proposers`, :mod:`.partitioners` -
  TorchRec ``Enumerator`` / ``ShardEstimator`` / ``Proposer`` / ``Partitioner`` / ``PerfModel``;
* :mod:`.planners` - :class:`TieredShardingPlanner` and :func:`plan_tables`;
* :mod:`.whatif` - how many hosts of each kind a model needs.
"""

from torchrec_mtrains.planner.access import TableAccess, from_profile, uniform_access, zipf_access
from torchrec_mtrains.planner.perf_model import Placement, ShardWork, StepTime, shard_step_time
from torchrec_mtrains.planner.planners import (
    TablePlan,
    TieredShardingPlanner,
    plan_tables,
    torchrec_topology,
)
from torchrec_mtrains.planner.presets import (
    available_presets,
    load_topology,
    register_configs,
    topology_from_config,
)
from torchrec_mtrains.planner.sizes import parse_size
from torchrec_mtrains.planner.stats import PlanSummary
from torchrec_mtrains.planner.topology import (
    BlockTierConfig,
    CacheManagerConfig,
    ComputeConfig,
    GpuConfig,
    HostTopology,
    MemoryTierConfig,
    NetworkConfig,
)
from torchrec_mtrains.planner.types import (
    PlacementError,
    PlacementReport,
    PlannerConfig,
    PlanningContext,
    TieredShardingOption,
)

__all__ = [
    "BlockTierConfig",
    "CacheManagerConfig",
    "ComputeConfig",
    "GpuConfig",
    "HostTopology",
    "MemoryTierConfig",
    "NetworkConfig",
    "Placement",
    "PlacementError",
    "PlacementReport",
    "PlanSummary",
    "PlannerConfig",
    "PlanningContext",
    "ShardWork",
    "StepTime",
    "TableAccess",
    "TablePlan",
    "TieredShardingOption",
    "TieredShardingPlanner",
    "available_presets",
    "from_profile",
    "load_topology",
    "parse_size",
    "plan_tables",
    "register_configs",
    "shard_step_time",
    "topology_from_config",
    "torchrec_topology",
    "uniform_access",
    "zipf_access",
]
