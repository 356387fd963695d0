"""A relay's identity and its row in the relays table, whatever its source.

Every relay registers — a WAL relay as a table relay — with its host, process id, source and
the lanes it owns (none for a source without lanes), and refreshes its row every
``relay.heartbeat_seconds`` on a connection of its own. The row is for people and tools
(`outbox status`, `outbox lag`, the console); nothing decides ownership by it. The same
connection holds the maintenance lock when this relay is the maintenance leader
(relay/maintenance/leader.py), and each heartbeat says whether it is. After its own beat a
relay ends the idle sessions of relays silent for ``relay.takeover_seconds`` (frozen:
relay/takeover.py); rows of relays silent for ten heartbeats (twice the takeover time at
least) are deleted by whichever relay beats next.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import psycopg

from relay.database import Connection, Database
from relay.fence import now as fence_now
from relay.fence import since
from relay.maintenance.leader import Leadership
from relay.outage import DATABASE_ERRORS, OutageGuard
from relay.store import RelayStore
from relay.takeover import Takeover
from relay.waiting import sleep_unless

log = logging.getLogger("relay")


@dataclass(frozen=True)
class Identity:
    """Who a relay is, for its row, its log lines and its metrics."""

    hostname: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    relay_id: str = ""

    def __post_init__(self) -> None:
        if not self.relay_id:
            unique = f"{self.hostname}:{self.pid}:{uuid.uuid4().hex[:6]}"
            object.__setattr__(self, "relay_id", unique)


class Registration:
    def __init__(
        self,
        identity: Identity,
        source: str,
        lanes: Callable[[], list[int]],
        database: Database,
        store: RelayStore,
        guard: OutageGuard,
        leadership: Leadership,
        heartbeat_seconds: float,
        takeover: Takeover,
    ) -> None:
        self.identity = identity
        self._source = source
        self._lanes = lanes  # the lanes the source owns now
        self._database = database
        self._store = store
        self._guard = guard
        self._leadership = leadership
        self._heartbeat = heartbeat_seconds
        self._takeover = takeover
        # Rows outlive a takeover: a relay is only forgotten after its sessions were ended.
        self._forget_after = max(10 * heartbeat_seconds + 5, 2 * takeover.seconds)
        self._conn: Connection | None = None

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def run(self, stopping: asyncio.Event) -> None:
        """Beat every heartbeat until ``stopping``; reconnects with backoff."""
        try:
            while not stopping.is_set():
                try:
                    if self._conn is None:
                        self._conn = await self._database.connect("outbox-relay-registry")
                    await self._beat(self._conn)
                    self._guard.ok()
                except DATABASE_ERRORS as exc:
                    await self._guard.survive(exc, stopping, self._drop)
                    continue
                await self._sleep(stopping)
        finally:
            await self._leadership.lost()

    async def _beat(self, conn: Connection) -> None:
        leading = await self._leadership.hold(conn)
        me = self.identity
        await conn.execute(
            self._store.heartbeat,
            {
                "relay_id": me.relay_id,
                "hostname": me.hostname,
                "pid": me.pid,
                "source": self._source,
                "lanes": self._lanes(),
                "maintenance": leading,
            },
        )
        await self._takeover.run(conn)
        await conn.execute(self._store.forget_dead, {"seconds": self._forget_after})

    async def _sleep(self, stopping: asyncio.Event) -> None:
        """Until the next beat; a wake far later than that means the process was frozen
        (SIGSTOP, a stopped VM) or its loop blocked: past the takeover time, the others may
        have ended its sessions (relay/takeover.py), which its sources find out at their
        next round trip. Said once, here, where the cause is known."""
        slept = fence_now()
        await sleep_unless(stopping, self._heartbeat)
        late = since(slept, fence_now()) - self._heartbeat
        if late > self._takeover.seconds:
            log.warning(
                "this relay was frozen for %.0f s (no heartbeat): the other relays may have "
                "taken over its lanes or the WAL slot meanwhile; it rejoins now",
                late,
            )

    async def _drop(self) -> None:
        """The connection is gone: so are the maintenance lock and the services."""
        conn, self._conn = self._conn, None
        await self._leadership.lost()
        if conn is not None and not conn.closed:
            with contextlib.suppress(psycopg.Error):
                await conn.close()

    async def close(self) -> None:
        """Leave the relays table; closing the connection releases the maintenance lock."""
        if self._conn is not None and not self._conn.closed:
            with contextlib.suppress(psycopg.Error):
                await self._conn.execute(self._store.leave, {"relay_id": self.identity.relay_id})
        await self._drop()
