"""`outbox wal setup` and `outbox db upgrade` in WAL mode, as subprocesses: the publication
and the logical slot are created once (idempotent), a role that may not create them gets
the SQL for an administrator (exit 2, one line, no traceback), and that SQL works."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

from outbox.settings import OutboxSettings
from tests.acceptance.conftest import Cli
from tests.support.wal import login_role
from tests.support.wal_slots import wal_names

pytestmark = pytest.mark.acceptance


def wal_cli(s: OutboxSettings) -> Cli:
    return Cli(
        s,
        extra_env=(
            ("OUTBOX_SOURCE", s.source),
            ("OUTBOX_WAL__SLOT", s.wal.slot),
            ("OUTBOX_WAL__PUBLICATION", s.wal.publication),
        ),
    )


def slots(s: OutboxSettings) -> list[tuple[str, str, str, str]]:
    with psycopg.connect(s.libpq_dsn) as conn:
        return conn.execute(
            "SELECT slot_type, plugin, database, current_database() FROM pg_replication_slots "
            "WHERE slot_name = %s",
            (s.wal.slot,),
        ).fetchall()


def publications(s: OutboxSettings) -> int:
    with psycopg.connect(s.libpq_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_publication WHERE pubname = %s", (s.wal.publication,)
        ).fetchone()
        assert row is not None
        return int(row[0])


@pytest.fixture
def ws(settings: OutboxSettings) -> Iterator[OutboxSettings]:
    with wal_names(settings) as s:
        yield s


def test_wal_setup_creates_the_publication_and_slot_once(ws: OutboxSettings) -> None:
    cli = wal_cli(ws)
    first = cli("wal", "setup")
    assert first.returncode == 0, first.stderr
    assert f"created replication slot {ws.wal.slot}" in first.stderr
    [(kind, plugin, database, here)] = slots(ws)
    assert (kind, plugin, database) == ("logical", "pgoutput", here)
    assert publications(ws) == 1

    again = cli("wal", "setup")
    assert again.returncode == 0, again.stderr
    assert "publication and slot exist" in again.stderr
    assert "created" not in again.stderr
    assert len(slots(ws)) == 1


def test_db_upgrade_sets_up_the_wal_source_in_wal_mode(ws: OutboxSettings) -> None:
    table_mode = wal_cli(ws.model_copy(update={"source": "table"}))("db", "upgrade")
    assert table_mode.returncode == 0, table_mode.stderr
    assert slots(ws) == []  # table mode: no slot holding WAL for nobody

    upgraded = wal_cli(ws)("db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    assert len(slots(ws)) == 1
    assert publications(ws) == 1


def test_a_slot_of_that_name_that_is_not_logical_is_refused(ws: OutboxSettings) -> None:
    with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_create_physical_replication_slot(%s)", (ws.wal.slot,))
    proc = wal_cli(ws)("wal", "setup")
    assert proc.returncode == 2, proc.stderr
    assert "WalSlotMismatch" in proc.stderr and "physical" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture
def restricted(ws: OutboxSettings) -> Iterator[OutboxSettings]:
    """``ws`` logging in as a fresh role with LOGIN only: no REPLICATION, no CREATE on
    the database."""
    with login_role(ws) as own:
        yield own


def test_a_role_without_replication_gets_the_sql_an_admin_runs(
    ws: OutboxSettings, restricted: OutboxSettings
) -> None:
    role = make_url(restricted.database_url.get_secret_value()).username
    proc = wal_cli(restricted)("wal", "setup")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert "WalPrivilegeMissing" in line and "SQLSTATE 42501" in line
    assert slots(ws) == [] and publications(ws) == 0  # nothing half-made
    sql = proc.stdout
    assert f'CREATE PUBLICATION "{ws.wal.publication}"' in sql
    assert f"pg_create_logical_replication_slot('{ws.wal.slot}', 'pgoutput')" in sql
    assert f'ALTER ROLE "{role}" WITH REPLICATION;' in sql

    # The administrator runs it as given, statement by statement as `psql -f` does, twice.
    statements = [x for x in sql.splitlines() if x.strip() and not x.startswith("--")]
    with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
        for _ in range(2):
            for statement in statements:
                conn.execute(statement.encode())
    try:
        [(kind, plugin, database, here)] = slots(ws)
        assert (kind, plugin, database) == ("logical", "pgoutput", here)
        assert publications(ws) == 1
        # Now the role may: the set-up finds everything in place.
        done = wal_cli(restricted)("wal", "setup")
        assert done.returncode == 0, done.stderr
        assert "publication and slot exist" in done.stderr
    finally:
        with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
            conn.execute(
                psycopg.sql.SQL("ALTER ROLE {} WITH NOREPLICATION").format(
                    psycopg.sql.Identifier(role)
                )
            )


def test_print_sql_needs_no_connection_rights(ws: OutboxSettings) -> None:
    proc = wal_cli(ws)("wal", "setup", "--print-sql", "--role", "billing_relay")
    assert proc.returncode == 0, proc.stderr
    assert 'ALTER ROLE "billing_relay" WITH REPLICATION;' in proc.stdout
    assert slots(ws) == []
