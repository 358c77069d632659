"""A data source read by a background thread, a few batches ahead of the training loop.

Why: building a batch (drawing synthetic ids, parsing Criteo rows, packing the KJT) costs the
training thread ~15 ms a step on W2 when done inline. A DataLoader worker process would take it
off the training thread too, but a forked worker shares the parent's pages copy-on-write, so
every row cache the parent keeps writing is duplicated under a memory cap. A thread shares
memory, and the work it does is mostly numpy and torch ops, which release the GIL.

The thread only produces batches: collectives (ranks agreeing on how many batches they all have)
stay on the consumer's thread, and the order of the batches is the source's own, so training is
the same as reading the source inline.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")

_POLL_S = 0.1  # how often a producer blocked on a full queue checks whether it was closed


class BackgroundIterator(Iterator[T], Generic[T]):
    """Iterates ``source`` in a daemon thread, at most ``depth`` items ahead of the consumer.

    An error raised by the source is raised by ``__next__`` in the consumer, after the items
    before it. :meth:`close` (also on ``with`` exit) stops the thread; items not consumed are
    dropped.
    """

    def __init__(self, source: Iterable[T], depth: int, name: str = "dlrm-data") -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._queue: queue.Queue[tuple[bool, T | BaseException | None]] = queue.Queue(depth)
        self._closed = threading.Event()
        self._done = False
        self._thread = threading.Thread(
            target=self._produce, args=(source,), name=name, daemon=True
        )
        self._thread.start()

    def _produce(self, source: Iterable[T]) -> None:
        try:
            for item in source:
                if not self._put((True, item)):
                    return
        except BaseException as error:  # handed to the consumer, raised there
            self._put((False, error))
            return
        self._put((False, None))

    def _put(self, entry: tuple[bool, T | BaseException | None]) -> bool:
        """Queues ``entry``; False when the consumer closed first."""
        while not self._closed.is_set():
            try:
                self._queue.put(entry, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        is_item, value = self._queue.get()
        if is_item:
            return value  # type: ignore[return-value]
        self._done = True
        self._thread.join()
        if isinstance(value, BaseException):
            raise value
        raise StopIteration

    def close(self) -> None:
        """Stops the producer and waits for it (after the item it is building, if any)."""
        self._done = True
        self._closed.set()
        while True:  # frees a producer blocked on a full queue at once
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        self._thread.join()

    def __enter__(self) -> BackgroundIterator[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_ahead(source: Iterable[T], depth: int) -> Generator[T, None, None]:
    """``source``'s items, read ``depth`` ahead by a background thread (inline when 0); the
    thread stops when the returned generator is closed or collected."""
    if depth == 0:
        yield from source
        return
    with BackgroundIterator(source, depth) as items:
        yield from items
