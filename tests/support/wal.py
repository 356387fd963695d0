"""Helpers for WAL-source tests: a replication slot and publication of their own per test
(slots are per database and hold WAL on the shared server until dropped: always dropped
at teardown, whoever still reads them)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg

from outbox.settings import OutboxSettings


def _admin(settings: OutboxSettings) -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(settings.libpq_dsn, autocommit=True)


@contextmanager
def wal_source(settings: OutboxSettings) -> Iterator[OutboxSettings]:
    """``settings`` in WAL mode with a fresh slot and publication, dropped afterwards."""
    name = f"outbox_t_{uuid.uuid4().hex[:10]}"
    wal = settings.wal.model_copy(update={"slot": name, "publication": name})
    own = settings.model_copy(update={"source": "wal", "wal": wal})
    with _admin(own) as conn:
        conn.execute(f'CREATE PUBLICATION "{name}"')
        conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", [name])
    try:
        yield own
    finally:
        drop_slot(own, wait=30)
        with _admin(own) as conn:
            conn.execute(f'DROP PUBLICATION IF EXISTS "{name}"')


def drop_slot(settings: OutboxSettings, wait: float) -> None:
    """Drop the slot (if it exists), ending any session that holds it."""
    deadline = time.monotonic() + wait
    with _admin(settings) as conn:
        while True:
            row = conn.execute(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                [settings.wal.slot],
            ).fetchone()
            if row is None:
                return
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", [settings.wal.slot])
                return
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    conn.execute("SELECT pg_terminate_backend(%s)", [row[0]])
                time.sleep(0.01)


def confirmed_lsn(settings: OutboxSettings) -> str | None:
    with _admin(settings) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s",
            [settings.wal.slot],
        ).fetchone()
    return None if row is None else str(row[0])


def wal_env(settings: OutboxSettings) -> dict[str, str]:
    """The environment variables naming ``settings``' WAL source (for a relay process)."""
    return {
        "OUTBOX_SOURCE": "wal",
        "OUTBOX_WAL__SLOT": settings.wal.slot,
        "OUTBOX_WAL__PUBLICATION": settings.wal.publication,
        "OUTBOX_WAL__PREFIX": settings.wal.prefix,
    }


def wal_relay_env(settings: OutboxSettings, **extra: str) -> dict[str, str]:
    """A WAL relay's (or the CLI's) environment for ``settings``; ``extra`` overrides."""
    from tests.support.relay import relay_env

    return relay_env(settings, **{**wal_env(settings), **extra})
