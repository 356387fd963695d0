"""Taking over from a frozen relay.

A relay that dies loses its sessions, and with them its lane locks or the WAL reader lock:
the others take over within a heartbeat. A relay that is *frozen* — SIGSTOPped, a stuck VM,
a host that stopped scheduling it — keeps its sessions, so its locks, for as long as the
freeze lasts: its lanes or the slot publish nothing meanwhile.

So at each heartbeat every relay looks for relays whose heartbeat is older than
``relay.takeover_seconds`` and ends their sessions that have been quiet as long (a
walsender whose client has not replied; any other session whose state has not changed:
idle, or one statement running that long) and were opened before that relay's last
heartbeat (a relay restarted under the same pid and host is not the silent one). A live
relay beats every second whatever else it does, so its sessions are never taken for a
frozen relay's. Their locks go with them and the relays
that remain take the lanes and the slot as after a crash. The frozen relay, if it wakes,
publishes nothing before a round trip on its lock session fails (relay/fence.py), then
reconnects and stands by or takes its share again.

Seeing another role's sessions' activity needs ``pg_read_all_stats``, ending them that role's
privileges or ``pg_signal_backend``: relays of one outbox run as one role
(docs/operations/frozen-relay.md); otherwise a WARNING says what is missing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import psycopg

from outbox.sessions import opened_by
from relay.database import Connection
from relay.metrics import RelayMetrics
from relay.store import RelayStore

log = logging.getLogger("relay")


@dataclass
class SilentRelay:
    relay_id: str
    hostname: str
    pid: int
    silent_for: float
    sessions: list[tuple[int, str]] = field(default_factory=list)  # idle long: to end
    unseen: int = 0  # its sessions whose activity this role may not see


def silent_relays(
    rows: list[tuple[str, str, int, float, int, str, float | None]], seconds: float
) -> list[SilentRelay]:
    """Group the rows of ``RelayStore.silent_sessions`` by relay, keeping only the sessions
    whose name is exactly one the relay opened (the query matches the pid alone) and that
    have been quiet for ``seconds``."""
    relays: dict[str, SilentRelay] = {}
    for relay_id, hostname, pid, silent_for, backend, application, quiet in rows:
        if not opened_by(application, pid, hostname):
            continue
        relay = relays.setdefault(relay_id, SilentRelay(relay_id, hostname, pid, silent_for))
        if quiet is None:
            relay.unseen += 1
        elif quiet >= seconds:
            relay.sessions.append((backend, application))
    return list(relays.values())


class Takeover:
    """Run at each heartbeat, on the registration's connection."""

    def __init__(
        self, relay_id: str, store: RelayStore, metrics: RelayMetrics, takeover_seconds: float
    ) -> None:
        self._relay_id = relay_id
        self._store = store
        self._metrics = metrics
        self.seconds = takeover_seconds
        self._refused: set[str] = set()  # relays whose sessions we may not end, said once

    async def run(self, conn: Connection) -> int:
        """End the idle sessions of silent relays; how many were ended."""
        params = {"seconds": self.seconds, "relay_id": self._relay_id}
        row = await (await conn.execute(self._store.any_silent, params)).fetchone()
        if not (row and row[0]):
            self._refused.clear()
            return 0
        cur = await conn.execute(self._store.silent_sessions, params)
        relays = silent_relays(list(await cur.fetchall()), self.seconds)
        ended_total = 0
        for relay in relays:
            ended, refused = await self._end(conn, relay)
            if relay.unseen:
                refused.append(
                    f"{relay.unseen} of its sessions' activity is hidden from this role "
                    "(pg_stat_activity shows it to the same role or pg_read_all_stats)"
                )
            ended_total += len(ended)
            if ended:
                self._metrics.takeovers.inc()
                log.warning(
                    "relay pid %d on %s has been silent for %.0f s (no heartbeat): ended its "
                    "%d idle database session(s) so that the other relays take over its "
                    "lanes or the WAL slot",
                    relay.pid,
                    relay.hostname,
                    relay.silent_for,
                    len(ended),
                    extra={"relay": relay.relay_id, "sessions": [name for _, name in ended]},
                )
            if refused and relay.relay_id not in self._refused:
                self._refused.add(relay.relay_id)
                log.warning(
                    "relay pid %d on %s has been silent for %.0f s, and this relay may not end "
                    "its sessions (%s): its lanes or the WAL slot stay with it until it wakes "
                    "or dies; run every relay of an outbox as one role, or GRANT "
                    "pg_signal_backend and pg_read_all_stats to the relays' role",
                    relay.pid,
                    relay.hostname,
                    relay.silent_for,
                    refused[0],
                    extra={"relay": relay.relay_id},
                )
        self._refused.intersection_update(r.relay_id for r in relays)
        return ended_total

    async def _end(
        self, conn: Connection, relay: SilentRelay
    ) -> tuple[list[tuple[int, str]], list[str]]:
        ended: list[tuple[int, str]] = []
        refused: list[str] = []
        for backend, name in relay.sessions:
            try:
                row = await (
                    await conn.execute(self._store.end_session, {"pid": backend})
                ).fetchone()
            except psycopg.errors.InsufficientPrivilege as exc:
                refused.append(f"{exc.diag.message_primary or exc} [SQLSTATE 42501]")
                continue
            if row and row[0]:
                ended.append((backend, name))
        return ended, refused
