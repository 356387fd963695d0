"""How the relay reaches PostgreSQL: its loops' connections (outbox/db.py, with the relay's
own URL when ``relay.database_url`` is set), the check that the URL is a session of its own,
and the maintenance services' engine.

Every lock a relay holds belongs to a *session*: its lanes and membership (the table
source), the slot's reader lock (the WAL source), the maintenance leader's lock (either).
Behind a transaction pooler the next statement may run on another client's server session
and two relays could both think they hold one, so the relay refuses to run there
(:class:`~outbox.errors.PoolerUnsupported`, exit 2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox.db import async_engine, replication_connection, unprepared_connection
from outbox.errors import PoolerUnsupported
from outbox.poolers import SessionProbe, probe_session, refusal
from outbox.sessions import relay_application
from outbox.settings import OutboxSettings

Connection = psycopg.AsyncConnection[tuple[Any, ...]]


def pooler_refusal(through: str) -> PoolerUnsupported:
    return refusal(
        "the relay",
        through,
        "lane ownership lives in session advisory locks, which a transaction pooler shares "
        "between clients",
        "OUTBOX_RELAY__DATABASE_URL",
    )


async def check_session(
    settings: OutboxSettings, conn: psycopg.AsyncConnection[Any] | None = None
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
class Database:
    """The relay's database, as its components reach it (they never see the settings)."""

    settings: OutboxSettings  # the relay's: settings.for_relay()
    # The relay process, named in every session (outbox/sessions.py): (pid, host).
    process: tuple[int, str] | None = None

    def _named(self, application_name: str) -> str:
        if self.process is None:
            return application_name
        return relay_application(application_name, *self.process)

    async def connect(self, application_name: str) -> Connection:
        """An autocommit connection that prepares nothing (``unprepared_connection``)."""
        return await unprepared_connection(self.settings, self._named(application_name))

    async def replication(self, application_name: str) -> Connection:
        """A replication connection (the WAL source streams its slot over one)."""
        return await replication_connection(self.settings, self._named(application_name))

    async def check_session(self, conn: psycopg.AsyncConnection[Any] | None = None) -> SessionProbe:
        return await check_session(self.settings, conn)

    def engine(self, **options: Any) -> AsyncEngine:
        """A SQLAlchemy engine (the maintenance services' retention)."""
        return async_engine(self.settings, **options)

    @property
    def safe_url(self) -> str:
        return self.settings.safe_database_url
