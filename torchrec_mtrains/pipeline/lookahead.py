"""A train pipeline that reads the rows of the next ``k`` batches while the current one trains.

cDLRM's look-ahead, on TorchRec's own pipeline machinery. TorchRec's
``PrefetchTrainPipelineSparseDist`` has the right shape (rewrite the model so each sharded
module's input distribution runs ahead of its forward, hand the distributed input to the
module's ``prefetch``, let the forward consume it) but cannot run on CPU: it prefetches through
``prefetch_embeddings``, which returns at once without a data-dist CUDA stream, so
``PrefetchPipelinedForward`` then asserts on a missing input. It also looks ahead exactly one
batch. :class:`LookaheadTrainPipeline` keeps TorchRec's model rewrite (``_rewrite_model`` with
``PrefetchPipelinedForward``), batch queue, contexts and input-dist stages from
``TrainPipelineSparseDist`` and replaces the schedule: the prefetch step runs on the data-dist
stream (none on CPU) and the queue holds ``k`` prefetched batches. It runs on CPU and on CUDA.

What overlaps training is the tiered kernels' background tier I/O: a batch's ids are checked
on the host before it is copied to the device (:class:`HostBoundsCheck`, so no module waits for
the device to check them), and its rows planned (ids to cache slots, held so nothing evicts them)
and read by the tier worker while earlier batches run forward, backward and optimizer. On CUDA
the worker copies rows into the HBM cache on its own stream, ordered by events against the
training stream.
The kernel guarantees correctness as long as prefetches are issued in the order the batches
run, which this pipeline does by construction: rows of batches in flight are never evicted, and
a row written back is never read stale (one FIFO worker). So a pipelined run trains bitwise the
same weights and optimizer state as the plain loop.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Generic, TypeVar

import torch
from torch.autograd.profiler import record_function
from torchrec.distributed.train_pipeline.pipeline_context import (
    PrefetchTrainPipelineContext,
    TrainPipelineContext,
)
from torchrec.distributed.train_pipeline.runtime_forwards import (
    PipelinedForward,
    PrefetchPipelinedForward,
)
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.types import Awaitable

from torchrec_mtrains._compat.pipeline import SparseDistInternals, torchrec_next_batch
from torchrec_mtrains.distributed.id_bounds import HostBoundsCheck, IdBoundsCheck
from torchrec_mtrains.distributed.tiered_tables import TieredTableGroup, tiered_groups
from torchrec_mtrains.pipeline.stats import StepStats, snapshot

logger: logging.Logger = logging.getLogger(__name__)

In = TypeVar("In")
Out = TypeVar("Out")


class LookaheadTrainPipeline(TrainPipelineSparseDist, Generic[In, Out]):
    """Trains batch ``i`` while batches ``i+1 .. i+k`` are input-distributed and their missing
    rows read into the tiered caches by the tier worker.

    Each :meth:`progress` call runs one batch: forward of batch ``i`` (its rows were prefetched
    ``k`` steps ago, so it waits only for I/O not yet done), then reads batch ``i+k`` from the
    data iterator, input-distributes it and prefetches it (its I/O now overlaps backward and
    optimizer of ``i`` and the next forwards), then backward and optimizer of ``i``. Prefetching
    after the forward means the caches must hold ``k + 1`` batches' rows at once, the minimum.

    When the iterator ends the queued batches still run; then :meth:`progress` raises
    ``StopIteration`` and the pipeline stops its I/O worker and restores the model's forwards
    (:meth:`close`), so the model can be used directly (e.g. for evaluation). On any exception or
    ``KeyboardInterrupt`` inside :meth:`progress` (a worker's I/O error surfaces in the forward
    that needed the rows, with the worker's traceback) the pipeline waits for the queued tier
    I/O, drops the batches not yet trained, stops the worker, writes dirty rows back and
    re-raises, so no thread is left and no row on a tier is half written.

    Tables on TorchRec's own kernels simply pass through: their modules' ``prefetch`` is a no-op.

    Args:
        model: the ``DistributedModelParallel`` model (its sharded modules' inputs must come
            from the batch by attribute access only, as TorchRec's ``TrainPipelineSparseDist``
            requires).
        optimizer: steps after backward; e.g. a ``CombinedOptimizer`` of
            ``model.fused_optimizer`` and a ``KeyedOptimizerWrapper`` over the dense parameters,
            or a plain torch optimizer over the dense parameters (the fused tables update in
            backward either way).
        device: where the model computes (``cpu`` or ``cuda``). On CUDA batches are copied and
            input-distributed on TorchRec's side streams and the tier worker copies rows on its
            own; TorchRec's ``PrefetchTrainPipelineSparseDist`` also drives the tiered kernels
            there, one batch ahead.
        lookahead: ``k``, batches prefetched ahead of the running one (>= 1).
        custom_model_fwd: as TorchRec's: called with the batch instead of ``model``, returns
            ``(losses, output)``.
        freeze_gc: from the first step until :meth:`close`, Python's cyclic garbage collector
            leaves alone the objects that existed when training started (``gc.freeze``): a
            sharded model holds many (its sharded tensors' metadata, the plan, TorchRec's
            modules), and a full collection walks them all, each time a step's allocations
            trigger one (W1 at the 15% budget: 0.92x A frozen, 0.83-0.86x not). Garbage made
            during training is collected as usual. The freeze is the process's: ``False``
            leaves the collector alone.

    Raises:
        ValueError: if ``lookahead`` is below 1.

    Example::

        pipeline = LookaheadTrainPipeline(model, optimizer, torch.device("cpu"), lookahead=2)
        with pipeline:
            for _ in range(steps):
                loss, _ = pipeline.progress(batches)
                print(pipeline.last_step.stall_share)
    """

    # Read by TorchRec's attach() (compat.pipeline.PIPELINED_FORWARD_TYPE).
    _pipelined_forward_type = PrefetchPipelinedForward

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        lookahead: int = 1,
        custom_model_fwd: Callable[[In | None], tuple[torch.Tensor, Out]] | None = None,
        freeze_gc: bool = True,
    ) -> None:
        if isinstance(lookahead, bool) or not isinstance(lookahead, int) or lookahead < 1:
            raise ValueError(
                f"lookahead={lookahead!r}: give the number of batches to prefetch ahead of the "
                "running one, an int >= 1 (train without the pipeline for no look-ahead)"
            )
        super().__init__(
            model=model,
            optimizer=optimizer,
            device=device,
            execute_all_batches=True,
            context_type=PrefetchTrainPipelineContext,
            custom_model_fwd=custom_model_fwd,
        )
        self._torchrec: SparseDistInternals[In, Out] = SparseDistInternals(self)
        self._lookahead = lookahead
        self._groups: list[TieredTableGroup] | None = None
        self._host_check: HostBoundsCheck | None = None
        # What the host check found of the batch being copied (see copy_batch_to_gpu).
        self._host_checked: list[tuple[IdBoundsCheck, int]] = []
        # True from a step's start until the pipeline shuts down (nothing to stop otherwise).
        self._running = False
        self._freeze_gc = freeze_gc
        self._gc_frozen = False  # whether this pipeline froze the collector (see freeze_gc)
        self.last_step: StepStats | None = None
        self.totals = StepStats()

    @property
    def lookahead(self) -> int:
        return self._lookahead

    @property
    def groups(self) -> list[TieredTableGroup]:
        """The tiered kernels this pipeline prefetches for (found on first use: DMP builds
        them)."""
        if self._groups is None:
            self._groups = tiered_groups(self._torchrec.model)
        return self._groups

    # ---------------------------------------------------------------------- reading batches

    def _next_batch(self, dataloader_iter: Iterator[In]) -> In | None:
        """TorchRec's, and the batch's ids checked while it is still on the host (TorchRec's
        hook: compat.pipeline.NEXT_BATCH)."""
        batch: In | None = torchrec_next_batch(self, dataloader_iter)
        if self._host_check is None:
            self._host_check = HostBoundsCheck(self._torchrec.model)
        self._host_checked = [] if batch is None else self._host_check.check(batch)
        return batch

    def copy_batch_to_gpu(
        self, dataloader_iter: Iterator[In]
    ) -> tuple[In | None, PrefetchTrainPipelineContext | None]:
        """TorchRec's (the next batch, copied to the device on its side stream), then the
        copy vouched for where its host batch passed the bounds checks."""
        batch, context = super().copy_batch_to_gpu(dataloader_iter)
        passed, self._host_checked = self._host_checked, []
        if batch is not None and self._host_check is not None:
            self._host_check.vouch(passed, batch)
        return batch, context

    def _pipeline_model(
        self,
        batch: In | None,
        context: TrainPipelineContext,
        pipelined_forward: type[PipelinedForward] = PipelinedForward,
    ) -> None:
        """TorchRec's model rewrite (compat.pipeline.PIPELINE_MODEL), then the input dists of a
        one-process group back on their own forward: no splits exchange runs there."""
        super()._pipeline_model(batch, context, pipelined_forward)
        self._torchrec.unfuse_lone_input_dists()

    # ------------------------------------------------------------------------------ running

    def progress(self, dataloader_iter: Iterator[In]) -> Out:
        """Runs one batch (see the class docstring); returns the model's output for it.

        Raises:
            StopIteration: when the iterator is exhausted and every queued batch has run.
        """
        try:
            return self._progress(dataloader_iter)
        except StopIteration:
            self.close()
            raise
        except BaseException as error:
            self._abort(error)
            raise

    def _progress(self, dataloader_iter: Iterator[In]) -> Out:
        internals = self._torchrec
        if not internals.model_attached:
            self.attach(internals.model)
        if self._freeze_gc and not self._gc_frozen:
            gc.collect()  # what is garbage now is not frozen with the rest
            gc.freeze()
            self._gc_frozen = True
        self._running = True
        for group in self.groups:
            if not group.background_io:
                group.background_io = True
        started = time.perf_counter()
        before = snapshot(self.groups)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        internals.set_module_context(self.contexts[0])
        training = bool(internals.model.training)
        if training:
            internals.optimizer.zero_grad()
        # CUDA: the batch was copied and input-distributed on side streams (no-op on CPU).
        internals.wait_for_batch()
        losses, output = internals.model_fwd(self.batches[0])
        # Batch i+k. After the forward: batch i-1's rows are released by then, so the caches
        # need room for k+1 batches, not k+2.
        if self.enqueue_batch(dataloader_iter):
            self._distribute_and_prefetch(self.batches[-1], self.contexts[-1])
        if training:
            internals.backward(losses)
            # TorchRec's own optimizer step is not called: torchrec 1.6.1 has none.
            with record_function(f"## optimizer {self.contexts[0].index} ##"):
                internals.optimizer.step()
        self.dequeue_batch()
        self._record(
            StepStats.between(before, snapshot(self.groups), time.perf_counter() - started)
        )
        return output

    def fill_pipeline(self, dataloader_iter: Iterator[In]) -> None:
        """Queues and prefetches the first ``k`` batches (only when the queue is empty: at the
        start, or with a new iterator after the last one ran out)."""
        if self.batches:
            return
        if not self.enqueue_batch(dataloader_iter):
            return
        # Rewrites the model on the first batch (tracing needs one) and starts its input dist.
        self._torchrec.init_pipelined_modules(self.batches[0], self.contexts[0])
        self._finish_distribution_and_prefetch(self.contexts[0])
        while len(self.batches) < self._lookahead and self.enqueue_batch(dataloader_iter):
            self._distribute_and_prefetch(self.batches[-1], self.contexts[-1])

    def _distribute_and_prefetch(self, batch: In, context: PrefetchTrainPipelineContext) -> None:
        self.start_sparse_data_dist(batch, context)
        self._finish_distribution_and_prefetch(context)

    def _finish_distribution_and_prefetch(self, context: PrefetchTrainPipelineContext) -> None:
        """Completes a batch's input distribution and hands each sharded module its part.

        TorchRec's ``prefetch_embeddings`` with the prefetch on the data-dist stream: the
        distributed input and the module context move to the ``*_post_prefetch`` fields, where
        ``PrefetchPipelinedForward`` takes them in the batch's forward (on CUDA it makes the
        forward's stream wait for the data-dist stream and records the tensors' use there).
        The tiered kernels read the batch's ids on that stream, after its input dist, and copy
        their rows into the cache on the tier worker's own stream (see ``copy_streams``)."""
        self.wait_sparse_data_dist(context)
        for module in self._torchrec.pipelined_modules:
            name = module.forward.name
            request = context.input_dist_tensors_requests.pop(name)
            if not isinstance(request, Awaitable):
                raise TypeError(f"{name}: input dist gave {type(request).__name__}")
            module_context = context.module_contexts.pop(name)
            with self._torchrec.on_data_dist_stream():
                dist_input = request.wait()
                module.prefetch(dist_input=dist_input, forward_stream=None, ctx=module_context)
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = module_context

    def _record(self, stats: StepStats) -> None:
        self.last_step = stats
        self.totals = self.totals + stats
        logger.debug(
            "step %d: %.4f s, stall %.4f s (%.1f%%), prefetch I/O %.4f s, %d rows fetched, "
            "hit rate %.3f",
            self.totals.steps,
            stats.seconds,
            stats.stall_seconds,
            100 * stats.stall_share,
            stats.prefetch_io_seconds,
            stats.rows_fetched,
            stats.hit_rate,
        )

    # ----------------------------------------------------------------------------- stopping

    def close(self) -> None:
        """Ends the run: stops the tier worker after its queued I/O, writes dirty rows back,
        drops batches read but not trained (none once :meth:`progress` raised
        ``StopIteration``) and restores the model's own forwards. A later :meth:`progress`
        starts over on its iterator."""
        if self.batches:
            logger.warning("closing with %d batches read but not trained", len(self.batches))
        self._shutdown()

    def _shutdown(self) -> None:
        self._running = False
        if self._gc_frozen:
            gc.unfreeze()
            self._gc_frozen = False
        first: BaseException | None = None
        for group in self.groups:
            error = group.stop_background_io()
            first = first or error
        if first is not None:
            # Only a batch that never ran holds an unreported error.
            logger.warning("tier I/O of a batch that did not run failed: %r", first)
        self.batches.clear()
        self.contexts.clear()
        for group in self.groups:
            group.flush()
        if self._torchrec.model_attached:
            self.detach()

    def _abort(self, error: BaseException) -> None:
        """Shuts down after ``error`` escaped a step. Never raises (``error`` is what the
        caller must see) but logs a failure to shut down cleanly."""
        logger.warning(
            "stopping the look-ahead pipeline after %s; %d batches read but not trained are "
            "dropped",
            type(error).__name__,
            len(self.batches),
        )
        try:
            self._shutdown()
        except Exception:
            logger.exception("the look-ahead pipeline did not shut down cleanly")

    def __enter__(self) -> LookaheadTrainPipeline[In, Out]:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        elif self._running:  # an error outside progress(), which shuts down on its own
            self._abort(exc)
