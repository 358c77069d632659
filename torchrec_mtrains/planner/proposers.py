"""Proposes placements: fastest first, then the cheapest demotions until the tiers fit, then
demotions that shorten the step, then splits of the busiest rank's heaviest table while they
shorten the step.

TorchRec's proposers search combinations of options rated by its estimators; with five
placements per table, continuous cache sizes and capacities TorchRec's ``Storage`` cannot hold,
a greedy walk over our own estimates is both cheaper and explainable:

1. every table starts on its fastest placement among those whose every shard fits a rank;
2. while the partitioner fails, find the tier with the highest demand / capacity over all
   ranks and move one table to a slower placement that frees bytes there, the one losing the
   least step time per byte freed (e.g. a large, rarely read table goes from DRAM to block SCM
   before a hot one leaves HBM);
3. once a plan fits, try demoting each table further (largest on the most pressed tier
   first) and keep a demotion when the rated step time drops: the bytes it frees grow the
   other tables' caches (the partitioner sizes them), so a plan that keeps fewer tables whole
   in DRAM can be faster. The first fitting plan stops at the first table that makes the
   tiers fit, which with more DRAM can leave the remaining big tables with tiny caches;
4. then try the split (row- or column-wise) of the heaviest table-wise table on the slowest
   rank; keep it if the plan's step time drops, up to ``balance_rounds`` times.

TorchRec's planner keeps the best-rated plan of all that partitioned.
"""

from __future__ import annotations

import logging
from collections import defaultdict

from torchrec.distributed.planner.types import (
    Enumerator,
    PartitionByType,
    Proposer,
    ShardingOption,
    Topology,
)

from torchrec_mtrains.planner.partitioners import rank_critical, rank_step_times
from torchrec_mtrains.planner.types import PlanningContext, TieredShardingOption
from torchrec_mtrains.types import Tier

logger = logging.getLogger(__name__)

__all__ = ["TierDemotionProposer"]


