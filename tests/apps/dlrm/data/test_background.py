"""The background read-ahead of the DLRM app's data sources."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from apps.dlrm.data.background import BackgroundIterator, read_ahead


class _Counted:
    """A source that records how many items it built and on which threads."""

    def __init__(self, n: int, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at
        self.built = 0
        self.threads: set[str] = set()
        self.built_event = threading.Event()

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            self.threads.add(threading.current_thread().name)
            if i == self.fail_at:
                raise ValueError(f"bad row {i} in part-3.tsv")
            self.built += 1
            self.built_event.set()
            yield i


def test_yields_the_sources_items_in_order_from_another_thread() -> None:
    source = _Counted(50)
    assert list(BackgroundIterator(source, depth=3)) == list(range(50))
    assert source.threads == {"dlrm-data"}


def test_reads_at_most_depth_ahead() -> None:
    source = _Counted(100)
    with BackgroundIterator(source, depth=4) as items:
        assert next(items) == 0
        for _ in range(50):  # give the producer time to run ahead as far as it may
            source.built_event.wait(0.01)
            source.built_event.clear()
        # 1 consumed, 4 queued, 1 built and waiting for room
        assert source.built <= 1 + 4 + 1


def test_a_source_error_reaches_the_consumer_after_the_items_before_it() -> None:
    items = BackgroundIterator(_Counted(10, fail_at=6), depth=2)
    got = [next(items) for _ in range(6)]
    assert got == list(range(6))
    with pytest.raises(ValueError, match=r"bad row 6 in part-3\.tsv"):
        next(items)
    with pytest.raises(StopIteration):
        next(items)


def test_close_stops_a_producer_blocked_on_a_full_queue() -> None:
    source = _Counted(10_000)
    items = BackgroundIterator(source, depth=2)
    next(items)
    items.close()
    assert not items._thread.is_alive()
    assert source.built < 10
    with pytest.raises(StopIteration):
        next(items)


def test_read_ahead_zero_reads_inline_and_a_closed_generator_stops_its_thread() -> None:
    inline = _Counted(5)
    assert list(read_ahead(inline, 0)) == list(range(5))
    assert inline.threads == {threading.current_thread().name}

    before = {t.ident for t in threading.enumerate()}
    gen = read_ahead(_Counted(1000), 2)
    assert next(gen) == 0
    started = [t for t in threading.enumerate() if t.ident not in before]
    assert [t.name for t in started] == ["dlrm-data"]
    gen.close()
    assert not started[0].is_alive()


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError, match="depth must be >= 1"):
        BackgroundIterator(range(3), depth=0)
