"""Training progress as a person reads it: a tqdm bar on a terminal; elsewhere (torchx logs, CI,
``nohup``) one plain line every few seconds, which a log file keeps readable. Only rank 0
reports, so a job of many ranks prints one progress, not one per rank."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm


class Progress:
    """Reports steps ``initial..total`` of a run.

    Args:
        total: the last step; None when unknown before the end (epochs over data of unknown
            length), then the count is shown without a share.
        initial: the step the run starts at (after a resume, the checkpoint's).
        enabled: whether to report at all (``run.progress`` and rank 0).
        every_s: without a terminal, the seconds between two lines (> 0; the app's
            ``run.progress_every_s``, checked by its config).
        stream: where to write (default: standard error, as tqdm does).

    Example::

        progress = Progress(total=300, initial=0, enabled=rank == 0, every_s=30.0)
        for step in range(300):
            ...
            progress.update({"loss": f"{loss:.4f}"})
        progress.close()
    """

    def __init__(
        self,
        total: int | None,
        initial: int,
        enabled: bool,
        every_s: float,
        stream: TextIO | None = None,
    ) -> None:
        self._stream = stream or sys.stderr
        self._total, self._step = total, initial
        self._enabled = enabled
        self._every_s = every_s
        self._fields: dict[str, str] = {}
        self._started = self._last_line = time.perf_counter()
        self._reported = initial
        is_tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._bar: tqdm[None] | None = None
        if enabled and is_tty:
            self._bar = tqdm(
                total=total,
                initial=initial,
                unit="batch",
                dynamic_ncols=True,
                file=self._stream,
            )

    def update(self, fields: dict[str, str] | None = None) -> None:
        """One step done; ``fields`` (samples/s, loss, ...) replace the shown ones."""
        self._step += 1
        if fields:
            self._fields = dict(fields)
        if not self._enabled:
            return
        if self._bar is not None:
            if fields:
                self._bar.set_postfix(self._fields, refresh=False)
            self._bar.update(1)
            return
        now = time.perf_counter()
        if now - self._last_line >= self._every_s:
            self._line(now)

    def show(self, fields: dict[str, str]) -> None:
        """Replaces the shown fields without a step (numbers of the last steps of a run)."""
        self._fields = dict(fields)
        if self._bar is not None:
            self._bar.set_postfix(self._fields, refresh=True)

    def close(self) -> None:
        """Ends the bar, or writes the last line if steps were done since the previous one."""
        if self._bar is not None:
            self._bar.close()
        elif self._enabled and self._step > self._reported:
            self._line(time.perf_counter())

    def _line(self, now: float) -> None:
        elapsed = now - self._started
        text = " ".join(f"{k}={v}" for k, v in self._fields.items())
        where = f"step {self._step}"
        if self._total is not None:
            where += f"/{self._total} ({self._step / max(1, self._total):.0%})"
        self._stream.write(f"{where} {elapsed:.0f}s {text}".rstrip() + "\n")
        self._stream.flush()
        self._last_line, self._reported = now, self._step
