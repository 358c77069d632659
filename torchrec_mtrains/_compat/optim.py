"""TorchRec's optimizer internals the library relies on: the optimizer a TorchRec
``OptimizerWrapper`` (warm-up, gradient clipping, ...) wraps, which checkpoints walk to."""

from __future__ import annotations

from typing import cast

from torchrec.optim.keyed import KeyedOptimizer, OptimizerWrapper

from torchrec_mtrains._compat.registry import Use, declare, private_attr, reaches

WRAPPED_OPTIMIZER = declare(
    "torchrec.optim.keyed:OptimizerWrapper",
    "_optimizer",
    Use.READ,
    reaches="the KeyedOptimizer an OptimizerWrapper (and its subclasses) wraps and delegates to.",
    breaks="a checkpoint load cannot find the optimizers behind a wrapper, so those that build "
    "their state on their first step (Adam) are not given one first and load none.",
)


@reaches(WRAPPED_OPTIMIZER)
def wrapped_optimizer(wrapper: OptimizerWrapper) -> KeyedOptimizer:
    """The optimizer ``wrapper`` wraps."""
    return cast(KeyedOptimizer, private_attr(wrapper, WRAPPED_OPTIMIZER))
