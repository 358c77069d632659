"""Look-ahead prefetch train pipeline: the rows of upcoming batches are read from their tiers
while the current batch trains (cDLRM), on TorchRec's pipeline machinery."""

from torchrec_mtrains.distributed.tiered_tables import tiered_groups
from torchrec_mtrains.pipeline.lookahead import LookaheadTrainPipeline
from torchrec_mtrains.pipeline.stats import (
    StepStats,
    TierSnapshot,
    snapshot,
    tier_stats,
)

__all__ = [
    "LookaheadTrainPipeline",
    "StepStats",
    "TierSnapshot",
    "snapshot",
    "tier_stats",
    "tiered_groups",
]
