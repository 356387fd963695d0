"""The table source's horizon task: readings of the outbox id sequence and of the
transactions writing the outbox, fed to the claim cursors (relay/sources/table/cursor.py).

One task per relay, on a connection of its own, shared by all pipelines. A reading is two
statements sent together — the sequence's last value, then ``pg_locks`` — so the second
always runs after the first; what a reading costs is in docs/performance/relay.md. Every
``INTERVAL_SECONDS`` while ids move, backing off to ``poll_interval_seconds`` while they do
not.

The horizon cannot pass an outbox *writer* that stays open (idle in transaction after
``publish``, a forgotten prepared transaction): claims then walk the rows published since,
as they did before cursors existed. The task names it in one log line; ``outbox doctor``
names it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import psycopg

from outbox.settings import RelaySettings
from relay.database import Connection, Database
from relay.metrics import RelayMetrics
from relay.outage import DATABASE_ERRORS, OutageGuard
from relay.sources.table.cursor import ClaimCursors, Reading
from relay.sources.table.store import ClaimStore
from relay.waiting import sleep_unless

log = logging.getLogger("relay.horizon")

INTERVAL_SECONDS = 0.05
# A reading still waiting for its writers after this long is logged, naming them.
STUCK_AFTER_SECONDS = 10.0


class HorizonWatch:
    def __init__(
        self,
        settings: RelaySettings,
        database: Database,
        store: ClaimStore,
        cursors: ClaimCursors,
        metrics: RelayMetrics,
        guard: OutageGuard,
    ) -> None:
        self._settings = settings
        self._database = database
        self._store = store
        self._cursors = cursors
        self._metrics = metrics
        self._guard = guard
        self._conn: Connection | None = None
        self._unusable: str | None = None  # why the horizon is off (logged once per reason)
        self._stuck: frozenset[int] = frozenset()  # pids named in the last "stuck" line
        self._last_id: int | None = None

    async def run(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        interval = INTERVAL_SECONDS
        while not stopping.is_set():
            try:
                if self._conn is None:
                    self._conn = await self._connect()
                moved = await self._read(loop.time())
                self._guard.ok(report=False)
            except DATABASE_ERRORS as exc:
                # Readings are facts whatever the gap between them: nothing to forget.
                await self._guard.survive(exc, stopping, self._close)
                continue
            if self._unusable is not None:  # looked at again now and then
                interval = self._settings.stats_interval_seconds
            elif moved:
                interval = INTERVAL_SECONDS
            else:
                interval = min(interval * 2, self._settings.poll_interval_seconds)
            await sleep_unless(stopping, interval)
        await self._close()

    async def _connect(self) -> Connection:
        return await self._database.connect("outbox-relay-horizon")

    async def _close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    def _off(self, reason: str | None) -> None:
        """Horizon unusable for ``reason`` (None: usable again); logged once per change."""
        if reason == self._unusable:
            return
        if reason is None:
            log.info("claim horizon available: claims start at their lane's cursor")
        else:
            self._cursors.horizon.reset()
            self._cursors.forget()
            log.warning("claim horizon off: claims scan their lanes from the start (%s)", reason)
        self._unusable = reason

    async def _read(self, now: float) -> bool:
        """One reading; True when the sequence moved since the last one."""
        conn = self._conn
        assert conn is not None
        try:
            async with conn.pipeline():
                first = await conn.execute(self._store.last_id)
                second = await conn.execute(self._store.writers)
            row = await first.fetchone()
            locks = await second.fetchall()
        except psycopg.errors.InsufficientPrivilege as exc:
            self._off(
                f"{exc.diag.message_primary}; grant SELECT on the outbox id sequence to the "
                "relay's role (`outbox db sql --roles` does)"
            )
            return False
        if row is None:
            self._off("the outbox id column has no sequence")
            return False
        last_id, usable = int(row[0]), bool(row[1])
        if not usable:
            self._off(
                "the outbox id sequence caches values per session or does not count upwards: "
                "ALTER SEQUENCE ... CACHE 1 NO CYCLE (the defaults)"
            )
            return False
        self._off(None)
        writers = {str(vxid): pid for vxid, pid in locks}
        if not self._cursors.observe(Reading(last_id, frozenset(writers), now)):
            log.warning(
                "outbox id sequence went backwards (setval, RESTART, table re-created): "
                "claim cursors forgotten"
            )
        await self._report_stuck(now, writers)
        h = self._cursors.horizon
        self._metrics.horizon_age.set(now - h.reached_at if h.reached_at is not None else -1)
        moved, self._last_id = last_id != self._last_id, last_id
        return moved or h.value != last_id

    async def _report_stuck(self, now: float, writers: dict[str, int | None]) -> None:
        h = self._cursors.horizon
        since = h.waiting_since
        blocking = h.blockers(frozenset(writers))
        stuck = since is not None and now - since > STUCK_AFTER_SECONDS and bool(blocking)
        pids = frozenset(p for v, p in writers.items() if v in blocking and p is not None)
        if not stuck:
            if self._stuck:
                log.info("claim horizon moving again")
            self._stuck = frozenset()
            return
        if pids == self._stuck:
            return
        self._stuck = pids
        assert self._conn is not None and since is not None
        cur = await self._conn.execute(self._store.sessions, {"pids": sorted(pids)})
        who = [
            f"pid {pid} ({app or '-'}, {state or 'state hidden'})"
            for pid, app, state in await cur.fetchall()
        ]
        log.warning(
            "claim horizon held for %.0fs by a transaction that wrote the outbox and is still "
            "open: %s. Claims walk every row published since (end it, or set "
            "idle_in_transaction_session_timeout; `outbox doctor` names it too)",
            now - since,
            ", ".join(who) or f"{len(blocking)} prepared transaction(s)",
        )
