"""Only authorised roles write WAL events (issue 51), as subprocesses on the real server.

PostgreSQL lets PUBLIC execute ``pg_logical_emit_message``: a role with nothing but LOGIN
can emit a message under the prefix, which the relay would publish as an event. After
``outbox wal setup --producer-role app`` that role is refused (SQLSTATE 42501) while the
producer role publishes as before; ``--print-sql`` gives an administrator the same grants;
a misspelt producer role fails with one line and revokes nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import psycopg
import pytest
from sqlalchemy.engine import make_url

from outbox import Outbox
from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from tests.acceptance.test_wal_setup_cli import wal_cli
from tests.support.wal import login_role
from tests.support.wal_slots import public_emit_restored, wal_names

pytestmark = pytest.mark.acceptance


@pytest.fixture
def ws(settings: OutboxSettings) -> Iterator[OutboxSettings]:
    with wal_names(settings) as s, public_emit_restored(s):
        yield s


def _user(s: OutboxSettings) -> str:
    return make_url(s.database_url.get_secret_value()).username or ""


def _forge(s: OutboxSettings) -> str | None:
    """Emit a message under the prefix as ``s``'s role: None when it went in, else the
    SQLSTATE of the refusal."""
    try:
        with psycopg.connect(s.libpq_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_logical_emit_message(true, %s, 'forged')", (s.wal.prefix,))
            conn.execute(
                "SELECT pg_logical_emit_message(true, %s, 'forged'::bytea)", (s.wal.prefix,)
            )
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


def _public_may_emit(s: OutboxSettings) -> bool:
    with psycopg.connect(s.libpq_dsn) as conn:
        row = conn.execute(
            "SELECT bool_or(has_function_privilege('public', p.oid, 'EXECUTE')) FROM pg_proc p"
            " WHERE p.proname = 'pg_logical_emit_message'"
        ).fetchone()
    assert row is not None
    return bool(row[0])


def test_after_setup_a_connect_only_role_cannot_emit_and_the_producer_can(
    ws: OutboxSettings,
) -> None:
    with login_role(ws) as intruder, login_role(ws) as producer:
        assert _forge(intruder) is None  # PostgreSQL's default: anyone may
        done = wal_cli(ws)("wal", "setup", "--producer-role", _user(producer))
        assert done.returncode == 0, done.stderr
        assert "revoked from PUBLIC" in done.stderr
        assert "any role that can connect" not in done.stderr
        assert not _public_may_emit(ws)
        assert _forge(intruder) == "42501"  # permission denied for function
        assert _forge(producer) is None
        # The producer role publishes through the framework (the slot exists now).
        engine = sync_engine(producer)
        try:
            with engine.begin() as conn:
                Outbox(producer).publish(
                    conn, topic="orders", key="1", event_type="order.created", payload={}
                )
        finally:
            engine.dispose()
        again = wal_cli(ws)("wal", "setup", "--producer-role", _user(producer))
        assert again.returncode == 0, again.stderr  # idempotent


def test_setup_without_producer_roles_warns_and_revokes_nothing(ws: OutboxSettings) -> None:
    done = wal_cli(ws)("wal", "setup")
    assert done.returncode == 0, done.stderr
    assert "any role that can connect may write WAL events" in done.stderr
    assert "--producer-role" in done.stderr
    assert _public_may_emit(ws)


def test_a_misspelt_producer_role_fails_with_one_line_and_revokes_nothing(
    ws: OutboxSettings,
) -> None:
    done = wal_cli(ws)("wal", "setup", "--producer-role", "no_such_role_4f2a")
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("error:")]
    assert "no_such_role_4f2a" in line and "nothing was revoked" in line, line
    assert _public_may_emit(ws)


def test_the_printed_sql_restricts_emitting_when_an_administrator_runs_it(
    ws: OutboxSettings,
) -> None:
    relay = f"relay_{uuid.uuid4().hex[:8]}"
    with login_role(ws) as intruder, login_role(ws) as producer:
        proc = wal_cli(ws)(
            "wal", "setup", "--print-sql", "--producer-role", _user(producer), "--role", relay
        )
        assert proc.returncode == 0, proc.stderr
        assert "'REVOKE EXECUTE ON FUNCTION ' || f::text || ' FROM PUBLIC'" in proc.stdout
        [block] = [x for x in proc.stdout.splitlines() if "FROM PUBLIC" in x]
        with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
            conn.execute(f"CREATE ROLE {relay} NOLOGIN")  # the relay role named with --role
            try:
                conn.execute(block.encode())
                conn.execute(block.encode())  # idempotent, as psql -f twice
            finally:
                conn.execute(f"DROP OWNED BY {relay}")
                conn.execute(f"DROP ROLE {relay}")
        assert _forge(intruder) == "42501"
        assert _forge(producer) is None
