"""Waits of the main thread that a stop signal cuts short.

The kernel hands a process's SIGTERM, SIGHUP or Ctrl-C to any of its threads that does not
block it: a download's, a converter's, gRPC's. Python runs the signal's handler only in the main
thread, and only once that thread runs Python again; a main thread blocked in one wait on a lock
(a future, a condition, a queue) is not woken by a signal another thread took, so the stop waited
until the work ended: a stalled server's read timeout, a whole conversion, or Kubernetes'
SIGKILL. Every wait of the main thread on other threads blocks at most :data:`WAIT_STEP_S` at a
time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

#: The longest a wait of the main thread blocks at a time (a stop signal's longest delay).
WAIT_STEP_S = 0.5

T = TypeVar("T")
R = TypeVar("R")


def wait_in_steps(futures: Sequence[Future]) -> tuple[set[Future], set[Future]]:
    """``wait(futures, return_when=FIRST_EXCEPTION)`` in steps of :data:`WAIT_STEP_S`: until
    every future is done or one failed; the done and the pending ones."""
    while True:
        done, pending = wait(futures, timeout=WAIT_STEP_S, return_when=FIRST_EXCEPTION)
        if not pending or any(not f.cancelled() and f.exception() is not None for f in done):
            return done, pending


def map_in_steps(pool: ThreadPoolExecutor, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``list(pool.map(fn, items))``, waited for in steps (:func:`wait_in_steps`); on a failure
    or a stop (any exception, KeyboardInterrupt included), what has not started is cancelled, so
    the stop waits only for the calls already running, never for the whole queue."""
    futures = [pool.submit(fn, item) for item in items]
    try:
        wait_in_steps(futures)
        return [future.result() for future in futures]
    except BaseException:
        for future in futures:
            future.cancel()
        raise
