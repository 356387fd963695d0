"""Tables of a test's own: a fresh table prefix, migrated."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

from sqlalchemy import Engine

from outbox import migrate
from outbox.db import sync_engine
from outbox.settings import OutboxSettings


def own_tables(settings: OutboxSettings, letter: str = "t") -> OutboxSettings:
    """``settings`` with a fresh table prefix (``letter`` + 8 hex digits), migrated: a relay
    or a console sees every row of its tables, so it must not see other tests' rows."""
    own = settings.model_copy(update={"table_prefix": f"{letter}{uuid.uuid4().hex[:8]}_"})
    migrate.upgrade(own)
    return own


@contextlib.contextmanager
def engine_of(settings: OutboxSettings) -> Iterator[Engine]:
    """A small engine for ``settings``' database, disposed at the end."""
    engine = sync_engine(settings, pool_size=2)
    try:
        yield engine
    finally:
        engine.dispose()
