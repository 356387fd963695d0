"""The relay's horizon task: readings of the outbox id sequence and of the transactions
writing the outbox, fed to the claim cursors (relay/cursor.py), and the vacuum figures
(dead rows, the oldest snapshot) for the metrics.

One task per relay, on a connection of its own, shared by all pipelines. A reading is two
statements sent together — the sequence's last value, then ``pg_locks`` — so the second
always runs after the first. Measured on this machine (PostgreSQL 15, 2 cores): the
``pg_locks`` statement costs ~0.13 ms of server time, a reading ~0.4 ms round trip. Every
50 ms while ids move, backing off to ``poll_interval_seconds`` while they do not.

The horizon cannot pass an outbox *writer* that stays open (idle in transaction after
``publish``, a forgotten prepared transaction): claims then walk the rows published since,
as they did before cursors existed. The task names it in one log line; ``outbox doctor``
names it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import psycopg

from outbox.db import unavailable, unprepared_connection
from outbox.dberrors import is_transient
from outbox.errors import DatabaseUnavailable, SchemaMissing
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay.cursor import ClaimCursors, Reading
from relay.metrics import RelayMetrics
from relay.store import RelayStore
from relay.waiting import sleep_unless

log = logging.getLogger("relay.horizon")

INTERVAL_SECONDS = 0.05
# A reading still waiting for its writers after this long is logged, naming them.
STUCK_AFTER_SECONDS = 10.0


class HorizonWatch:
    def __init__(
        self,
        settings: OutboxSettings,
        store: RelayStore,
        cursors: ClaimCursors,
        metrics: RelayMetrics,
        database: Dependency,
    ) -> None:
        self._settings = settings
        self._store = store
        self._cursors = cursors
        self._metrics = metrics
        self._database = database
        self._retry = RetryPolicy.from_settings(settings.retry)
        self._conn: psycopg.AsyncConnection[tuple[Any, ...]] | None = None
        self._unusable: str | None = None  # why the horizon is off (logged once per reason)
        self._stuck: frozenset[int] = frozenset()  # pids named in the last "stuck" line
        self._last_id: int | None = None
        # (kind, pid, xid) of the oldest snapshot -> when this task first saw it: its age
        # when PostgreSQL hides the start time from this role.
        self._first_seen: tuple[tuple[object, ...], float] | None = None

    async def run(self, stopping: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        failures = 0
        interval = INTERVAL_SECONDS
        stats_due = 0.0
        while not stopping.is_set():
            try:
                if self._conn is None:
                    self._conn = await self._connect()
                moved = await self._read(loop.time())
                if loop.time() >= stats_due:
                    await self._vacuum_stats(loop.time())
                    stats_due = loop.time() + self._settings.relay.stats_interval_seconds
                failures = 0
            except psycopg.errors.UndefinedTable as exc:
                raise SchemaMissing(f"relay table missing ({exc.diag.message_primary})") from None
            except (psycopg.Error, DatabaseUnavailable) as exc:
                if not is_transient(exc):  # the SQLSTATE table: a read-only switch too
                    raise
                # Readings are facts whatever the gap between them: nothing to forget.
                self._database.failed(unavailable(exc))
                await self._close()
                await sleep_unless(stopping, self._retry.backoff(failures))
                failures += 1
                continue
            if self._unusable is not None:  # looked at again with the vacuum figures
                interval = self._settings.relay.stats_interval_seconds
            elif moved:
                interval = INTERVAL_SECONDS
            else:
                interval = min(interval * 2, self._settings.relay.poll_interval_seconds)
            await sleep_unless(stopping, min(interval, max(stats_due - loop.time(), 0.0)))
        await self._close()

    async def _connect(self) -> psycopg.AsyncConnection[tuple[Any, ...]]:
        return await unprepared_connection(self._settings, "outbox-relay-horizon")

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

    async def _vacuum_stats(self, now: float) -> None:
        assert self._conn is not None
        cur = await self._conn.execute(self._store.vacuum_stats)
        row = await cur.fetchone()
        assert row is not None
        dead, pid, xid, seconds = row
        self._metrics.dead_rows.set(float(dead or 0))
        if xid is None:
            self._first_seen = None
            self._metrics.oldest_snapshot_age.set(0)
            return
        key = (pid, xid)
        if self._first_seen is None or self._first_seen[0] != key:
            self._first_seen = (key, now)
        age = float(seconds) if seconds is not None else now - self._first_seen[1]
        self._metrics.oldest_snapshot_age.set(age)
