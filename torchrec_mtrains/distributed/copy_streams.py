"""Ordering the tier worker's row copies against training when the cache is in HBM.

On CUDA the cache's rows are written (rows read from a tier) and read (dirty victims going back
to a tier) by the tier worker thread while the training stream runs other batches. The worker
copies on its own stream, so its copies overlap compute, and two events keep it correct:

* a slot released by a batch (its backward enqueued) may still be read or updated by kernels the
  GPU has not run yet; a plan that reuses such a slot waits for the event recorded when the
  training thread released it, so a victim's row is copied out only after its last update, and
  a new row is copied in only after the old one's last use;
* a batch's forward waits for the event recorded after its rows were copied in.

On CPU every copy is synchronous and all of this is a no-op.

Every tier reaches HBM the same way: the worker reads a batch's missing rows on the host (DRAM
and byte SCM by a gather from memory or the mapped file; block SCM by the AIO engine with
``queue_depth`` block reads in flight, merged across tables by ``read_rows_together``), stages
them in pinned memory and copies them on its stream. A mapping the GPU reads itself (the file
registered with ``cudaHostRegister``, rows gathered by a kernel) was considered for byte SCM and
not built: registering page-locks the whole range, so the tier's file would be held in DRAM,
and a byte-SCM tier exists to hold more than DRAM can. Where a table's rows fit in locked DRAM,
the DRAM tier (or TorchRec's UVM caching) serves it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from torchrec_mtrains.distributed.runtime import with_index

# torch leaves these constructors unannotated: typed here by what they take and return.
_new_stream: Callable[[torch.device], torch.cuda.Stream] = torch.cuda.Stream
_new_event: Callable[[], torch.cuda.Event] = torch.cuda.Event


class RowCopyStreams:
    """The worker's copy stream on ``device`` (none on CPU) and the events that order it.

    Args:
        device: the device holding the cache.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = with_index(device)  # the worker thread makes it current
        self._stream: torch.cuda.Stream | None = (
            _new_stream(self.device) if device.type == "cuda" else None
        )

    @property
    def on_gpu(self) -> bool:
        return self._stream is not None

    def enter_worker(self) -> None:
        """Run once on the tier worker thread: its copies go to the copy stream (the current
        device and stream are per thread)."""
        if self._stream is not None:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self._stream)

    def record(self) -> torch.cuda.Event | None:
        """An event marking everything enqueued so far on this thread's current stream."""
        if self._stream is None:
            return None
        event = _new_event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: torch.cuda.Event | None) -> None:
        """Makes this thread's current stream wait for ``event`` (without blocking the host)."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    @staticmethod
    def to_host(values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """``values`` as int64 in host memory, and on CUDA the event that marks them there:
        copied into pinned memory after the work enqueued on the current stream, without
        blocking the host (wait for the event before reading them)."""
        if values.device.type != "cuda":
            return values.to(torch.int64), None
        return RowCopyStreams._to_pinned(values.to(torch.int64))

    @staticmethod
    def host_copy(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in host memory once its producers on this thread's current stream have
        run: on CUDA copied into pinned memory and waited for by its event, which blocks this
        thread alone (a plain copy to pageable memory synchronizes the whole stream, which the
        training thread's sync checks count)."""
        if tensor.device.type != "cuda":
            return tensor
        host, event = RowCopyStreams._to_pinned(tensor)
        event.synchronize()
        return host

    @staticmethod
    def _to_pinned(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """A copy of the CUDA ``tensor`` into pinned host memory, enqueued on the current
        stream, and the event that marks it done."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        event = _new_event()
        event.record(torch.cuda.current_stream(tensor.device))
        return host, event

    @staticmethod
    def device_copy(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``tensor`` (in host memory) on ``device``: on CUDA staged in pinned memory and
        copied on this thread's current stream without blocking the host."""
        if device.type != "cuda":
            return tensor.to(device)
        return tensor.pin_memory().to(device, non_blocking=True)

    @staticmethod
    def synchronize(event: torch.cuda.Event | None) -> None:
        """Blocks the host until ``event`` has happened."""
        if event is not None:
            event.synchronize()
