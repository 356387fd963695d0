"""The table source's pending figures: rows waiting in the outbox and the oldest one's age
(the ``outbox_relay_pending_events`` and ``outbox_relay_oldest_pending_age_seconds``
gauges), read every ``relay.stats_interval_seconds`` on the lane manager's connection; and
the claim cursors' safety net, a share of the lanes looked at below their cursors in each
round, so that every lane is looked at once per ``SAFETY_NET_SECONDS`` (a walk of the lane
from its start, dead rows included: the cost of the net, off the claim path and spread out).
"""

from __future__ import annotations

import logging
import math
from typing import Any

from relay.database import Connection
from relay.metrics import RelayMetrics
from relay.sources.table.cursor import LANE_START, ClaimCursors
from relay.sources.table.store import ClaimStore

log = logging.getLogger("relay.lanes")
SAFETY_NET_SECONDS = 60.0


class PendingStats:
    def __init__(
        self,
        lanes: int,
        stats_interval_seconds: float,
        store: ClaimStore,
        cursors: ClaimCursors,
        metrics: RelayMetrics,
    ) -> None:
        self._lanes = lanes
        self._interval = stats_interval_seconds
        self._store = store
        self._cursors = cursors
        self._metrics = metrics
        self._net_from = 0  # the next lane of the safety net's rotation

    def _net_share(self, known: dict[int, int]) -> dict[int, int]:
        """This round's lanes for the safety net (with their cursors), in rotation."""
        total = self._lanes
        per_round = min(total, math.ceil(total * self._interval / SAFETY_NET_SECONDS))
        share = [(self._net_from + i) % total for i in range(per_round)]
        self._net_from = (self._net_from + per_round) % total
        return {lane: known[lane] for lane in share if lane in known}

    async def read(self, conn: Connection) -> None:
        """Pending rows and the oldest one's age; a share of the lanes is also looked at
        below the claim cursors for stranded rows (relay/sources/table/cursor.py)."""
        before = self._cursors.known()  # before the statements' snapshots are taken
        lanes = list(range(self._lanes))
        after = [before.get(lane, LANE_START) for lane in lanes]
        net = self._net_share(before)
        async with conn.transaction():
            await conn.execute(ClaimStore.INDEX_SCANS_ONLY)
            cur = await conn.execute(self._store.pending_stats, {"lanes": lanes, "after": after})
            rows: list[tuple[Any, ...]] = await cur.fetchall()
            below: list[tuple[Any, ...]] = []
            if net:
                cur = await conn.execute(
                    self._store.below_cursors, {"lanes": list(net), "after": list(net.values())}
                )
                below = await cur.fetchall()
        self._metrics.pending.set(float(sum(int(r[1]) for r in rows)))
        self._metrics.oldest_age.set(max((float(r[2]) for r in rows), default=0.0))
        stranded = self._cursors.stranded(before, {int(r[0]): int(r[1]) for r in below})
        if stranded:
            log.warning(
                "pending rows at or below the claim cursor of lanes %s (an id written outside "
                "the outbox's rules?): those lanes are scanned from their start again",
                stranded,
            )
            self._metrics.cursor_resets.inc(len(stranded))
