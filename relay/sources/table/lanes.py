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

The relays table (relay/registration.py) says which lanes a relay owns, for people and
tools; it is never used to decide ownership.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
from dataclasses import dataclass

from outbox.settings import RelaySettings
from relay.database import Connection, Database, pooler_refusal
from relay.metrics import RelayMetrics
from relay.outage import DATABASE_ERRORS, OutageGuard
from relay.sources.table.pending import PendingStats
from relay.sources.table.store import ClaimStore
from relay.waiting import sleep_unless

log = logging.getLogger("relay.lanes")


@dataclass(frozen=True)
class LaneMoves:
    """What one relay does to its lanes at a heartbeat."""

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
) -> LaneMoves:
    """What one relay should do this heartbeat (pure; see the module docstring)."""
    rng = rng or random.Random()
    share = math.ceil(lanes / max(live, 1))
    if len(owned) > share:
        return LaneMoves(share, rng.sample(sorted(owned), len(owned) - share), [], 0)
    if len(owned) == share:
        return LaneMoves(share, [], [], 0)
    free = [lane for lane in range(lanes) if lane not in held_any]
    taken = [lane for lane in range(lanes) if lane in held_any and lane not in owned]
    rng.shuffle(free)
    rng.shuffle(taken)
    # Free lanes first; held ones are tried too because pg_locks may lag a release.
    return LaneMoves(share, [], free + taken, share - len(owned))


class LaneManager:
    def __init__(
        self,
        settings: RelaySettings,
        lanes: int,
        database: Database,
        store: ClaimStore,
        guard: OutageGuard,
        metrics: RelayMetrics,
        pending: PendingStats,
    ) -> None:
        self._settings = settings
        self._lanes_total = lanes
        self._database = database
        self._store = store
        self._guard = guard
        self._metrics = metrics
        self._pending = pending
        self._conn: Connection | None = None
        self._backend = 0  # the lock connection's backend pid, from its join
        self._owned: frozenset[int] = frozenset()
        # Lanes won since their last claim: rows put back by their previous owner for an
        # unavailable partition are made due before they are claimed (Pipeline._take_over).
        self._fresh: set[int] = set()
        self._changed = asyncio.Event()

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
    async def _connect(self) -> Connection:
        # One heartbeat a second gains nothing from a plan cache.
        conn = await self._database.connect("outbox-relay-lanes")
        try:
            probe = await self._database.check_session(conn)
            log.debug("lock connection", extra={"session": probe.describe()})
            cur = await conn.execute(self._store.join)
            row = await cur.fetchone()
        except BaseException:
            await conn.close()
            raise
        assert row is not None
        self._backend = int(row[0])
        return conn

    async def _drop(self) -> None:
        conn, self._conn = self._conn, None
        self._set_owned(frozenset())
        if conn is not None and not conn.closed:
            await conn.close()

    # -- the loop ---------------------------------------------------------------------------
    async def run(self, stopping: asyncio.Event) -> None:
        """Rebalance every heartbeat until ``stopping``; reconnects with backoff. The
        pending figures ride on the same connection every ``stats_interval_seconds``."""
        stats_due = 0.0
        loop = asyncio.get_running_loop()
        while not stopping.is_set():
            try:
                if self._conn is None:
                    self._conn = await self._connect()
                await self._tick()
                self._guard.ok()
                if loop.time() >= stats_due:
                    await self._pending.read(self._conn)
                    stats_due = loop.time() + self._settings.stats_interval_seconds
            except DATABASE_ERRORS as exc:
                # Lanes are released until the connection is back (their locks died with it).
                await self._guard.survive(exc, stopping, self._drop)
                continue
            await sleep_unless(stopping, self._settings.heartbeat_seconds)

    async def _tick(self) -> None:
        conn = self._conn
        assert conn is not None
        cur = await conn.execute(self._store.cluster_view)
        row = await cur.fetchone()
        assert row is not None
        live, held_any = int(row[0]), set(row[1])
        if row[2] != self._backend:
            # The locks stayed with the backend that took them: this relay owns nothing.
            await self._drop()
            raise pooler_refusal(
                f"a connection pooler (the lock connection moved from backend {self._backend} "
                f"to {row[2]} between two statements)"
            )
        moves = rebalance(self._owned, held_any, live, self._lanes_total)
        owned = set(self._owned)
        if moves.release:
            await conn.execute(self._store.release, {"lanes": moves.release})
            owned -= set(moves.release)
            log.info("released lanes", extra={"lanes": len(moves.release), "share": moves.share})
        elif moves.want:
            cur = await conn.execute(
                self._store.acquire, {"lanes": moves.candidates, "want": moves.want}
            )
            won = {int(r[0]) for r in await cur.fetchall()}
            if won:
                owned |= won
                log.info("acquired lanes", extra={"lanes": len(won), "share": moves.share})
        self._set_owned(frozenset(owned))

    async def close(self) -> None:
        """Release every lane (closing the session does)."""
        await self._drop()
