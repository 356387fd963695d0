"""Engines and database error translation shared by every package."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg.errors
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.dberrors import OUTAGE, REFUSED, sqlstate_trouble, trouble
from outbox.errors import (
    DatabaseRefused,
    DatabaseUnavailable,
    ReplicationRefused,
    SchemaMissing,
)
from outbox.settings import OutboxSettings


def connect_options(settings: OutboxSettings) -> dict[str, Any]:
    """psycopg ``connect()`` options for ``settings.db_pooler``.

    Behind a transaction pooler consecutive transactions of one client connection run on
    different server sessions, so a statement psycopg prepared on one (it does so after
    five runs by default) is missing on the next ("prepared statement "_pg3_0" does not
    exist") or already there ("... already exists"). ``prepare_threshold=None`` keeps every
    statement unnamed: parsed and planned per execution, nothing left on the server.
    """
    return {"prepare_threshold": None} if settings.db_pooler == "transaction" else {}


async def unprepared_connection(
    settings: OutboxSettings, application_name: str
) -> psycopg.AsyncConnection[tuple[Any, ...]]:
    """An autocommit connection that never prepares a statement (the daemons' own: their
    statements run once a second or are planned per call anyway, and a prepared one would
    break on the next server session behind a pooler that slipped past the session probe).
    A failure to connect is :func:`unavailable`'s error: the cause, never the DSN."""
    try:
        return await psycopg.AsyncConnection.connect(
            settings.libpq_dsn,
            autocommit=True,
            prepare_threshold=None,
            application_name=application_name,
        )
    except psycopg.Error as exc:
        raise unavailable(exc) from None


async def replication_connection(
    settings: OutboxSettings, application_name: str
) -> psycopg.AsyncConnection[tuple[Any, ...]]:
    """A replication connection (``replication=database``: a walsender that streams a
    logical slot) to ``settings``' database; libpq applies every setting of the URL (TLS,
    SCRAM). :class:`ReplicationRefused` when the server or a pooler refuses replication for
    good (the role lacks REPLICATION; PgBouncer and other poolers do not pass it); other
    failures are psycopg's errors, as for any connection."""
    try:
        return await psycopg.AsyncConnection.connect(
            settings.libpq_dsn,
            autocommit=True,
            replication="database",
            application_name=application_name,
        )
    except psycopg.OperationalError as exc:
        text = str(exc)
        if not any(word in text for word in ("replication", "WAL sender", "walsender")):
            raise
        last = text.strip().splitlines()[-1]
        raise ReplicationRefused(
            f"the WAL source's replication connection was refused: {_scrub(last)}; the "
            "relay's role needs REPLICATION (`outbox wal setup --print-sql`) and "
            "relay.database_url must reach PostgreSQL directly (connection poolers do not "
            "pass replication connections)"
        ) from None


def _engine_options(settings: OutboxSettings, kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs.setdefault("pool_pre_ping", True)
    # The caller's own connect_args win over the pooler's.
    kwargs["connect_args"] = connect_options(settings) | kwargs.get("connect_args", {})
    return kwargs


def sync_engine(settings: OutboxSettings, **kwargs: Any) -> Engine:
    """A sync SQLAlchemy engine for ``settings.database_url`` (psycopg 3), safe behind the
    pooler ``settings.db_pooler`` names."""
    return create_engine(settings.sqlalchemy_url, **_engine_options(settings, kwargs))


def async_engine(settings: OutboxSettings, **kwargs: Any) -> AsyncEngine:
    """An asyncio SQLAlchemy engine for ``settings.database_url`` (psycopg 3), safe behind
    the pooler ``settings.db_pooler`` names."""
    return create_async_engine(settings.sqlalchemy_url, **_engine_options(settings, kwargs))


# Connection failures carry no SQLSTATE in psycopg (there is no server result yet): the
# cause is read from libpq's message. Each pattern gives the SQLSTATE the server sent (when
# it answered), a short cause, and whether retrying can help.
_CONNECT_CAUSES: tuple[tuple[re.Pattern[str], str | None, str, bool], ...] = (
    (re.compile(r"password authentication failed"), "28P01", "authentication failed", False),
    (re.compile(r"no pg_hba\.conf entry|role .* does not exist"), "28000", "access refused", False),
    (re.compile(r"database .* does not exist"), "3D000", "unknown database", False),
    (
        re.compile(r"SSL|certificate|sslmode|TLS", re.I),
        None,
        "TLS refused or not verified",
        False,
    ),
    (
        re.compile(r"failed to resolve host|could not translate host name|Name or service"),
        None,
        "unknown host",
        False,
    ),
    (re.compile(r"Connection refused"), None, "connection refused", True),
    (re.compile(r"timeout expired|timed out", re.I), None, "connection timed out", True),
    (
        re.compile(r"the database system is (starting up|shutting down|in recovery)"),
        "57P03",
        "database starting or stopping",
        True,
    ),
)
# Never echo a DSN: a URL with credentials, or key=value pairs of a libpq string.
_SECRETS = re.compile(r"\w+://[^\s@/]*@\S*|password\s*=\s*\S+", re.I)


def _scrub(text: str) -> str:
    return _SECRETS.sub("<dsn hidden>", text)


def _connect_message(orig: BaseException) -> str:
    """libpq's reason, without the repeated "connection to server ... failed:" prefixes."""
    lines = [line.strip() for line in str(orig).splitlines() if line.strip()]
    first = lines[0] if lines else type(orig).__name__
    where, _, why = first.rpartition(" failed: ")
    where = where.removeprefix("connection failed: ").removeprefix("connection to ")
    reason = why or first
    reason = re.sub(r"^(FATAL|ERROR):\s+", "", reason)
    text = f"{reason} ({where})" if why and where else reason
    return _scrub(text)


def describe(exc: BaseException) -> tuple[str | None, str, bool]:
    """(SQLSTATE or None, a one-line message, retriable) for a psycopg/SQLAlchemy error.

    A server error gives its SQLSTATE and primary message; a connection that failed before
    the server answered gives libpq's reason (host and port, never the DSN or password).
    """
    orig = getattr(exc, "orig", exc)
    if isinstance(orig, psycopg.Error) and orig.sqlstate:
        primary = orig.diag.message_primary or type(orig).__name__
        # Only what the SQLSTATE table calls refused (a login, an unknown database) is
        # configuration; anything else the server says on a live connection (a full disk,
        # serialization, lock timeout, shutdown) is worth another try.
        refused = sqlstate_trouble(orig.sqlstate) is REFUSED
        return orig.sqlstate, _scrub(primary), not refused
    if isinstance(orig, psycopg.OperationalError | psycopg.InterfaceError):
        message = _connect_message(orig)
        for pattern, sqlstate, cause, retriable in _CONNECT_CAUSES:
            if pattern.search(message):
                return sqlstate, f"{cause}: {message}", retriable
        return None, message, True
    return None, type(orig).__name__, True


def unavailable(exc: BaseException) -> DatabaseUnavailable | DatabaseRefused:
    """The framework error for a failed connection or statement: refused for good
    (configuration: exit 2) or unavailable (retried); one already translated as is."""
    if isinstance(exc, DatabaseUnavailable):
        return exc
    sqlstate, message, retriable = describe(exc)
    code = f" [SQLSTATE {sqlstate}]" if sqlstate else ""
    if retriable:
        return DatabaseUnavailable(f"database unavailable: {message}{code}", sqlstate)
    return DatabaseRefused(f"database configuration error: {message}{code}", sqlstate)


def translate(exc: BaseException) -> BaseException:
    """Map a driver error onto the framework's tree (unknown errors pass through)."""
    orig = getattr(exc, "orig", exc)
    if isinstance(orig, psycopg.errors.UndefinedTable):
        return SchemaMissing(f"outbox table missing ({orig.diag.message_primary})")
    if isinstance(orig, psycopg.errors.InvalidSchemaName):
        return SchemaMissing(f"outbox schema missing ({orig.diag.message_primary})")
    if isinstance(orig, psycopg.errors.InvalidCatalogName):  # a ProgrammingError
        return unavailable(orig)
    # Every outage of the SQLSTATE table (outbox/dberrors.py: a read-only transaction is
    # an InternalError to the driver), and the driver's operational errors as before.
    if (
        isinstance(exc, OperationalError)
        or (isinstance(exc, DBAPIError) and exc.connection_invalidated)
        or isinstance(orig, psycopg.OperationalError)
        or trouble(exc) is OUTAGE
    ):
        return unavailable(orig)
    return exc


@contextmanager
def translated_errors() -> Iterator[None]:
    """Re-raise driver errors as framework errors (see :func:`translate`)."""
    try:
        yield
    except DBAPIError as exc:
        mapped = translate(exc)
        if mapped is exc:
            raise
        raise mapped from exc