class TierDemotionProposer(Proposer):
    """Greedy demotion, then balancing (see the module docstring).

    Args:
        context: the planning context (capacities per rank).
    """

    def __init__(self, context: PlanningContext) -> None:
        self.context = context
        self._tables: list[str] = []
        self._options: dict[str, list[TieredShardingOption]] = {}
        self._choice: dict[str, int] = {}
        self._pending = False
        self._done = True
        self._phase = "fit"  # then "improve", then "balance"
        self._queue: list[str] = []
        self._rounds = 0
        self._best: float | None = None
        self._best_options: list[ShardingOption] | None = None
        self._last_move: tuple[str, int] | None = None
        self._tried: set[str] = set()

    # ------------------------------------------------------------------------------ helpers

    def _time(self, option: TieredShardingOption) -> float:
        return option.critical_time(self.context.config.overlap_tier_io)

    def _shards_fit(self, option: TieredShardingOption) -> bool:
        return all(
            nbytes <= self.context.capacity(tier)
            for demand in option.demands
            for tier, nbytes in demand.items()
        )

    def _current(self) -> list[TieredShardingOption]:
        return [self._options[t][self._choice[t]] for t in self._tables]

    def _pressure(self) -> list[Tier]:
        """Tiers by demand / capacity over all ranks, most pressed first."""
        demand: dict[Tier, int] = defaultdict(int)
        for option in self._current():
            for tier, nbytes in option.total_demand().items():
                demand[tier] += nbytes

        def ratio(tier: Tier) -> float:
            cap = self.context.capacity(tier) * self.context.world_size
            return demand[tier] / cap if cap else float("inf")

        return sorted((t for t in demand if demand[t] > 0), key=ratio, reverse=True)

    def _demote(self) -> bool:
        """Moves one table to a slower placement freeing the most pressed tier's bytes at the
        least step time per byte; returns False when no move frees anything. Placements whose
        shards fit a rank come first; when none is left, ones that do not (so that a failure is
        reported for the most compact placement tried)."""
        for only_fitting in (True, False):
            for tier in self._pressure():
                best: tuple[float, str, int] | None = None
                for table in self._tables:
                    options = self._options[table]
                    cur = options[self._choice[table]]
                    cur_bytes = cur.total_demand().get(tier, 0)
                    if cur_bytes == 0:
                        continue
                    for k in range(self._choice[table] + 1, len(options)):
                        alt = options[k]
                        if only_fitting and not self._shards_fit(alt):
                            continue
                        freed = cur_bytes - alt.total_demand().get(tier, 0)
                        if freed <= 0:
                            continue
                        cost = max(0.0, self._time(alt) - self._time(cur)) / freed
                        if best is None or cost < best[0]:
                            best = (cost, table, k)
                if best is not None:
                    _, table, k = best
                    logger.debug(
                        "%s over capacity: %s -> %s",
                        tier.value,
                        self._options[table][self._choice[table]].describe(),
                        self._options[table][k].describe(),
                    )
                    self._choice[table] = k
                    return True
        return False

    def _cheapest_demotion(self, table: str) -> int | None:
        """The slower placement of ``table`` that frees bytes on the most pressed tier it
        uses at the least step time per byte (fitting a rank), or None."""
        options = self._options[table]
        cur = options[self._choice[table]]
        for tier in self._pressure():
            cur_bytes = cur.total_demand().get(tier, 0)
            if cur_bytes == 0:
                continue
            best: tuple[float, int] | None = None
            for k in range(self._choice[table] + 1, len(options)):
                alt = options[k]
                freed = cur_bytes - alt.total_demand().get(tier, 0)
                if freed <= 0 or not self._shards_fit(alt):
                    continue
                cost = max(0.0, self._time(alt) - self._time(cur)) / freed
                if best is None or cost < best[0]:
                    best = (cost, k)
            if best is not None:
                return best[1]
        return None

    def _improvement_order(self) -> list[str]:
        """Tables by their bytes on the most pressed tier, largest first."""
        pressed = self._pressure()
        if not pressed:
            return []
        tier = pressed[0]
        demand = {
            t: self._current()[i].total_demand().get(tier, 0) for i, t in enumerate(self._tables)
        }
        return sorted((t for t in self._tables if demand[t] > 0), key=lambda t: -demand[t])

    def _next_improvement(self) -> bool:
        """Demotes the next queued table (see step 3); False when the queue is used up."""
        while self._queue:
            table = self._queue.pop(0)
            k = self._cheapest_demotion(table)
            if k is not None:
                self._last_move = (table, self._choice[table])
                self._choice[table] = k
                return True
        return False

    def _balance_move(self, plan: list[ShardingOption]) -> bool:
        """Switches the heaviest table-wise table of the slowest rank to its split."""
        if self._rounds >= self.context.config.balance_rounds:
            return False
        times = rank_step_times(plan, self.context)
        slowest = max(range(len(times)), key=lambda r: rank_critical(times[r], self.context))
        heaviest: list[tuple[float, str]] = []
        for option in plan:
            if not isinstance(option, TieredShardingOption):
                continue
            if option.partition_by != PartitionByType.DEVICE.value or option.fqn in self._tried:
                continue
            t = sum(
                st.critical(self.context.config.overlap_tier_io)
                for shard, st in zip(option.shards, option.step_times)
                if shard.rank == slowest
            )
            if t > 0:
                heaviest.append((t, option.fqn))
        for _, table in sorted(heaviest, reverse=True):
            self._tried.add(table)
            cur = self._options[table][self._choice[table]]
            for k, alt in enumerate(self._options[table]):
                if (
                    alt.placement is cur.placement
                    and alt.sharding_type != cur.sharding_type
                    and len(alt.shards) > 1
                    and self._shards_fit(alt)
                ):
                    self._last_move = (table, self._choice[table])
                    self._choice[table] = k
                    self._rounds += 1
                    return True
        return False

    # ----------------------------------------------------------------------- TorchRec API

    def load(
        self, search_space: list[ShardingOption], enumerator: Enumerator | None = None
    ) -> None:
        self._options = {}
        for option in search_space:
            if not isinstance(option, TieredShardingOption):
                raise TypeError(f"{option.name}: expected options from the tiered enumerator")
            self._options.setdefault(option.fqn, []).append(option)
        self._tables = list(self._options)
        for table, options in self._options.items():
            options.sort(key=self._time)
            fitting = [k for k, o in enumerate(options) if self._shards_fit(o)]
            self._choice[table] = fitting[0] if fitting else 0
        self._pending = True
        self._done = not self._tables
        self._phase = "fit"
        self._queue = []
        self._rounds = 0
        self._best = None
        self._best_options = None
        self._last_move = None
        self._tried = set()

    def propose(self) -> list[ShardingOption] | None:
        if self._done or not self._pending:
            return None
        self._pending = False
        return list(self._current())

    def feedback(
        self,
        partitionable: bool,
        plan: list[ShardingOption] | None = None,
        perf_rating: float | None = None,
        storage_constraint: Topology | None = None,
    ) -> None:
        if self._phase == "fit":
            if not partitionable:
                if self._demote():
                    self._pending = True
                else:
                    self._done = True
                return
            self._best, self._best_options = perf_rating, plan
            self._phase = "improve"
            self._queue = self._improvement_order()
        elif (
            partitionable
            and perf_rating is not None
            and (self._best is None or perf_rating < self._best)
        ):
            self._best, self._best_options = perf_rating, plan
            if self._phase == "improve" and self._last_move is not None:
                self._queue.append(self._last_move[0])  # it may go one placement further
        elif self._last_move is not None:  # the move did not help (or did not fit): undo it
            table, k = self._last_move
            self._choice[table] = k
        self._last_move = None
        if self._phase == "improve":
            if self._next_improvement():
                self._pending = True
                return
            self._phase = "balance"
        if self._best_options is not None and self._balance_move(self._best_options):
            self._pending = True
        else:
            self._done = True
