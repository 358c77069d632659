"""Per-step numbers of the look-ahead pipeline, read off the tiered kernels' counters.

Look-ahead exists to hide tier latency, so what matters per step is how long training still
waited for rows (``stall``) against how long the rows took to move (``prefetch_io``): with the
I/O hidden, stall stays near zero while prefetch I/O does not.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields

from torch import nn

from torchrec_mtrains.distributed.tier_io import TierIOCounters
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup, tiered_groups


@dataclass(frozen=True)
class TierSnapshot:
    """Cumulative tier counters of a whole model (every tiered kernel on this rank)."""

    io: TierIOCounters
    lookups: int
    hits: int

    def __sub__(self, other: TierSnapshot) -> TierSnapshot:
        return TierSnapshot(
            self.io - other.io, self.lookups - other.lookups, self.hits - other.hits
        )


@dataclass(frozen=True)
class StepStats:
    """One training step of the pipeline (or the sum of several: see :meth:`__add__`).

    Attributes:
        steps: how many steps these numbers cover (1 for a single step).
        seconds: wall time of the step(s): forward, backward, optimizer and the look-ahead work.
        stall_seconds: time the training thread was blocked on tier I/O (waiting for rows).
        prefetch_io_seconds: time the tier worker spent moving rows (write-backs + reads); it
            overlaps training, so it may exceed ``seconds - stall_seconds``.
        rows_fetched: rows read from the tiers for the batches planned in the step(s) (with
            look-ahead, the batch ``k`` steps ahead).
        rows_written_back: dirty rows those batches evicted, written to the tiers.
        lookups / hits: unique rows planned and those already cached, for the same batches.
    """

    steps: int = 0
    seconds: float = 0.0
    stall_seconds: float = 0.0
    prefetch_io_seconds: float = 0.0
    rows_fetched: int = 0
    rows_written_back: int = 0
    lookups: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def stall_share(self) -> float:
        """Fraction of step time spent waiting for rows (the project targets <= 0.10)."""
        return self.stall_seconds / self.seconds if self.seconds > 0 else 0.0

    def __add__(self, other: StepStats) -> StepStats:
        return StepStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    @classmethod
    def between(cls, before: TierSnapshot, after: TierSnapshot, seconds: float) -> StepStats:
        delta = after - before
        return cls(
            steps=1,
            seconds=seconds,
            stall_seconds=delta.io.stall_seconds,
            prefetch_io_seconds=delta.io.io_seconds,
            rows_fetched=delta.io.rows_fetched,
            rows_written_back=delta.io.rows_written_back,
            lookups=delta.lookups,
            hits=delta.hits,
        )

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {k: float(v) for k, v in asdict(self).items()}
        out["hit_rate"] = self.hit_rate
        out["stall_share"] = self.stall_share
        return out


def tier_stats(model: nn.Module) -> dict[str, dict[str, float]]:
    """Cache and tier counters of every tiered table shard in ``model`` on this rank, keyed by
    table (``<table>@<row>,<col>`` for shards other than a table's first): hits, misses,
    evictions, write-backs, hit rate, cache and pinned rows, and the tier's ``tier_*`` I/O."""
    out: dict[str, dict[str, float]] = {}
    for group in tiered_groups(model):
        out.update(group.stats())
    return out


def snapshot(groups: Iterable[TieredTableGroup]) -> TierSnapshot:
    """Current cumulative counters summed over ``groups``."""
    io = TierIOCounters()
    lookups = hits = 0
    for group in groups:
        io = io + group.io_counters()
        for shard in group.shards:
            lookups += shard.cache.stats.lookups
            hits += shard.cache.stats.hits
    return TierSnapshot(io, lookups, hits)
