"""The relay's table source (``OUTBOX_SOURCE=table``, the default): rows of the outbox table,
claimed in ordering lanes.

Its rooms: lane ownership (``lanes.py``: one live relay per lane, by session advisory
locks), the claim -> publish -> acknowledge loops (``pipeline.py``) and which of them claim
(``claimers.py``), where each lane's claim starts (``cursor.py``, the pure rules; ``horizon.py``,
the readings), the pending figures and the cursors' safety net (``pending.py``), and its SQL
(``store.py``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

from outbox.settings import OutboxSettings, RelaySettings
from relay.kafka.wording import Wording
from relay.sources.base import Shared
from relay.sources.table.claimers import Claimers
from relay.sources.table.cursor import ClaimCursors
from relay.sources.table.horizon import HorizonWatch
from relay.sources.table.lanes import LaneManager
from relay.sources.table.pending import PendingStats
from relay.sources.table.pipeline import Pipeline
from relay.sources.table.store import ClaimStore

WORDING = Wording("rows", "in the outbox")


class TableSource:
    name = "table"
    wording = WORDING

    def __init__(
        self, settings: RelaySettings, lanes: int, store: ClaimStore, shared: Shared
    ) -> None:
        self._metrics = shared.metrics
        self.cursors = ClaimCursors()
        pending = PendingStats(
            lanes, settings.stats_interval_seconds, store, self.cursors, shared.metrics
        )
        self.lanes = LaneManager(
            settings, lanes, shared.database, store, shared.guard(), shared.metrics, pending
        )
        self.horizon = HorizonWatch(
            settings,
            shared.database,
            store,
            self.cursors,
            shared.metrics,
            shared.guard(counted=False),
        )
        claimers = Claimers(settings)
        self.pipelines = [
            Pipeline(
                i,
                settings,
                shared.database,
                store,
                self.lanes,
                shared.publisher,
                shared.kafka,
                shared.metrics,
                self.cursors,
                claimers,
                shared.verdicts,
                shared.guard(),
            )
            for i in range(settings.pipelines)
        ]

    @classmethod
    def from_settings(cls, settings: OutboxSettings, shared: Shared) -> TableSource:
        return cls(settings.relay, settings.lanes, ClaimStore.of(settings), shared)

    def tasks(self, stopping: asyncio.Event) -> dict[str, Coroutine[Any, Any, None]]:
        tasks = {"lanes": self.lanes.run(stopping), "horizon": self.horizon.run(stopping)}
        for i, pipeline in enumerate(self.pipelines):
            tasks[f"pipeline-{i}"] = pipeline.run(stopping)
        return tasks

    @property
    def connected(self) -> bool:
        return self.lanes.connected

    def owned_lanes(self) -> list[int]:
        return sorted(self.lanes.owned)

    def status(self, database_up: bool) -> dict[str, int | float | str]:
        m = self._metrics
        return {
            "pending": m.measured("outbox_relay_pending_events", database_up),
            "oldest_age_seconds": m.measured(
                "outbox_relay_oldest_pending_age_seconds", database_up, 3
            ),
            "owned_lanes": m.count("outbox_relay_owned_lanes"),
        }

    def retention_horizon(self) -> int | None:
        return self.cursors.horizon.value

    async def close(self) -> None:
        await self.lanes.close()
