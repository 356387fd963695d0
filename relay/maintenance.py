"""Retention as a maintenance service inside the relay (off unless configured).

Like River's cleaner, it runs beside the publishing loop, does a bounded amount of work per
round (a few short batches per table, each skipping locked rows) and sleeps, so it never
competes with claims for locks. Several relays may all run it: the batches skip each
other's rows. A database hiccup is logged and retried next round; any other error stops
the relay, as every watched task does.

In keep-mode each round resumes the walk of published outbox rows where the last one could
prove nothing is left behind (below the first row it kept, and below the relay's claim
horizon), instead of walking from the start of the table over the rows earlier rounds
deleted: while a snapshot is held those stay in the index. Once an hour the walk starts
from the beginning again (a row written with an old id outside the outbox's rules).
"""

from __future__ import annotations

import asyncio
import logging

from outbox.db import async_engine
from outbox.errors import OutboxError
from outbox.ops.cleanup import BEFORE_ALL_IDS, run_cleanup
from outbox.settings import OutboxSettings
from relay.cursor import ClaimCursors
from relay.waiting import sleep_unless

log = logging.getLogger("relay.maintenance")
BATCHES_PER_ROUND = 10
FULL_WALK_SECONDS = 3600.0


async def run_maintenance(
    settings: OutboxSettings, stopping: asyncio.Event, cursors: ClaimCursors
) -> None:
    interval = settings.relay.cleanup_interval_seconds
    engine = async_engine(settings, pool_size=1, max_overflow=0)
    loop = asyncio.get_running_loop()
    after, walked_from_start = BEFORE_ALL_IDS, loop.time()
    try:
        while not stopping.is_set():
            if loop.time() - walked_from_start > FULL_WALK_SECONDS:
                after, walked_from_start = BEFORE_ALL_IDS, loop.time()
            try:
                report = await run_cleanup(
                    engine,
                    settings,
                    max_batches=BATCHES_PER_ROUND,
                    pause_seconds=0.01,
                    events_after=after,
                    events_horizon=cursors.horizon.value,
                )
            except OutboxError as exc:
                if not exc.retriable:
                    raise
                log.warning("retention round failed", extra={"error": type(exc).__name__})
            else:
                if report.events_resume_after is not None:
                    after = report.events_resume_after
                if report.total:
                    log.info(
                        "retention round",
                        extra={r.target: r.deleted for r in report.results if r.deleted},
                    )
            await sleep_unless(stopping, interval)
    finally:
        await engine.dispose()
