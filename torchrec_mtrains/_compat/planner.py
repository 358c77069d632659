"""The ``EmbeddingShardingPlanner`` internals the tiered planner relies on: the best plan of its
search, and the reservation share it reports."""

from __future__ import annotations

from torchrec.distributed.planner.planners import EmbeddingShardingPlanner
from torchrec.distributed.planner.types import ShardingOption, StorageReservation

from torchrec_mtrains._compat.registry import Use, declare, private_attr, reaches, set_private_attr

_PLANNERS = "torchrec.distributed.planner.planners"

BEST_PLAN = declare(
    f"{_PLANNERS}:EmbeddingShardingPlanner",
    "_best_plan",
    Use.READ,
    reaches="the sharding options of the best plan ``plan()`` found (its result is built "
    "from them).",
    breaks="the tiered plan cannot carry each table's tier and cache size, nor be summarized.",
)

RESERVATION_PERCENTAGE = declare(
    f"{_PLANNERS}:EmbeddingShardingPlanner",
    "_percentage",
    Use.PROVIDED,
    reaches="the share of storage a reservation set aside, read off the planner's storage "
    "reservation (whatever its class) when it reports a plan or a failure.",
    breaks="a failed plan raises an AttributeError instead of TorchRec's planner error.",
    overridden_in=("torchrec_mtrains.planner.planners:_HostReservation",),
)


@reaches(BEST_PLAN)
def best_plan(planner: EmbeddingShardingPlanner) -> list[ShardingOption]:
    """The options of the best plan ``planner.plan()`` found (call after it)."""
    options: list[ShardingOption] | None = private_attr(planner, BEST_PLAN)
    if options is None:
        raise ValueError(f"{type(planner).__name__} has no best plan: call plan() first")
    return options


@reaches(RESERVATION_PERCENTAGE)
def set_reserved_share(reservation: StorageReservation, share: float) -> None:
    """Sets the share of storage ``reservation`` reports as reserved."""
    set_private_attr(reservation, RESERVATION_PERCENTAGE, share)
