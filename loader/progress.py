"""Progress reporting for long work: a tqdm bar on a terminal, plain log lines otherwise.

Use :func:`byte_progress` as a context manager and call ``update(n)`` with byte counts. On a
terminal it draws a tqdm bar with rate; otherwise it logs a line at most every ``interval``
seconds (and once at the end), so Kubernetes Job logs stay readable.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Protocol

log = logging.getLogger(__name__)


class Progress(Protocol):
    def update(self, n: int) -> None: ...


def human_bytes(n: float) -> str:
    """A byte count as tqdm's bars print it (``1.23GB``, decimal units)."""
    from tqdm import tqdm

    return tqdm.format_sizeof(n, "B")


class LogLineProgress:
    """Thread-safe byte counter that logs ``what: done/total (pct) at rate`` periodically."""

    def __init__(
        self, what: str, total: int | None, *, interval: float = 5.0, logger: logging.Logger = log
    ) -> None:
        self.what = what
        self.total = total
        self.interval = interval
        self.logger = logger
        self.done = 0
        self._emitted: int | None = None
        self._start = time.monotonic()
        self._last = self._start
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                self._emit(now)

    def close(self) -> None:
        """The last line, unless the one before said the same (or there was nothing to do)."""
        with self._lock:
            if self.done == 0 and not self.total:
                self.logger.debug("%s: nothing to do", self.what)
            elif self.done != self._emitted:
                self._emit(time.monotonic())

    def _emit(self, now: float) -> None:
        self._emitted = self.done
        elapsed = max(now - self._start, 1e-9)
        rate = human_bytes(self.done / elapsed) + "/s"
        if self.total:
            pct = 100.0 * self.done / self.total
            self.logger.info(
                "%s: %s / %s (%.0f%%) at %s",
                self.what,
                human_bytes(self.done),
                human_bytes(self.total),
                pct,
                rate,
            )
        else:
            self.logger.info("%s: %s at %s", self.what, human_bytes(self.done), rate)


class _TqdmProgress:
    def __init__(self, what: str, total: int | None, stream: IO[str]) -> None:
        from tqdm import tqdm

        self._bar = tqdm(
            total=total,
            desc=what,
            unit="B",
            unit_scale=True,
            unit_divisor=1000,
            file=stream,
            dynamic_ncols=True,
        )
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self._bar.update(n)

    def close(self) -> None:
        self._bar.close()


@contextmanager
def byte_progress(
    what: str,
    total: int | None,
    *,
    stream: IO[str] | None = None,
    interval: float = 5.0,
    force_plain: bool = False,
) -> Iterator[Progress]:
    """Report progress over ``total`` bytes; a tqdm bar on a TTY, log lines otherwise."""
    stream = stream or sys.stderr
    is_tty = bool(getattr(stream, "isatty", lambda: False)())
    reporter: _TqdmProgress | LogLineProgress
    if is_tty and not force_plain:
        reporter = _TqdmProgress(what, total, stream)
    else:
        reporter = LogLineProgress(what, total, interval=interval)
    try:
        yield reporter
    finally:
        reporter.close()
