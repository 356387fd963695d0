"""Retention as a maintenance service inside the relay (off unless configured).

Like River's cleaner, it runs beside the publishing loop, does a bounded amount of work per
round (a few short batches per table, each skipping locked rows) and sleeps, so it never
competes with claims for locks. Several relays may all run it: the batches skip each
other's rows. A database hiccup is logged and retried next round; any other error stops
the relay, as every watched task does.
"""

from __future__ import annotations

import asyncio
import logging

from outbox.db import async_engine
from outbox.errors import OutboxError
from outbox.ops.cleanup import run_cleanup
from outbox.settings import OutboxSettings
from relay.waiting import sleep_unless

log = logging.getLogger("relay.maintenance")
BATCHES_PER_ROUND = 10


async def run_maintenance(settings: OutboxSettings, stopping: asyncio.Event) -> None:
    interval = settings.relay.cleanup_interval_seconds
    engine = async_engine(settings, pool_size=1, max_overflow=0)
    try:
        while not stopping.is_set():
            try:
                report = await run_cleanup(
                    engine, settings, max_batches=BATCHES_PER_ROUND, pause_seconds=0.01
                )
            except OutboxError as exc:
                if not exc.retriable:
                    raise
                log.warning("retention round failed", extra={"error": type(exc).__name__})
            else:
                if report.total:
                    log.info(
                        "retention round",
                        extra={r.target: r.deleted for r in report.results if r.deleted},
                    )
            await sleep_unless(stopping, interval)
    finally:
        await engine.dispose()
