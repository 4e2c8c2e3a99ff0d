"""loader.waits: a stop during a pool's work waits only for what already runs."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from loader.waits import map_in_steps


class _Stop(Exception):
    """What the test's SIGUSR1 handler raises in the main thread."""


def test_a_stop_while_hashing_cancels_the_queue_and_waits_only_for_what_runs():
    """A stop signal (here SIGUSR1, sent to the worker thread itself) while one file of many
    is hashed: the main thread's handler runs within a step, the files not started are never
    hashed, and the pool's end waits only for the running one (``pool.map`` hashed them all)."""
    started: list[int] = []
    release = threading.Event()

    def digest(item: int) -> int:
        started.append(item)
        if item == 0:
            time.sleep(0.5)
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)
            release.wait(30)
        return item

    def handler(signum, frame):
        raise _Stop

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with pytest.raises(_Stop), ThreadPoolExecutor(1) as pool:
            try:
                map_in_steps(pool, digest, range(20))
            finally:
                release.set()  # the running one ends; the pool's end then waits for it alone
    finally:
        release.set()
        signal.signal(signal.SIGUSR1, previous)
    assert started == [0]


def test_results_come_in_the_order_of_the_items():
    with ThreadPoolExecutor(4) as pool:
        assert map_in_steps(pool, lambda i: (time.sleep(0.01 * (5 - i)), i)[1], range(5)) == [
            0, 1, 2, 3, 4,
        ]  # fmt: skip


def test_a_failure_ends_the_wait_at_once_and_cancels_the_queue():
    """One file's failure (a file that cannot be read) while another is still hashed: the
    wait ends within a step with that failure, and the files not started are never hashed
    (the wait went on until every file was hashed, the failure reported last)."""
    started: list[int] = []
    release = threading.Event()

    def digest(item: int) -> int:
        started.append(item)
        if item == 0:
            raise OSError(5, "Input/output error", "file-0")
        if item == 1:
            release.wait(30)
        time.sleep(0.2)
        return item

    began = time.monotonic()
    try:
        with pytest.raises(OSError, match="Input/output error"), ThreadPoolExecutor(2) as pool:
            try:
                map_in_steps(pool, digest, range(20))
            finally:
                took = time.monotonic() - began
                release.set()
    finally:
        release.set()
    assert took < 5, took
    assert len(started) <= 4, started
