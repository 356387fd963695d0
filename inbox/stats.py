"""What a consumer process counted, added to its group's per-minute figures in the
database (the ``consumer_stats`` table) for the console's throughput and processing-time
charts.

Off the hot path: a task of its own wakes every ``consumer.stats_seconds``, reads the
counters the processor keeps anyway (:class:`inbox.metrics.Metrics`), and adds what
changed since its last write in one statement — nothing when nothing changed, so an idle
consumer writes nothing. Once an hour it also deletes its group's rows older than a day.
A failed write is logged (once per state change: the database's outage is logged by the
daemon already) and its figures are added to the next one; they are never worth stopping
the consumer for.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time

from sqlalchemy.ext.asyncio import AsyncEngine

from inbox.failures import infrastructure_cause
from inbox.metrics import Metrics
from inbox.store import InboxStore
from outbox.db import translated_errors

log = logging.getLogger("outbox.inbox")
KEPT = dt.timedelta(days=1)
_FORGET_EVERY_SECONDS = 3600.0
# Metrics.counts names -> consumer_stats columns (handler_seconds is read apart).
_COUNTED = ("processed", "dead_lettered", "retries", "duplicates")


class StatsWriter:
    def __init__(
        self, consumer: str, metrics: Metrics, store: InboxStore, engine: AsyncEngine
    ) -> None:
        self._consumer = consumer
        self._metrics = metrics
        self._store = store
        self._engine = engine
        self._written = self._now()
        self._failing = False
        self._forgot_at = 0.0

    def _now(self) -> dict[str, float]:
        counts: dict[str, float] = {name: self._metrics.counts[name] for name in _COUNTED}
        counts["handler_seconds"] = self._metrics.handler_seconds_total()
        return counts

    async def run(self, every: float) -> None:
        """Write every ``every`` seconds until cancelled (then once more)."""
        try:
            while True:
                await asyncio.sleep(every)
                await self.write()
        finally:
            with contextlib.suppress(Exception):
                await asyncio.shield(self.write())

    async def write(self) -> None:
        now = self._now()
        delta = {name: now[name] - self._written[name] for name in now}
        forget = time.monotonic() - self._forgot_at >= _FORGET_EVERY_SECONDS
        if not any(delta.values()) and not forget:
            return
        try:
            with translated_errors():
                async with self._engine.begin() as conn:
                    if any(delta.values()):
                        await self._store.add_stats(conn, self._consumer, delta)
                    if forget:
                        await self._store.forget_stats(conn, self._consumer, KEPT)
        except Exception as exc:  # a side task: never a reason to stop the consumer
            if not self._failing:
                log.warning(
                    "consumer stats not written (kept for the next write): %s",
                    infrastructure_cause(exc),
                    extra={"consumer": self._consumer},
                )
            self._failing = True
            return
        if self._failing:
            log.info("consumer stats written again", extra={"consumer": self._consumer})
        self._failing = False
        self._written = now
        if forget:
            self._forgot_at = time.monotonic()
