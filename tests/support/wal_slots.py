"""Replication slots in tests: unique names, always dropped.

Slots are server-wide names that hold WAL on the shared server, and a database with a
logical slot cannot be dropped: every test gets names of its own and drops what it made,
whatever happened (``with wal_names(settings) as s:``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from outbox.settings import OutboxSettings


def drop_wal(settings: OutboxSettings) -> None:
    """Drop the slot and the publication of ``settings.wal`` if they exist (the slot
    after whoever was reading it let go)."""
    with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = %s AND NOT active",
            (settings.wal.slot,),
        )
        conn.execute(
            psycopg.sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
                psycopg.sql.Identifier(settings.wal.publication)
            )
        )


@contextmanager
def wal_names(settings: OutboxSettings) -> Iterator[OutboxSettings]:
    """``settings`` in WAL mode with a slot and publication name of their own."""
    tag = uuid.uuid4().hex[:10]
    s = settings.model_copy(
        update={
            "source": "wal",
            "wal": settings.wal.model_copy(
                update={"slot": f"test_slot_{tag}", "publication": f"test_pub_{tag}"}
            ),
        }
    )
    try:
        yield s
    finally:
        drop_wal(s)


@contextmanager
def public_emit_restored(settings: OutboxSettings) -> Iterator[None]:
    """Give PUBLIC back EXECUTE on pg_logical_emit_message afterwards (PostgreSQL's default),
    for a test that restricts it (``outbox wal setup --producer-role``): the test database
    is shared, and later tests' roles must find the default."""
    try:
        yield
    finally:
        with psycopg.connect(settings.libpq_dsn, autocommit=True) as conn:
            conn.execute(
                "DO $$ DECLARE f regprocedure; BEGIN FOR f IN SELECT p.oid::regprocedure"
                " FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message'"
                " AND p.pronamespace = 'pg_catalog'::regnamespace LOOP"
                " EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO PUBLIC', f); END LOOP; END $$"
            )
