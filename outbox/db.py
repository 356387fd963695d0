"""Engines and database error translation shared by every package."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg.errors
from sqlalchemy import Engine, create_engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox.errors import DatabaseUnavailable, SchemaMissing
from outbox.settings import OutboxSettings


def sync_engine(settings: OutboxSettings, **kwargs: Any) -> Engine:
    """A sync SQLAlchemy engine for ``settings.database_url`` (psycopg 3)."""
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(settings.sqlalchemy_url, **kwargs)


def async_engine(settings: OutboxSettings, **kwargs: Any) -> AsyncEngine:
    """An asyncio SQLAlchemy engine for ``settings.database_url`` (psycopg 3)."""
    kwargs.setdefault("pool_pre_ping", True)
    return create_async_engine(settings.sqlalchemy_url, **kwargs)


def translate(exc: BaseException) -> BaseException:
    """Map a driver error onto the framework's tree (unknown errors pass through)."""
    orig = getattr(exc, "orig", exc)
    if isinstance(orig, psycopg.errors.UndefinedTable):
        return SchemaMissing(f"outbox table missing ({orig.diag.message_primary})")
    if isinstance(orig, psycopg.errors.InvalidSchemaName):
        return SchemaMissing(f"outbox schema missing ({orig.diag.message_primary})")
    if isinstance(exc, OperationalError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    ):
        # str(exc) of a connection failure can include the DSN; report the class only.
        return DatabaseUnavailable(f"database unavailable: {type(orig).__name__}")
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
