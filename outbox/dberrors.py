"""What a database error says about the database: the one SQLSTATE table of the framework.

An error is classified by its SQLSTATE, never by where it was raised: a disk-full error is
the database's state whether the relay's claim, the consumer's attempt marker or a
handler's own INSERT met it. Three kinds matter:

* **outage** — the database cannot do work right now (a lost connection, a full disk, a
  shutdown, a read-only switch during a failover). Nothing of the transaction happened; it
  is rolled back and tried again after a backoff, logged once per state change, and never
  charged to an event (no attempt counted, no dead letter, no ``failed`` row or intent).
* **conflict** — this transaction lost a race with another one (serialization failure,
  deadlock). Run again at once (bounded), no attempt counted.
* **refused** — the database refuses this configuration for good (credentials, an unknown
  database): daemons stop with exit code 2.

Anything else (a constraint violation, bad SQL, a statement timeout) is not the database's
state but the statement's own error, and keeps the caller's rules (a handler's error
counts an attempt).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

import psycopg
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from outbox.errors import DatabaseRefused, DatabaseUnavailable


class DbTrouble(enum.Enum):
    OUTAGE = "outage"
    CONFLICT = "conflict"
    REFUSED = "refused"


OUTAGE, CONFLICT, REFUSED = DbTrouble.OUTAGE, DbTrouble.CONFLICT, DbTrouble.REFUSED

# SQLSTATE (a full code, or its two-character class) -> (kind, what it means). A full code
# wins over its class. The errors reference renders this table (docs/reference/errors.md).
SQLSTATES: Mapping[str, tuple[DbTrouble, str]] = MappingProxyType(
    {
        "08": (OUTAGE, "connection exception: the connection failed or was lost"),
        "25006": (OUTAGE, "read-only transaction: a standby, or writes switched off (failover)"),
        "53": (OUTAGE, "insufficient resources: disk full, out of memory, too many connections"),
        "57P01": (OUTAGE, "admin shutdown"),
        "57P02": (OUTAGE, "crash shutdown"),
        "57P03": (OUTAGE, "cannot connect now: starting up, shutting down, in recovery"),
        "58": (OUTAGE, "system error: an I/O error, a file the server cannot read"),
        "40001": (CONFLICT, "serialization failure"),
        "40P01": (CONFLICT, "deadlock detected"),
        "28": (REFUSED, "invalid authorization: authentication failed, access refused"),
        "3D000": (REFUSED, "unknown database"),
        "42501": (REFUSED, "insufficient privilege: a grant is missing (outbox db sql --roles)"),
    }
)


def sqlstate_trouble(sqlstate: str | None) -> DbTrouble | None:
    """The kind of ``sqlstate`` in :data:`SQLSTATES` (its full code first, then its class)."""
    if not sqlstate:
        return None
    found = SQLSTATES.get(sqlstate) or SQLSTATES.get(sqlstate[:2])
    return found[0] if found else None


def trouble(exc: BaseException) -> DbTrouble | None:
    """What ``exc`` says about the database: an outage, a conflict, a refusal, or None (the
    statement's own error, or no database error at all).

    A server error is judged by its SQLSTATE alone. A failure with no SQLSTATE is a
    connection that failed or was lost before the server answered (an outage), unless the
    framework already judged it (:class:`DatabaseRefused`: refused). A SQLAlchemy error is
    judged by the driver error it wraps; a pool whose connections stayed busy for its whole
    timeout is a database too slow to answer (an outage).
    """
    if isinstance(exc, DatabaseRefused):
        return REFUSED
    if isinstance(exc, DatabaseUnavailable):
        # Translated already: judged by the SQLSTATE it kept, when the server gave one (a
        # statement timeout is translated too, and is the statement's own error).
        return sqlstate_trouble(exc.sqlstate) if exc.sqlstate else OUTAGE
    if isinstance(exc, PoolTimeout):
        return OUTAGE
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if isinstance(orig, psycopg.Error):
        if orig.sqlstate:
            return sqlstate_trouble(orig.sqlstate)
        if isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError):
            return OUTAGE
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return OUTAGE
    return None


def is_outage(exc: BaseException) -> bool:
    """The database cannot do work right now (see :func:`trouble`)."""
    return trouble(exc) is OUTAGE


def is_conflict(exc: BaseException) -> bool:
    """A serialization failure or a deadlock: worth running again at once."""
    return trouble(exc) is CONFLICT


def is_transient(exc: BaseException) -> bool:
    """Worth another try later, and charged to nothing, for a daemon's own statements: an
    outage or a conflict of the table, and (as the driver classes them) any other
    operational error, such as a statement timeout or a lock not available."""
    found = trouble(exc)
    if found is not None:
        return found is not REFUSED
    if isinstance(exc, DatabaseUnavailable | OperationalError | InterfaceError):
        return True
    return isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError)
