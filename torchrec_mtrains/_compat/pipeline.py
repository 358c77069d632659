"""The ``TrainPipelineSparseDist`` internals the look-ahead pipeline drives: it keeps TorchRec's
model rewrite, batch queue, contexts and input-dist stages and replaces the schedule, so it
calls the steps TorchRec's own ``progress`` calls (:class:`SparseDistInternals`).

Overridden or provided by :class:`~torchrec_mtrains.pipeline.LookaheadTrainPipeline`:
:data:`NEXT_BATCH` (TorchRec's reading of the next batch, which it extends with the host bounds
check) and :data:`PIPELINED_FORWARD_TYPE` (the forward TorchRec's rewrite installs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any, Generic, TypeVar, cast

import torch
from torch import nn
from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist

from torchrec_mtrains._compat.registry import Use, declare, private_attr, reaches

_PIPELINE = "torchrec.distributed.train_pipeline.train_pipelines:TrainPipelineSparseDist"
_LOOKAHEAD = "torchrec_mtrains.pipeline.lookahead:LookaheadTrainPipeline"

In = TypeVar("In")
Out = TypeVar("Out")

NEXT_BATCH = declare(
    _PIPELINE,
    "_next_batch",
    Use.OVERRIDDEN,
    parameters=("self", "dataloader_iter"),
    reaches="reads the next batch from the iterator (``copy_batch_to_gpu`` calls it).",
    breaks="batches are not bounds-checked on the host, so each module checks its device "
    "copy and a CUDA step waits for it.",
    overridden_in=(_LOOKAHEAD,),
)

PIPELINED_FORWARD_TYPE = declare(
    _PIPELINE,
    "_pipelined_forward_type",
    Use.PROVIDED,
    reaches="the class attribute naming the forward TorchRec's model rewrite installs in each "
    "sharded module (``attach`` rewrites with it).",
    breaks="a reattached model gets TorchRec's plain pipelined forward, which ignores the "
    "prefetched input and runs the input dist again.",
    overridden_in=(_LOOKAHEAD,),
)

MODEL = declare(
    _PIPELINE, "_model", Use.READ, reaches="the pipelined model.", breaks="no step can run."
)
OPTIMIZER = declare(
    _PIPELINE,
    "_optimizer",
    Use.READ,
    reaches="the optimizer the pipeline steps.",
    breaks="no step can run.",
)
MODEL_ATTACHED = declare(
    _PIPELINE,
    "_model_attached",
    Use.READ,
    reaches="whether the model's sharded modules run the pipelined forwards.",
    breaks="a detached model is not reattached, and close() cannot restore its forwards.",
)
PIPELINED_MODULES = declare(
    _PIPELINE,
    "_pipelined_modules",
    Use.READ,
    reaches="the sharded modules the rewrite pipelined, whose input dists a step completes.",
    breaks="no batch is handed to the modules' prefetch.",
)
DATA_DIST_STREAM = declare(
    _PIPELINE,
    "_data_dist_stream",
    Use.READ,
    reaches="the side stream the input dist runs on (none on CPU).",
    breaks="prefetches would run on the training stream.",
)
STREAM_CONTEXT = declare(
    _PIPELINE,
    "_stream_context",
    Use.READ,
    reaches="the device module's stream context manager.",
    breaks="prefetches would run on the training stream.",
)
MODEL_FWD = declare(
    _PIPELINE,
    "_model_fwd",
    Use.READ,
    reaches="the model, or the custom forward given, called with a batch.",
    breaks="no forward can run.",
)
BACKWARD = declare(
    _PIPELINE,
    "_backward",
    Use.CALLED,
    parameters=("self", "losses"),
    reaches="the pipeline's backward of a step's losses.",
    breaks="no backward can run.",
)
WAIT_FOR_BATCH = declare(
    _PIPELINE,
    "_wait_for_batch",
    Use.CALLED,
    parameters=("self",),
    reaches="makes the training stream wait for the batch's copy and input dist.",
    breaks="a CUDA forward could read a batch not yet copied.",
)
SET_MODULE_CONTEXT = declare(
    _PIPELINE,
    "_set_module_context",
    Use.CALLED,
    parameters=("self", "context"),
    reaches="points the pipelined forwards at a batch's context.",
    breaks="a forward would take another batch's distributed input.",
)
INIT_PIPELINED_MODULES = declare(
    _PIPELINE,
    "_init_pipelined_modules",
    Use.CALLED,
    parameters=("self", "batch", "context", "pipelined_forward"),
    reaches="rewrites the model on its first batch (tracing needs one) and starts that "
    "batch's input dist.",
    breaks="the model is never pipelined.",
)

PIPELINE_MODEL = declare(
    _PIPELINE,
    "_pipeline_model",
    Use.OVERRIDDEN,
    parameters=("self", "batch", "context", "pipelined_forward"),
    reaches="rewrites the model's sharded modules for the pipeline and replaces the forwards of "
    "their input dists' all-to-alls with ones whose splits exchange is fused across modules "
    "(called on the first batch and by ``attach``).",
    breaks="a one-process group still runs the fused splits exchange, an identity there: "
    "0.5-0.9 ms a step of W3 on the CPU.",
    overridden_in=(_LOOKAHEAD,),
)
ORIGINAL_KJT_DIST_FORWARDS = declare(
    _PIPELINE,
    "_original_kjt_dist_forwards",
    Use.READ,
    reaches="the all-to-alls' own forwards (bound methods) the rewrite replaced, in order.",
    breaks="the all-to-alls of a one-process group keep the fused splits exchange.",
)
KJT_ALL_TO_ALL_PG = declare(
    "torchrec.distributed.dist_data:KJTAllToAll",
    "_pg",
    Use.READ,
    reaches="the process group an input dist's all-to-all runs over.",
    breaks="the all-to-alls of a one-process group keep the fused splits exchange.",
)


@reaches(NEXT_BATCH)
def torchrec_next_batch(
    pipeline: TrainPipelineSparseDist, dataloader_iter: Iterator[In]
) -> In | None:
    """TorchRec's own reading of the next batch (for an override to call first)."""
    next_batch = getattr(TrainPipelineSparseDist, NEXT_BATCH.name)
    return cast(In | None, next_batch(pipeline, dataloader_iter))


