"""Retention as maintenance services: what `outbox cleanup` deletes, a little at a time, on
the relay that runs maintenance (off unless ``relay.cleanup_interval_seconds`` is set).

One service per table — published outbox rows (keep mode), inbox rows past the dedupe
window, expired idempotency keys, settled effect records — each with its own narrow
settings. Like River's cleaner, a round does a bounded amount of work (a few short batches,
each skipping locked rows: relay/maintenance/__init__.py's ``BATCHES_PER_ROUND``) and the
service sleeps, so it never competes with claims or handlers for locks.

In keep mode the outbox service resumes its walk of published rows where the last round
could prove nothing is left behind (below the first row it kept, and below the source's
claim horizon), instead of walking from the start of the table over the rows earlier rounds
deleted: while a snapshot is held those stay in the index. Once an hour the walk starts from
the beginning again (a row written with an old id outside the outbox's rules).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from outbox.ops.cleanup import BEFORE_ALL_IDS, Cleaner, TargetResult
from relay.maintenance.service import Periodic

log = logging.getLogger("relay.maintenance")
FULL_WALK_SECONDS = 3600.0


@dataclass(frozen=True)
class RetentionSettings:
    """One retention service's settings."""

    interval_seconds: float  # relay.cleanup_interval_seconds
    keep_seconds: float | None = None  # how long its rows are kept (None: each row says)


def _said(result: TargetResult) -> None:
    if result.deleted:
        log.info("retention round", extra={result.target: result.deleted})


class OutboxRetention(Periodic):
    """Published outbox rows past ``relay.keep_published_hours`` (keep mode only)."""

    name = "outbox-retention"

    def __init__(
        self,
        settings: RetentionSettings,
        cleaner: Cleaner,
        horizon: Callable[[], int | None],
    ) -> None:
        super().__init__(settings.interval_seconds)
        assert settings.keep_seconds is not None
        self._keep = settings.keep_seconds
        self._cleaner = cleaner
        self._horizon = horizon  # the source's claim horizon, when it has one
        self._after = BEFORE_ALL_IDS
        self._walked_from_start: float | None = None

    async def round(self) -> None:
        now = asyncio.get_running_loop().time()
        if self._walked_from_start is None or now - self._walked_from_start > FULL_WALK_SECONDS:
            self._after, self._walked_from_start = BEFORE_ALL_IDS, now
        result, resume = await self._cleaner.events(self._keep, False, self._after, self._horizon())
        if resume is not None:
            self._after = resume
        _said(result)


class InboxRetention(Periodic):
    """Inbox rows processed longer ago than ``consumer.dedupe_window_days``."""

    name = "inbox-retention"

    def __init__(self, settings: RetentionSettings, cleaner: Cleaner) -> None:
        super().__init__(settings.interval_seconds)
        assert settings.keep_seconds is not None
        self._keep = settings.keep_seconds
        self._cleaner = cleaner

    async def round(self) -> None:
        _said(await self._cleaner.inbox(self._keep, False))


class IdempotencyRetention(Periodic):
    """Idempotency keys past their expiry (``idempotency.ttl_hours`` when they were made)."""

    name = "idempotency-retention"

    def __init__(self, settings: RetentionSettings, cleaner: Cleaner) -> None:
        super().__init__(settings.interval_seconds)
        self._cleaner = cleaner

    async def round(self) -> None:
        _said(await self._cleaner.idempotency_records(False))


class EffectsRetention(Periodic):
    """Effect-ledger records (done, failed) past their dedupe window."""

    name = "effects-retention"

    def __init__(self, settings: RetentionSettings, cleaner: Cleaner) -> None:
        super().__init__(settings.interval_seconds)
        self._cleaner = cleaner

    async def round(self) -> None:
        _said(await self._cleaner.effect_records(False))
