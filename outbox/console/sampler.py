"""The lag chart's data: samples the console takes itself, kept in memory for one hour
(no Prometheus needed; a restarted console starts an empty chart)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

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
class Chart:
    """Two SVG polylines over the last hour, drawn on the server (no script)."""

    width: int
    height: int
    pending_points: str
    lag_points: str
    max_value: int
    samples: int
    span_seconds: float


class Sampler:
    def __init__(self) -> None:
        self._samples: deque[Sample] = deque()

    def add(self, report: LagReport, at: float | None = None) -> None:
        now = time.time() if at is None else at
        self._samples.append(Sample(now, report.pending, report.consumer_lag))
        while self._samples and self._samples[0].at < now - WINDOW_SECONDS:
            self._samples.popleft()

    @property
    def samples(self) -> list[Sample]:
        return list(self._samples)

    def chart(self, now: float | None = None, width: int = 600, height: int = 120) -> Chart:
        now = time.time() if now is None else now
        shown = [s for s in self._samples if s.at >= now - WINDOW_SECONDS]
        top = max([1, *(s.pending for s in shown), *(s.consumer_lag or 0 for s in shown)])
        # The x axis spans what was sampled (a fresh console has minutes, not an hour).
        span = min(WINDOW_SECONDS, max(1.0, now - shown[0].at if shown else 0.0))

        def points(values: list[tuple[float, int]]) -> str:
            return " ".join(
                f"{width * (1 - (now - at) / span):.1f},{height - height * v / top:.1f}"
                for at, v in values
            )

        return Chart(
            width,
            height,
            points([(s.at, s.pending) for s in shown]),
            points([(s.at, s.consumer_lag) for s in shown if s.consumer_lag is not None]),
            top,
            len(shown),
            span,
        )

    async def run(self, engine: AsyncEngine, settings: OutboxSettings, every: float) -> None:
        """Sample until cancelled; a failed sample is logged and skipped, never fatal."""
        while True:
            try:
                self.add(await collect(engine, settings))
            except OutboxError as exc:
                log.warning("console lag sample failed: %s", exc)
            await asyncio.sleep(every)
