"""The database connections of the consumer's hot path, kept open between transactions.

A fast run or a shared transaction takes one connection, opens its transaction with the
claim (BEGIN rides in the claim's pipeline: see ``InboxStore.begin_and_claim``), gives
the handlers a session bound to it, commits, and gives the connection back. Checking a
connection out of SQLAlchemy's pool and wrapping it costs ~75 µs of CPU each time (pool
events, reset, wrapper objects), a tenth of a whole transaction's client CPU at a few
events per transaction; taking one from this free list costs a list pop.

The connections come from an engine in ``AUTOCOMMIT`` mode (one statement = one commit:
the attempt markers that must be durable before handlers run need no transaction of
their own). Only the hot path uses them: the careful paths (savepoints, retries alone,
dead letters) keep ordinary pooled sessions.

A connection goes back on the free list only when it is idle and SQLAlchemy has no
transaction open on it; anything else (a cancelled statement, a broken socket, an error
during rollback) closes it for good, and the next transaction opens a fresh one.
No pre-ping: a connection that died while idle fails the next claim, which is an
infrastructure error (retried, no attempt charged) and closes it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine


@dataclass(frozen=True)
class Held:
    """One open connection, seen two ways: SQLAlchemy's (handlers' sessions bind to it)
    and the psycopg connection under it (the inbox's own statements)."""

    sa: AsyncConnection
    raw: psycopg.AsyncConnection[Any]

    @property
    def reusable(self) -> bool:
        raw = self.raw
        return (
            not raw.closed
            and not raw.broken
            and raw.info.transaction_status == TransactionStatus.IDLE
            and not self.sa.in_transaction()
        )


@dataclass
class Connections:
    """A free list of connections from ``engine`` (an ``AUTOCOMMIT`` engine)."""

    engine: AsyncEngine
    _free: list[Held] = field(default_factory=list)

    async def take(self) -> Held:
        while self._free:
            held = self._free.pop()
            if not held.raw.closed:  # what the driver already knows died while idle
                return held
            await _discard(held)
        sa = await self.engine.connect()
        try:
            raw = (await sa.get_raw_connection()).driver_connection
        except BaseException:
            await sa.close()
            raise
        assert isinstance(raw, psycopg.AsyncConnection) and raw.autocommit
        return Held(sa, raw)

    async def give(self, held: Held) -> None:
        """Back on the free list, or closed if it is not in a clean state."""
        if held.reusable:
            self._free.append(held)
            return
        await _discard(held)

    async def close(self) -> None:
        """Close every idle connection (those taken are closed when given back)."""
        free, self._free = self._free, []
        for held in free:
            await _discard(held)


async def _discard(held: Held) -> None:
    # Invalidate: the pool must not hand this connection out again.
    with contextlib.suppress(DBAPIError, psycopg.Error, OSError):
        await held.sa.invalidate()
    with contextlib.suppress(DBAPIError, psycopg.Error, OSError):
        await held.sa.close()
