"""A failure on one rank ends every rank promptly, each naming the rank at fault: a rank that
raises, one that stops answering (SIGSTOP) and one that dies, over two gloo processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torchrec_mtrains.distributed.runtime import (
    RankFailure,
    failing_together,
    format_duration,
    free_port,
    parse_duration,
    process_group,
)

TIMEOUT_S = 4.0
OPTION = "run.collective_timeout=4s"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("5min", 300), ("5m", 300), ("1.5h", 5400), ("500ms", 0.5), ("12", 12), (7, 7)],
)
def test_durations_parse(text: str | int, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["soon", "5 days", "0s", "-3", "inf", True])
def test_bad_durations_are_refused_by_name(text: Any) -> None:
    with pytest.raises(ValueError, match=r"run\.collective_timeout="):
        parse_duration(text, "run.collective_timeout")


def test_durations_format_in_the_units_they_parse() -> None:
    assert [format_duration(timedelta(seconds=s)) for s in (90, 600, 5400, 4.5)] == [
        "1.5min",
        "10min",
        "1.5h",
        "4.5s",
    ]


def _rank(rank: int, port: int, fault: str, faulty: int, results: Any) -> None:
    """Rank ``faulty`` commits ``fault`` after one good collective; the other reports how its
    next collective ended and when."""
    torch.set_num_threads(1)
    with process_group(timeout=timedelta(seconds=TIMEOUT_S), rank=rank, world_size=2, port=port):
        started = time.monotonic()
        try:
            with failing_together(timedelta(seconds=TIMEOUT_S), option=OPTION):
                dist.all_reduce(torch.ones(1))
                if rank == faulty:
                    if fault == "raises":
                        raise ValueError("table 't': row id 70000 out of range")
                    if fault == "stops":
                        results.put(("stopping", rank, time.monotonic()))
                        os.kill(os.getpid(), signal.SIGSTOP)
                    if fault == "dies":
                        results.put(("stopping", rank, time.monotonic()))
                        os._exit(3)
                started = time.monotonic()
                dist.all_reduce(torch.ones(1))
                results.put(("ok", rank, 0.0))
        except BaseException as e:
            kind = type(e).__name__
            ranks = getattr(e, "ranks", None)
            results.put(("error", rank, (kind, str(e), ranks, time.monotonic() - started)))


def _run(fault: str, faulty: int = 1) -> tuple[str, str, tuple[int, ...], float]:
    """The healthy rank's error (type, message, ranks at fault, seconds its collective
    waited)."""
    healthy = 1 - faulty
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, fault, faulty, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and procs[healthy].exitcode is None:
            try:
                kind, rank, value = results.get(timeout=0.5)
            except queue.Empty:
                continue
            if rank == healthy and kind in ("error", "ok"):
                assert kind == "error", "a collective succeeded without the faulty rank"
                return value  # type: ignore[no-any-return]
        raise AssertionError(f"rank {healthy} never ended")
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)  # a stopped process ignores anything milder
            p.join(10)


def test_an_error_on_one_rank_ends_the_others_at_once_naming_it() -> None:
    kind, message, ranks, waited = _run("raises")
    assert kind == "RankFailure" and ranks == (1,)
    assert message.startswith("rank 1 failed, so rank 0 stops too")
    assert "ValueError: table 't': row id 70000 out of range" in message
    assert waited < 1.0  # not the timeout: rank 1 aborted the group


@pytest.mark.slow
def test_a_stopped_rank_is_named_within_the_timeout() -> None:
    kind, message, ranks, waited = _run("stops")
    assert kind == "RankFailure" and ranks == (1,)
    assert message.startswith("rank 1 stopped answering: a collective on rank 0 waited 4s")
    assert OPTION in message
    assert TIMEOUT_S <= waited < TIMEOUT_S + 3.0 + 2.0  # the timeout, then the grace for reports


@pytest.mark.slow
def test_a_stopped_rank_0_is_named_though_the_store_it_hosts_hangs() -> None:
    """Rank 0 hosts the job's store (without torchrun's agent): stopped, it accepts
    connections and never answers, so the diagnosis must not hang on it."""
    kind, message, ranks, waited = _run("stops", faulty=0)
    assert kind == "RankFailure" and ranks == (0,)
    assert message.startswith("rank 0 stopped answering: a collective on rank 1 waited 4s")
    assert "the store rank 0 hosts did not answer" in message and OPTION in message
    assert TIMEOUT_S <= waited < TIMEOUT_S + 2.0 + 2.0  # the timeout, then the store's 2 s


def test_a_dead_rank_is_named_at_once() -> None:
    kind, message, ranks, waited = _run("dies")
    assert kind == "RankFailure" and ranks == (1,)
    assert "rank 0 lost its connection to rank 1" in message and "ended or was killed" in message
    assert waited < 1.0  # the closed connection, not the timeout


def test_a_group_of_one_passes_errors_through() -> None:
    with (
        process_group(),
        pytest.raises(ValueError, match="plain"),
        failing_together(option=OPTION),
    ):
        raise ValueError("plain")
    assert isinstance(RankFailure("x", (1,)), RuntimeError)


@pytest.mark.parametrize(
    ("text", "how"),
    [
        ("Application timeout caused pair closure", "timed out"),  # gloo, not naming itself
        (
            "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1",
            "lost a peer",
        ),
        ("an error of this rank's own", None),
    ],
)
def test_gloos_ways_of_saying_a_collective_failed_are_told_apart(
    text: str, how: str | None
) -> None:
    from torchrec_mtrains.distributed.runtime import _collective_failure

    wrapped = RuntimeError("the pipeline's wait failed")
    wrapped.__cause__ = RuntimeError(text)
    assert _collective_failure(wrapped) == how
