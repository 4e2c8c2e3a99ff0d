"""A bounded number of requests in flight to Triton, and a bounded queue before them.

At most ``max_concurrency`` requests talk to Triton at once; up to ``max_queue`` more wait for
a slot, in arrival order; one beyond that is refused at once with 429 (and ``Retry-After``),
so a burst never piles up unbounded memory and latency in the service.
"""

from __future__ import annotations

import asyncio

from completions_service.errors import QueueFull


class Admission:
    def __init__(self, max_concurrency: int, max_queue: int) -> None:
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(max_concurrency)
        self.in_flight = 0
        self.waiting = 0

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if need be; 429 when the queue is full."""
        if self._slots.locked() and self.waiting >= self.max_queue:
            raise QueueFull(
                f"the service is at capacity ({self.max_concurrency} requests in flight, "
                f"{self.waiting} waiting); retry shortly",
                retry_after=1,
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1
        self._slots.release()