class SparseDistInternals(Generic[In, Out]):
    """Typed view of one ``TrainPipelineSparseDist``'s internals, for a subclass that runs its
    own schedule over TorchRec's stages.

    Args:
        pipeline: the pipeline (``self`` of the subclass).
    """

    def __init__(self, pipeline: TrainPipelineSparseDist) -> None:
        self._pipeline = pipeline

    @property
    @reaches(MODEL)
    def model(self) -> nn.Module:
        """The pipelined model."""
        return cast(nn.Module, private_attr(self._pipeline, MODEL))

    @property
    @reaches(OPTIMIZER)
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer the pipeline steps."""
        return cast(torch.optim.Optimizer, private_attr(self._pipeline, OPTIMIZER))

    @property
    @reaches(MODEL_ATTACHED)
    def model_attached(self) -> bool:
        """Whether the model runs the pipelined forwards."""
        return bool(private_attr(self._pipeline, MODEL_ATTACHED))

    @property
    @reaches(PIPELINED_MODULES)
    def pipelined_modules(self) -> list[Any]:
        """The sharded modules the rewrite pipelined."""
        return list(private_attr(self._pipeline, PIPELINED_MODULES))

    @reaches(STREAM_CONTEXT, DATA_DIST_STREAM)
    def on_data_dist_stream(self) -> AbstractContextManager[Any]:
        """A context running its work on the input-dist side stream (none on CPU)."""
        context = private_attr(self._pipeline, STREAM_CONTEXT)
        return cast(
            AbstractContextManager[Any], context(private_attr(self._pipeline, DATA_DIST_STREAM))
        )

    @reaches(MODEL_FWD)
    def model_fwd(self, batch: In | None) -> tuple[torch.Tensor, Out]:
        """The forward of ``batch``: ``(losses, output)``."""
        forward: Callable[[In | None], tuple[torch.Tensor, Out]] = private_attr(
            self._pipeline, MODEL_FWD
        )
        return forward(batch)

    @reaches(BACKWARD)
    def backward(self, losses: torch.Tensor) -> None:
        """The pipeline's backward of ``losses``."""
        private_attr(self._pipeline, BACKWARD)(losses)

    @reaches(WAIT_FOR_BATCH)
    def wait_for_batch(self) -> None:
        """Makes the training stream wait for the next batch's copy and input dist."""
        private_attr(self._pipeline, WAIT_FOR_BATCH)()

    @reaches(SET_MODULE_CONTEXT)
    def set_module_context(self, context: TrainPipelineContext) -> None:
        """Points the pipelined forwards at ``context``."""
        private_attr(self._pipeline, SET_MODULE_CONTEXT)(context)

    @reaches(ORIGINAL_KJT_DIST_FORWARDS, KJT_ALL_TO_ALL_PG)
    def unfuse_lone_input_dists(self) -> int:
        """Gives the input dists' all-to-alls over a one-process group their own forward back,
        after the model rewrite fused their splits exchanges; returns how many.

        Over one process the exchange is an identity, which TorchRec's own forward skips (it
        hands the batch on, as in a model run without the pipeline) but the fused one still
        runs as a collective: a copy, a wait on the backend's thread and the bookkeeping,
        0.5-0.9 ms a step of W3 on the CPU. Groups of two or more keep the fused exchange.
        """
        restored = 0
        for original in private_attr(self._pipeline, ORIGINAL_KJT_DIST_FORWARDS):
            all_to_all = getattr(original, "__self__", None)
            if all_to_all is None:
                continue
            if private_attr(all_to_all, KJT_ALL_TO_ALL_PG).size() == 1:
                all_to_all.forward = original
                restored += 1
        return restored

    @reaches(INIT_PIPELINED_MODULES, PIPELINED_FORWARD_TYPE)
    def init_pipelined_modules(self, batch: In | None, context: TrainPipelineContext) -> None:
        """Rewrites the model on ``batch`` with the pipeline's pipelined forward (as ``attach``
        does) and starts the batch's input dist."""
        forward = private_attr(self._pipeline, PIPELINED_FORWARD_TYPE)
        private_attr(self._pipeline, INIT_PIPELINED_MODULES)(batch, context, forward)
