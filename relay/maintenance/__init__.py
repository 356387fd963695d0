"""The relay's maintenance: services of upkeep run by one relay of a deployment at a time,
whatever its source (River's model: each job a service with its own narrow settings,
started and stopped as one, on the elected leader only).

=====================  ==============================================  ======================
service                what it does                                    settings
=====================  ==============================================  ======================
outbox-retention       deletes published rows past retention           relay.keep_published_
                       (keep mode)                                     hours, cleanup_interval
inbox-retention        deletes inbox rows past the dedupe window       consumer.dedupe_window_
                                                                       days, cleanup_interval
idempotency-retention  deletes expired idempotency keys                relay.cleanup_interval_
                                                                       seconds
effects-retention      deletes settled effect records past their       relay.cleanup_interval_
                       window                                          seconds
dead-tuple-watch       the outbox's dead rows (a gauge)                relay.stats_interval_
                                                                       seconds
snapshot-watch         the oldest snapshot holding back VACUUM         relay.stats_interval_
                       (a gauge)                                       seconds
=====================  ==============================================  ======================

Retention is off while ``relay.cleanup_interval_seconds`` is 0 (then `outbox cleanup` does
it, from cron or by hand). The leader is the relay holding the maintenance lock
(relay/maintenance/leader.py), taken on the connection of its registration; the relays
table and `outbox status` say which relay it is. When its connection — or its process —
dies, PostgreSQL releases the lock and another relay takes it at its next heartbeat.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.idempotency.keys import IdempotencyKeys
from outbox.ops.cleanup import Cleaner
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from relay.database import Database
from relay.maintenance.retention import (
    EffectsRetention,
    IdempotencyRetention,
    InboxRetention,
    OutboxRetention,
    RetentionSettings,
)
from relay.maintenance.service import Service
from relay.maintenance.watches import DeadTupleWatch, SnapshotWatch, WatchSettings
from relay.metrics import RelayMetrics
from relay.store import RelayStore

log = logging.getLogger("relay.maintenance")
# A retention round: at most this many batches per table (each a short transaction).
BATCHES_PER_ROUND = 10
# The pause between two batches, leaving I/O to the hot paths.
BATCH_PAUSE_SECONDS = 0.01


class Maintenance:
    """A relay's maintenance services, started when it becomes the leader and stopped when
    it no longer is (or stops). A service that fails for good fails :meth:`run`, which the
    daemon watches like any of its tasks."""

    def __init__(
        self,
        services: list[Service],
        metrics: RelayMetrics,
        engine: AsyncEngine | None = None,
    ) -> None:
        self.services = services
        self._metrics = metrics
        self._engine = engine  # the retention services' (its connections closed on stop)
        self._running: list[asyncio.Task[None]] = []
        self._failed: asyncio.Future[None] | None = None
        self.leading = False

    def elected(self) -> None:
        """This relay holds the maintenance lock: start every service."""
        if self.leading:
            return
        self.leading = True
        self._metrics.maintenance_leader.set(1)
        log.info(
            "running the maintenance services",
            extra={"services": [s.name for s in self.services]},
        )
        self._running = [s.start() for s in self.services]
        for task in self._running:
            task.add_done_callback(self._ended)

    async def deposed(self) -> None:
        """The lock is gone (its connection died) or the relay stops: stop every service."""
        if not self.leading:
            return
        self.leading = False
        self._metrics.maintenance_leader.set(0)
        self._running = []
        await asyncio.gather(*(s.stop() for s in self.services))
        if self._engine is not None:
            await self._engine.dispose()
        log.info("stopped the maintenance services")

    def _ended(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is None:
            return
        if self._failed is not None and not self._failed.done():
            self._failed.set_exception(task.exception())  # type: ignore[arg-type]

    async def run(self, stopping: asyncio.Event) -> None:
        """Until ``stopping``; raises what ended a service for good."""
        self._failed = asyncio.get_running_loop().create_future()
        stop = asyncio.ensure_future(stopping.wait())
        try:
            either: list[asyncio.Future[Any]] = [stop, self._failed]
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if self._failed.done():
                self._failed.result()
        finally:
            stop.cancel()
            await self.deposed()


def maintenance_for(
    settings: OutboxSettings,
    database: Database,
    store: RelayStore,
    metrics: RelayMetrics,
    horizon: Callable[[], int | None],
) -> Maintenance:
    """The services ``settings`` turn on, each given its own settings. ``horizon``: the
    source's claim horizon (the outbox retention resumes below it)."""
    r = settings.relay
    watch = WatchSettings(r.stats_interval_seconds)
    services: list[Service] = [
        DeadTupleWatch(watch, database, store, metrics.dead_rows),
        SnapshotWatch(watch, database, store, metrics.oldest_snapshot_age),
    ]
    interval = r.cleanup_interval_seconds
    engine = None
    if interval > 0:
        engine = database.engine(pool_size=2, max_overflow=0)
        cleaner = Cleaner(
            engine,
            build_tables(settings),
            IdempotencyKeys(settings),
            pause_seconds=BATCH_PAUSE_SECONDS,
            max_batches=BATCHES_PER_ROUND,
        )
        if r.keep_published_hours > 0:
            kept = RetentionSettings(interval, r.keep_published_hours * 3600)
            services.append(OutboxRetention(kept, cleaner, horizon))
        window = RetentionSettings(interval, settings.consumer.dedupe_window_days * 86400)
        services += [
            InboxRetention(window, cleaner),
            IdempotencyRetention(RetentionSettings(interval), cleaner),
            EffectsRetention(RetentionSettings(interval), cleaner),
        ]
    return Maintenance(services, metrics, engine)
