"""Progress reporting: a bar on a terminal, a few plain lines in a log, nothing off rank 0."""

from __future__ import annotations

import io

from apps.dlrm.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _run(stream: io.StringIO, steps: int, enabled: bool = True, every_s: float = 3600.0) -> str:
    progress = Progress(total=steps, initial=0, enabled=enabled, every_s=every_s, stream=stream)
    for step in range(steps):
        progress.update({"loss": f"{1.0 / (step + 1):.4f}"} if step % 10 == 9 else None)
    progress.close()
    return stream.getvalue()


def test_a_log_gets_one_line_per_interval_and_a_last_one() -> None:
    # 200 steps in well under an hour: no line until the end, then one with the last fields.
    out = _run(io.StringIO(), 200)
    assert out.splitlines() == [out.strip()]
    assert out.startswith("step 200/200 (100%)") and "loss=0.0050" in out
    assert "\r" not in out  # no bar redraws in a log file


def test_a_log_gets_a_line_whenever_the_interval_passed() -> None:
    out = _run(io.StringIO(), 5, every_s=1e-9)
    assert [line.split()[1] for line in out.splitlines()] == ["1/5", "2/5", "3/5", "4/5", "5/5"]


def test_a_terminal_gets_tqdms_bar() -> None:
    out = _run(_Terminal(), 20)
    assert "\r" in out and "20/20" in out and "batch" in out


def test_disabled_ranks_write_nothing() -> None:
    assert _run(io.StringIO(), 50, enabled=False) == ""
    assert _run(_Terminal(), 50, enabled=False) == ""


def test_an_unknown_total_shows_the_count_alone() -> None:
    # Epochs over a text file: the number of steps is known only at the end.
    stream = io.StringIO()
    progress = Progress(total=None, initial=3, enabled=True, every_s=1e-9, stream=stream)
    progress.update({"loss": "0.5000"})
    progress.show({"loss": "0.2500"})
    progress.update()
    progress.close()
    assert stream.getvalue().splitlines()[0].startswith("step 4 ")
    assert stream.getvalue().splitlines()[-1].split()[:2] == ["step", "5"]
    assert "loss=0.2500" in stream.getvalue().splitlines()[-1]
    assert "%" not in stream.getvalue()


def test_a_terminal_bar_takes_an_unknown_total() -> None:
    terminal = _Terminal()
    progress = Progress(total=None, initial=0, enabled=True, every_s=1.0, stream=terminal)
    for _ in range(3):
        progress.update()
    progress.show({"loss": "0.1000"})
    progress.close()
    assert "3batch" in terminal.getvalue().replace(" ", "") and "loss=0.1000" in terminal.getvalue()
