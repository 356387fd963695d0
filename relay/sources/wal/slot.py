"""Which relay reads the slot: the one holding the reader lock, a session advisory lock on
its SQL connection (relay/sources/wal/store.py). The slot itself admits one streaming
session (a second ``START_REPLICATION`` fails with SQLSTATE 55006); the other relays stand
by, trying the lock every ``relay.poll_interval_seconds``, and the first to get it after the
reader's connections die takes over from the slot's confirmed position.

A slot that disappears or is invalidated under the reader (``wal_status = 'lost'``: past
``max_slot_wal_keep_size``) stops the relay at once with :class:`~relay.errors.SlotLost`:
the WAL it held may be gone, and a new slot would silently start from now.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg
from psycopg.rows import dict_row

from outbox.errors import WalPrivilegeMissing, WalSlotMismatch
from outbox.ops.store import WAL_MAY_REPLICATE, WAL_SLOT
from outbox.ops.wal_slot import SlotState
from relay.database import Connection
from relay.errors import SlotLost, SlotMissing
from relay.fence import Fence
from relay.fence import now as fence_now
from relay.sources.wal import failover
from relay.sources.wal.store import WalStore, lsn_int, lsn_text
from relay.waiting import sleep_unless

log = logging.getLogger("relay.wal")

# SQLSTATEs of a slot gone under the reader: dropped (undefined_object), invalidated
# (object_not_in_prerequisite_state: "This slot has been invalidated because it exceeded
# the maximum reserved size").
_DROPPED, _INVALID = "42704", "55000"

# The set-up script an administrator runs for a role: (database, role) -> SQL.
SetupSql = Callable[[str, str], str]


class ReaderLock:
    """This relay's claim on the slot: whether it reads it, and how far it confirmed."""

    def __init__(
        self,
        slot: str,
        store: WalStore,
        poll_interval_seconds: float,
        setup_sql: SetupSql,
        fence: Fence,
    ) -> None:
        self.slot = slot
        self.fence = fence  # answered by every round trip on the lock's connection
        self._store = store
        self._poll = poll_interval_seconds
        self._setup_sql = setup_sql
        self.reading = False  # holds the reader lock
        self.confirmed: int | None = None  # the slot's confirmed LSN, as last seen or set
        self._checked_role = False  # the role's REPLICATION attribute was looked at
        self._seen: failover.Seen | None = None  # timeline and LSN at the last look

    async def take(self, conn: Connection, stopping: asyncio.Event) -> None:
        """Become the reader, or stand by for one poll interval."""
        slot = self.slot
        async with conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(WAL_SLOT, {"slot": slot})
            row = await cur.fetchone()
        await self._through_failover(conn, None if row is None else SlotState(**row))
        if row is None:
            if self.confirmed is not None:
                # This process read the slot before (it went away while the reader was
                # reconnecting): the events past what it confirmed may be gone.
                since = lsn_text(self.confirmed)
                raise SlotLost(slot, since, "dropped while the relay was reconnecting")
            raise SlotMissing(slot, self._seen.timeline if self._seen else None)
        state = SlotState(**row)
        why = state.mismatch(conn.info.dbname)
        if why is not None:
            raise WalSlotMismatch(
                f"replication slot {slot!r} {why}: name another one in OUTBOX_WAL__SLOT, "
                "or drop it and run `outbox wal setup`"
            )
        confirmed = state.confirmed_flush_lsn
        if state.wal_status == "lost":
            raise SlotLost(slot, confirmed, "invalidated: wal_status is 'lost'")
        if not self._checked_role:
            await self._check_role(conn)
        sent = fence_now()
        got = await (await conn.execute(self._store.try_lock)).fetchone()
        if not (got and got[0]):
            await sleep_unless(stopping, self._poll)
            return
        self.reading = True
        self.fence.answered(sent)
        self.confirmed = lsn_int(confirmed) if confirmed else None
        log.info("reading the slot", extra={"slot": slot, "confirmed_lsn": confirmed})

    async def _through_failover(self, conn: Connection, state: SlotState | None) -> None:
        """Stop when a failover left this server without the slot (failover.py); else note
        the timeline and the last confirmed LSN for the next look."""
        now = await failover.timeline(conn)
        before = self._seen
        if before is not None and self.confirmed is not None:
            before = failover.Seen(before.timeline, lsn_text(self.confirmed))
        lost = failover.lost_in_failover(self.slot, before, now, state)
        if lost is not None:
            raise lost
        if now is not None:
            confirmed = state.confirmed_flush_lsn if state is not None else None
            if self.confirmed is not None:
                confirmed = lsn_text(self.confirmed)
            self._seen = failover.Seen(now, confirmed)

    async def _check_role(self, conn: Connection) -> None:
        """A role without REPLICATION cannot stream the slot: stop with the SQL to run."""
        row = await (await conn.execute(WAL_MAY_REPLICATE)).fetchone()
        if row is not None and not row[0]:
            user = str(row[1])
            raise WalPrivilegeMissing(
                f"role {user} may not read replication slot {self.slot!r} (it "
                f'needs REPLICATION): an administrator runs ALTER ROLE "{user}" WITH '
                "REPLICATION; (all the set-up: `outbox wal setup --print-sql --role "
                f"{user}`)",
                sql=self._setup_sql(conn.info.dbname, user),
                sqlstate="42501",
            )
        self._checked_role = True

    def gone(self, exc: psycopg.Error) -> None:
        """Raise :class:`SlotLost` when ``exc`` says the slot went away under the reader."""
        sqlstate = exc.sqlstate or ""
        if not self.reading or sqlstate not in (_DROPPED, _INVALID):
            return
        message = exc.diag.message_primary or str(exc)
        if "replication slot" not in message:
            return
        since = lsn_text(self.confirmed) if self.confirmed is not None else None
        raise SlotLost(self.slot, since, f"{message} [SQLSTATE {sqlstate}]")

    def released(self) -> None:
        """Its connection closed: the lock went with it."""
        if self.reading:
            log.info("stopped reading the slot", extra={"slot": self.slot})
        self.reading = False
        self.fence.forget()
