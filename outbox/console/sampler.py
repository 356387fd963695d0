"""The lag chart's data: samples the console takes itself, kept in memory for one hour
(no Prometheus needed; a restarted console starts an empty chart). Each sample also asks
Kafka for the groups' members, so the consumers' section knows since when it has seen
each member (Kafka does not say)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.console.charts import TimeChart, time_chart
from outbox.errors import OutboxError
from outbox.ops.lag import LagReport, collect
from outbox.settings import OutboxSettings

WINDOW_SECONDS = 3600.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    at: float  # time.time()
    pending: int
    consumer_lag: int | None


@dataclass(frozen=True)
class Seen:
    """Since when this console has seen a group member (``already``: it was there at the
    console's first look, so it may have been there for longer)."""

    since: float
    already: bool
    last: float


class Sampler:
    def __init__(self) -> None:
        self._samples: deque[Sample] = deque()
        self._seen: dict[tuple[str, str], Seen] = {}
        self._looked = False

    def add(self, report: LagReport, at: float | None = None) -> None:
        now = time.time() if at is None else at
        self._samples.append(Sample(now, report.pending, report.consumer_lag))
        while self._samples and self._samples[0].at < now - WINDOW_SECONDS:
            self._samples.popleft()
        described = [g for g in report.groups if g.described is not None]
        for g in described:
            assert g.described is not None
            for m in g.described.members:
                known = self._seen.get((g.group, m.member_id))
                first = known.since if known else now
                already = known.already if known else not self._looked
                self._seen[(g.group, m.member_id)] = Seen(first, already, now)
        if described:
            self._looked = True
        for key in [k for k, v in self._seen.items() if v.last < now - WINDOW_SECONDS]:
            del self._seen[key]

    def seen(self, group: str, member_id: str) -> Seen | None:
        return self._seen.get((group, member_id))

    @property
    def samples(self) -> list[Sample]:
        return list(self._samples)

    def chart(self, now: float | None = None) -> TimeChart:
        """Pending events and the largest consumer lag over the last hour, with axes."""
        now = time.time() if now is None else now
        shown = [s for s in self._samples if s.at >= now - WINDOW_SECONDS]
        return time_chart(
            [
                ("pending outbox events", "pending", [(s.at, s.pending) for s in shown]),
                ("largest consumer lag", "lag", [(s.at, s.consumer_lag) for s in shown]),
            ],
            start=now - WINDOW_SECONDS,
            end=now,
            unit="events",
        )

    async def run(self, engine: AsyncEngine, settings: OutboxSettings, every: float) -> None:
        """Sample until cancelled; a failed sample is logged and skipped, never fatal."""
        while True:
            try:
                self.add(await collect(engine, settings, members=True))
            except OutboxError as exc:
                log.warning("console lag sample failed: %s", exc)
            await asyncio.sleep(every)
