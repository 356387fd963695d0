"""The relay's in-flight byte budget: payload bytes handed to the Kafka producer and not
yet answered for (acknowledged or failed).

Each pipeline claims at most its share of ``relay.max_inflight_bytes``, so in steady state
the budget never makes anyone wait. It matters when Kafka is slow or a partition is down:
a batch whose acks time out stays queued inside the producer ("outstanding") and keeps its
bytes, and without a bound the next claims would pile more payloads on top of it. A
publish then waits for room (until its ack timeout), else its rows are reported as not
acknowledged and go back to the outbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


class ByteBudget:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._freed = asyncio.Event()
        self._held: dict[asyncio.Future[Any], int] = {}

    async def acquire(self, size: int, within: float) -> int | None:
        """Take ``size`` bytes (at most the whole budget: a claim of one row larger than
        the budget still goes, alone); None when no room was made within ``within``
        seconds. Returns what was taken, to be given back with :meth:`release`."""
        size = min(size, self.limit)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while self.used + size > self.limit:
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), deadline - loop.time())
            except TimeoutError:
                return None
        self.used += size
        return size

    def release(self, size: int) -> None:
        self.used -= size
        self._freed.set()

    def hold(self, future: asyncio.Future[Any], size: int) -> None:
        """Keep ``size`` taken bytes until ``future`` is done (acked, failed or cancelled),
        or until :meth:`let_go` gives them back earlier."""
        if future.done():
            self.release(size)
            return
        self._held[future] = self._held.get(future, 0) + size
        future.add_done_callback(self._done)

    def let_go(self, futures: Iterable[asyncio.Future[Any]]) -> None:
        """Give back now what ``futures`` hold: deliveries of a retired producer, whose rows
        are back in the outbox (their late answer no longer concerns the budget)."""
        for future in futures:
            self._done(future)

    def _done(self, future: asyncio.Future[Any]) -> None:
        size = self._held.pop(future, 0)
        if size:
            self.release(size)
