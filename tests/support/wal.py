"""Helpers for WAL-source tests: a replication slot and publication of their own per test
(slots are per database and hold WAL on the shared server until dropped: always dropped
at teardown, whoever still reads them)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import psycopg
from pydantic import SecretStr
from sqlalchemy.engine import make_url

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


@contextmanager
def login_role(settings: OutboxSettings) -> Iterator[OutboxSettings]:
    """``settings`` logging in as a fresh role with LOGIN only: no REPLICATION, no CREATE
    on the database (PostgreSQL 15 grants neither to PUBLIC); dropped afterwards."""
    role = f"walrole_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    with _admin(settings) as conn:
        conn.execute(
            psycopg.sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                psycopg.sql.Identifier(role), psycopg.sql.Literal(password)
            )
        )
    url = make_url(settings.database_url.get_secret_value()).set(username=role, password=password)
    try:
        yield settings.model_copy(
            update={"database_url": SecretStr(url.render_as_string(hide_password=False))}
        )
    finally:
        with _admin(settings) as conn:  # its grants first: a role with privileges stays
            conn.execute(psycopg.sql.SQL("DROP OWNED BY {}").format(psycopg.sql.Identifier(role)))
            conn.execute(psycopg.sql.SQL("DROP ROLE {}").format(psycopg.sql.Identifier(role)))


def wait_until(what: Callable[[], bool], timeout: float) -> bool:
    """Whether ``what()`` became true within ``timeout`` seconds (asked every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def slot_reader(settings: OutboxSettings) -> int | None:
    """The pid of the session streaming the slot, if any."""
    with _admin(settings) as conn:
        row = conn.execute(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
            [settings.wal.slot],
        ).fetchone()
    return None if row is None or row[0] is None else int(str(row[0]))


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
