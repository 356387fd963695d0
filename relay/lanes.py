"""Lane ownership: exactly one live relay publishes a lane at a time.

Each relay keeps one dedicated, long-lived connection (autocommit) holding:

* a *membership* lock ``(members_ns, backend pid)`` — the set of live relays is read from
  ``pg_locks``, so a relay that dies drops out the moment PostgreSQL closes its session,
  with no heartbeat timeout to wait for;
* one session lock ``(lanes_ns, lane)`` per owned lane. PostgreSQL releases them when the
  connection dies, so a crashed relay's lanes are free for the others at once.

Both locks belong to the *session*, so the lock connection must be a session of its own:
PostgreSQL itself or a session pooler. Behind a transaction pooler the next statement may
run on another client's server session, and two relays could own one lane. Each time the
connection is made it is probed (``outbox/poolers.py``) and the relay refuses to run with
:class:`~outbox.errors.PoolerUnsupported` (exit 2) when it is not a session of its own;
every heartbeat also checks that the backend which joined is still the one answering.

Every ``heartbeat_seconds`` the manager rebalances: target share = ceil(lanes / live
relays); a relay above its share releases extras, one below tries free lanes (those no one
holds first, in random order so that concurrent relays do not all race for the same lane).
Takeover of a dead relay's lanes therefore takes at most one heartbeat period.

The ``relays`` table is a registry for humans and metrics (who runs where, which lanes);
it is never used to decide ownership.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import random
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.db import unavailable, unprepared_connection
from outbox.dberrors import is_transient
from outbox.errors import DatabaseUnavailable, PoolerUnsupported, SchemaMissing
from outbox.outages import Dependency
from outbox.poolers import SessionProbe, probe_session, refusal
from outbox.resilience.retry import RetryPolicy
from outbox.settings import OutboxSettings
from relay.cursor import LANE_START, ClaimCursors
from relay.metrics import RelayMetrics
from relay.store import RelayStore
from relay.waiting import sleep_unless

log = logging.getLogger("relay.lanes")
# Every lane's rows below its claim cursor are looked at once in this period, a share of
# the lanes in each pending-stats round (a walk of the lane from its start, dead rows
# included: the cost of the safety net, off the claim path and spread out).
SAFETY_NET_SECONDS = 60.0


def pooler_refusal(through: str) -> PoolerUnsupported:
    return refusal(
        "the relay",
        through,
        "lane ownership lives in session advisory locks, which a transaction pooler shares "
        "between clients",
        "OUTBOX_RELAY__DATABASE_URL",
    )


async def check_session(
    settings: OutboxSettings, conn: psycopg.AsyncConnection[tuple[object, ...]] | None = None
) -> SessionProbe:
    """What the relay's URL goes through; :class:`PoolerUnsupported` unless it is a session
    of its own (``db_pooler=transaction`` is taken at its word, without a probe)."""
    if settings.db_pooler == "transaction":
        raise pooler_refusal("a transaction pooler (OUTBOX_DB_POOLER=transaction)")
    probe = await probe_session(settings, conn=conn)
    if not probe.stable:
        raise pooler_refusal(probe.describe())
    return probe


@dataclass(frozen=True)
class Plan:
    share: int
    release: list[int]  # owned lanes to give up
    candidates: list[int]  # lanes to try, in order, when below the share
    want: int  # how many of them to win


def rebalance(
    owned: frozenset[int],
    held_any: set[int],
    live: int,
    lanes: int,
    rng: random.Random | None = None,
) -> Plan:
    """What one relay should do this heartbeat (pure; see the module docstring)."""
    rng = rng or random.Random()
    share = math.ceil(lanes / max(live, 1))
    if len(owned) > share:
        return Plan(share, rng.sample(sorted(owned), len(owned) - share), [], 0)
    if len(owned) == share:
        return Plan(share, [], [], 0)
    free = [lane for lane in range(lanes) if lane not in held_any]
    taken = [lane for lane in range(lanes) if lane in held_any and lane not in owned]
    rng.shuffle(free)
    rng.shuffle(taken)
    # Free lanes first; held ones are tried too because pg_locks may lag a release.
    return Plan(share, [], free + taken, share - len(owned))


class LaneManager:
    def __init__(
        self,
        settings: OutboxSettings,
        store: RelayStore,
        metrics: RelayMetrics,
        cursors: ClaimCursors | None = None,
    ) -> None:
        self._settings = settings
        self._cursors = cursors or ClaimCursors()
        self._net_from = 0  # the next lane of the safety net's rotation
        # Shared with the pipelines: one log line per database outage, not one per task.
        self.database = Dependency("database", log)
        self._store = store
        self._metrics = metrics
        self.relay_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        self._conn: psycopg.AsyncConnection[tuple[object, ...]] | None = None
        self._backend = 0  # the lock connection's backend pid, from its join
        self._owned: frozenset[int] = frozenset()
        # Lanes won since their last claim: rows put back by their previous owner for an
        # unavailable partition are made due before they are claimed (Pipeline._take_over).
        self._fresh: set[int] = set()
        self._changed = asyncio.Event()
        self._retry = RetryPolicy.from_settings(settings.retry)

    @property
    def owned(self) -> frozenset[int]:
        """Lanes this relay holds right now (empty while its lock connection is down)."""
        return self._owned

    @property
    def fresh(self) -> frozenset[int]:
        """Owned lanes not claimed since this relay won them."""
        return frozenset(self._fresh)

    def settle(self, lanes: list[int]) -> None:
        """``lanes`` were taken over (see :attr:`fresh`)."""
        self._fresh.difference_update(lanes)

    @property
    def connected(self) -> bool:
        return self._conn is not None and not self._conn.closed

    async def wait_changed(self, seconds: float) -> None:
        """Sleep until ownership changes or ``seconds`` pass."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)

    def _set_owned(self, lanes: frozenset[int]) -> None:
        if lanes != self._owned:
            self._fresh = (self._fresh | (lanes - self._owned)) & lanes
            self._owned = lanes
            self._metrics.owned_lanes.set(len(lanes))
            self._changed.set()
            self._changed = asyncio.Event()

    # -- connection -----------------------------------------------------------------------------
    async def _connect(self) -> psycopg.AsyncConnection[tuple[object, ...]]:
        # One heartbeat a second gains nothing from a plan cache.
        conn = await unprepared_connection(self._settings, "outbox-relay-lanes")
        try:
            probe = await check_session(self._settings, conn)
            log.debug("lock connection", extra={"session": probe.describe()})
            cur = await conn.execute(self._store.join)
            row = await cur.fetchone()
        except BaseException:
            await conn.close()
            raise
        assert row is not None
        self._backend = int(row[0])  # type: ignore[call-overload]
        return conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._set_owned(frozenset())
        if conn is not None and not conn.closed:
            await conn.close()

    # -- the loop ---------------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        """Rebalance every heartbeat until ``stopping``; reconnects with backoff."""
        failures = 0
        stats_due = 0.0
        loop = asyncio.get_running_loop()
        while not stopping.is_set():
            try:
                if self._conn is None:
                    self._conn = await self._connect()
                await self._tick()
                self.database.ok()
                if loop.time() >= stats_due:
                    await self._stats()
                    stats_due = loop.time() + self._settings.relay.stats_interval_seconds
                failures = 0
                delay = self._settings.relay.heartbeat_seconds
            except psycopg.errors.UndefinedTable as exc:
                raise SchemaMissing(f"relay table missing ({exc.diag.message_primary})") from None
            except (psycopg.Error, DatabaseUnavailable) as exc:
                if not is_transient(exc):  # the SQLSTATE table: a read-only switch too
                    raise
                # Lanes are released until the connection is back (their locks died with it).
                self.database.failed(unavailable(exc))
                self._metrics.errors.labels(type(exc).__name__).inc()
                await self._drop()
                delay = self._retry.backoff(failures)
                failures += 1
            await sleep_unless(stopping, delay)

    async def _tick(self) -> None:
        conn = self._conn
        assert conn is not None
        lanes_total = self._settings.lanes
        cur = await conn.execute(self._store.cluster_view)
        row = await cur.fetchone()
        assert row is not None
        live, held_any = int(row[0]), set(row[1])  # type: ignore[call-overload]
        if row[2] != self._backend:
            # The locks stayed with the backend that took them: this relay owns nothing.
            await self._drop()
            raise pooler_refusal(
                f"a connection pooler (the lock connection moved from backend {self._backend} "
                f"to {row[2]} between two statements)"
            )
        plan = rebalance(self._owned, held_any, live, lanes_total)
        owned = set(self._owned)
        if plan.release:
            await conn.execute(self._store.release, {"lanes": plan.release})
            owned -= set(plan.release)
            log.info("released lanes", extra={"lanes": len(plan.release), "share": plan.share})
        elif plan.want:
            cur = await conn.execute(
                self._store.acquire, {"lanes": plan.candidates, "want": plan.want}
            )
            won = {int(r[0]) for r in await cur.fetchall()}  # type: ignore[call-overload]
            if won:
                owned |= won
                log.info("acquired lanes", extra={"lanes": len(won), "share": plan.share})
        self._set_owned(frozenset(owned))
        await conn.execute(
            self._store.heartbeat,
            {
                "relay_id": self.relay_id,
                "hostname": socket.gethostname(),
                "pid": os.getpid(),
                "lanes": sorted(owned),
            },
        )
        await conn.execute(
            self._store.forget_dead, {"seconds": 10 * self._settings.relay.heartbeat_seconds + 5}
        )

    def _net_share(self, known: dict[int, int]) -> dict[int, int]:
        """This round's lanes for the safety net (with their cursors), in rotation."""
        total = self._settings.lanes
        per_round = min(
            total,
            math.ceil(total * self._settings.relay.stats_interval_seconds / SAFETY_NET_SECONDS),
        )
        share = [(self._net_from + i) % total for i in range(per_round)]
        self._net_from = (self._net_from + per_round) % total
        return {lane: known[lane] for lane in share if lane in known}

    async def _stats(self) -> None:
        """Pending rows and the oldest one's age; a share of the lanes is also looked at
        below the claim cursors for stranded rows (relay/cursor.py)."""
        conn = self._conn
        assert conn is not None
        before = self._cursors.known()  # before the statements' snapshots are taken
        lanes = list(range(self._settings.lanes))
        after = [before.get(lane, LANE_START) for lane in lanes]
        net = self._net_share(before)
        async with conn.transaction():
            await conn.execute(RelayStore.INDEX_SCANS_ONLY)
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

    async def close(self) -> None:
        """Leave the registry and release every lane (closing the session does both)."""
        if self._conn is not None and not self._conn.closed:
            with contextlib.suppress(psycopg.Error):
                await self._conn.execute(self._store.leave, {"relay_id": self.relay_id})
        await self._drop()
