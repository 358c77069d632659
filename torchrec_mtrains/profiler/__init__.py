"""Access profiler: per-table bandwidth need, dedup ratio, hot rows and hit-rate curves (LRU's,
and beside it the row cache's LFU and Belady's optimal MIN under the look-ahead window, and
for ids drawn from a known law the most any policy can expect without knowing the future).

The planner sizes each table's cache and picks its tier from an :class:`AccessProfile`:
``bytes_per_sample`` says how much bandwidth a table needs, ``hit_rate(cache_rows)`` how much of
its traffic a cache of a given size absorbs, ``hot_rows`` / ``access_skew`` what a pinned hot set
(FAE) would hold. Build one with :func:`profile_batches` (or :class:`Profiler` for a stream),
store it with ``to_json``; for a table without one use :func:`uniform_profile`.
"""

from torchrec_mtrains.profiler.online_bound import best_online_hit_rates
from torchrec_mtrains.profiler.plot import plot_profile
from torchrec_mtrains.profiler.profiler import Batch, Profiler, ProfilerConfig, profile_batches
from torchrec_mtrains.profiler.replacement import (
    BatchTrace,
    batch_hits,
    policy_curves,
    policy_hit_rates,
)
from torchrec_mtrains.profiler.stack_distance import (
    COLD,
    ShardsSampler,
    batch_stack_distances,
    hit_rate_curve,
    hit_rates,
    shards_stack_distances,
    weighted_batch_stack_distances,
)
from torchrec_mtrains.profiler.types import (
    PROFILE_VERSION,
    AccessProfile,
    HitRateMethod,
    PolicyCurves,
    ProfileFormatError,
    ProfileSource,
    ReplacementPolicy,
    TableInfo,
    TableProfile,
    uniform_profile,
)

__all__ = [
    "COLD",
    "PROFILE_VERSION",
    "AccessProfile",
    "Batch",
    "BatchTrace",
    "HitRateMethod",
    "PolicyCurves",
    "ProfileFormatError",
    "ProfileSource",
    "Profiler",
    "ProfilerConfig",
    "ReplacementPolicy",
    "ShardsSampler",
    "TableInfo",
    "TableProfile",
    "batch_hits",
    "batch_stack_distances",
    "best_online_hit_rates",
    "hit_rate_curve",
    "hit_rates",
    "plot_profile",
    "policy_curves",
    "policy_hit_rates",
    "profile_batches",
    "shards_stack_distances",
    "uniform_profile",
    "weighted_batch_stack_distances",
]
