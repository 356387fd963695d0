"""The relay's one database-outage guard: how every loop that talks to PostgreSQL (the
pipelines, the lane manager, the horizon watch, the WAL reader, the registration) meets a
failed statement or a lost connection.

* a missing table stops the relay: :class:`~outbox.errors.SchemaMissing` ("run `outbox db
  upgrade`");
* an outage by the SQLSTATE table (outbox/dberrors.py: a lost connection, a full disk, a
  read-only switch) is retried: the loop's connection is closed — whatever its
  transaction held is rolled back, and pending again — the shared :class:`Dependency`
  logs once per state change, and the loop sleeps a full-jitter backoff;
* anything else stops the relay with the framework's error for it (SQLSTATE and primary
  message kept).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import psycopg

from outbox.db import unavailable
from outbox.dberrors import is_transient
from outbox.errors import DatabaseUnavailable, SchemaMissing
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from relay.waiting import sleep_unless

# What a relay loop catches around its statements (the guard decides what they mean).
DATABASE_ERRORS = (psycopg.Error, DatabaseUnavailable)


def missing_table(exc: psycopg.errors.UndefinedTable) -> SchemaMissing:
    return SchemaMissing(f"relay table missing ({exc.diag.message_primary})")


def schema_missing(exc: BaseException) -> SchemaMissing | None:
    """:class:`SchemaMissing` when ``exc`` says a relay table does not exist."""
    if isinstance(exc, psycopg.errors.UndefinedTable):
        return missing_table(exc)
    return None


class OutageGuard:
    """One loop's guard. Its loops share their :class:`Dependency` (one log line per
    outage, not one per task); the failures in a row, which set the backoff, are the
    loop's own. ``count(exc)``: the error counter of the relay's metrics, if any."""

    def __init__(
        self,
        database: Dependency,
        retry: RetryPolicy,
        count: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.database = database
        self._retry = retry
        self._count = count
        self.failures = 0  # in a row

    def ok(self, *, report: bool = True) -> None:
        """A round went through: the database answers (``report``: say so to the shared
        state; a loop whose success says little of the others' leaves it to them)."""
        self.failures = 0
        if report:
            self.database.ok()

    def check(self, exc: BaseException) -> None:
        """Raise what stops the relay (see the module docstring); return for an outage."""
        missing = schema_missing(exc)
        if missing is not None:
            raise missing from None
        if not is_transient(exc):
            raise unavailable(exc) from None

    def failed(self, exc: BaseException) -> float:
        """Record an outage; the backoff before the loop's next try."""
        self.database.failed(unavailable(exc))
        if self._count is not None:
            self._count(exc)
        delay = self._retry.backoff(self.failures)
        self.failures += 1
        return delay

    async def survive(
        self,
        exc: BaseException,
        stopping: asyncio.Event,
        close: Callable[[], Awaitable[None]],
    ) -> None:
        """Handle ``exc`` from a round of the loop: raise what stops the relay; for an
        outage, close the loop's connection and sleep the backoff (cut short on stop)."""
        self.check(exc)
        delay = self.failed(exc)
        await close()
        await sleep_unless(stopping, delay)
