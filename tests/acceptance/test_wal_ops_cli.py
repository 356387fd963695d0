"""`outbox doctor` and `outbox lag` on the WAL source's slot, as subprocesses against the
real server: a missing slot and publication are errors, a set-up one passes; the slot's
retained WAL and lag in seconds grow while nobody confirms and fall back when it is
advanced (as the relay does)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from outbox.ops.wal_slot import READER_APPLICATION as READER
from outbox.sessions import relay_application
from outbox.settings import OutboxSettings
from tests.acceptance.conftest import Cli, SchemaFactory
from tests.acceptance.test_wal_setup_cli import wal_cli
from tests.support.wal_slots import public_emit_restored, wal_names

pytestmark = pytest.mark.acceptance


@pytest.fixture
def ws(fresh_schema: SchemaFactory) -> Iterator[OutboxSettings]:
    with wal_names(fresh_schema()) as s:
        yield s


def wal_findings(report: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {f["check"]: f for f in report if f["check"].startswith("wal")}


def emit(s: OutboxSettings, payload_bytes: int) -> None:
    """What a producer in WAL mode writes: a transactional logical message, committed."""
    with psycopg.connect(s.libpq_dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_logical_emit_message(true, %s, repeat('x', %s))",
            (s.wal.prefix, payload_bytes),
        )


def lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


def advance(s: OutboxSettings) -> None:
    """Confirm everything written so far, as a relay does once Kafka acknowledged it."""
    with psycopg.connect(s.libpq_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (s.wal.slot,))


def test_doctor_reports_a_missing_slot_and_publication_then_a_set_up_one(
    ws: OutboxSettings,
) -> None:
    cli: Cli = wal_cli(ws)
    missing = wal_findings(cli.json("doctor", "--no-kafka", expect_rc=1))
    assert missing["wal_level"]["level"] == "ok"
    assert missing["wal_slot"]["level"] == "error"
    assert "does not exist" in missing["wal_slot"]["what"]
    assert "outbox wal setup" in missing["wal_slot"]["action"]
    assert missing["wal_publication"]["level"] == "error"
    # PostgreSQL's default: PUBLIC may emit logical messages, i.e. forge WAL events.
    assert missing["wal_emit"]["level"] == "error"
    assert "--producer-role" in missing["wal_emit"]["action"]

    with public_emit_restored(ws):
        user = make_url(ws.database_url.get_secret_value()).username or ""
        assert cli("wal", "setup", "--producer-role", user).returncode == 0
        _set_up_one_passes(cli, ws)


def _set_up_one_passes(cli: Cli, ws: OutboxSettings) -> None:
    ready = wal_findings(cli.json("doctor", "--no-kafka"))
    assert ready["wal_emit"]["level"] == "ok"
    assert ready["wal_slot"]["level"] == "ok"
    assert ready["wal_slot"]["details"]["wal_status"] == "reserved"
    assert ready["wal_publication"]["level"] == "ok"
    assert ready["wal_reader"]["level"] == "warn"  # no relay runs
    # A reading relay (its application name naming its process, its reader lock) and one
    # standing by (the plain name of the relays before they named themselves).
    named = relay_application(READER, 4242, "relay-host")
    with (
        psycopg.connect(ws.libpq_dsn, autocommit=True, application_name=named) as reader,
        psycopg.connect(ws.libpq_dsn, autocommit=True, application_name=READER) as standby,
    ):
        reader.execute("SELECT pg_advisory_lock(1, 2)")
        read = wal_findings(cli.json("doctor", "--no-kafka"))["wal_reader"]
        assert read["level"] == "ok"
        backend = reader.info.backend_pid
        assert read["details"] == {
            "reading_pids": [backend],
            "standby_pids": [standby.info.backend_pid],
            "readers": [  # by backend pid
                {"relay_pid": relay, "host": host, "backend_pid": pid, "reading": pid == backend}
                for pid, relay, host in sorted(
                    [(backend, 4242, "relay-host"), (standby.info.backend_pid, None, None)]
                )
            ],
        }
        lag = cli.json("lag", "--no-kafka")["wal"]
        assert lag["reading_pids"] == [backend]
        assert lag["reading"] == [f"relay pid 4242 on relay-host (backend pid {backend})"]
    with psycopg.connect(ws.libpq_dsn) as conn:
        row = conn.execute("SHOW max_slot_wal_keep_size").fetchone()
    assert row is not None
    # The test server keeps PostgreSQL's default: unbounded, which doctor must call out.
    expected = "warn" if row[0] == "-1" else "ok"
    assert ready["wal_retention"]["level"] == expected


def test_doctor_in_table_mode_flags_a_slot_left_behind(ws: OutboxSettings) -> None:
    assert wal_cli(ws)("wal", "setup").returncode == 0
    table_mode = wal_cli(ws.model_copy(update={"source": "table"}))
    found = wal_findings(table_mode.json("doctor", "--no-kafka"))
    assert found["wal_slot"]["level"] == "warn"
    assert "nobody reads it" in found["wal_slot"]["what"]


def test_lag_shows_the_slot_growing_while_unconfirmed_and_shrinking_once_advanced(
    ws: OutboxSettings,
) -> None:
    cli = wal_cli(ws)
    assert cli("wal", "setup").returncode == 0
    fresh = cli.json("lag", "--no-kafka")["wal"]
    assert fresh["exists"] and fresh["wal_status"] == "reserved"
    assert fresh["lag_seconds"] == 0.0  # nothing committed since the slot was made

    emit(ws, 64)  # an event
    emit(ws, 2_000_000)  # and 2 MB more of WAL, all unconfirmed
    behind = cli.json("lag", "--no-kafka")
    wal = behind["wal"]
    assert wal["lag_seconds"] > 0  # the commit time of the first event is in the past
    assert wal["unconfirmed_bytes"] >= fresh["unconfirmed_bytes"] + 2_000_000
    assert wal["retained_bytes"] >= fresh["retained_bytes"] + 2_000_000
    assert behind["totals"]["wal_lag_seconds"] == wal["lag_seconds"]
    status = cli("status")
    assert f"wal      slot {ws.wal.slot}: reserved, lag " in status.stdout, status.stdout
    over = cli("lag", "--no-kafka", "--max-wal-bytes", "1000000")
    assert over.returncode == 3, over.stderr
    assert f"WAL slot {ws.wal.slot} retains" in over.stderr

    advance(ws)
    caught_up = cli.json("lag", "--no-kafka")["wal"]
    assert caught_up["lag_seconds"] == 0.0
    # Confirmed past both messages (other sessions of the shared server keep writing WAL, so
    # unconfirmed_bytes is not asserted to shrink).
    assert lsn(caught_up["confirmed_flush_lsn"]) > lsn(wal["confirmed_flush_lsn"]) + 2_000_000
    # restart_lsn (hence retained_bytes) follows only at the server's next running-xacts
    # record (~15 s, or a checkpoint): not asserted here.


def test_lag_of_a_missing_slot_is_unknown_never_zero(ws: OutboxSettings) -> None:
    report = wal_cli(ws).json("lag", "--no-kafka")["wal"]
    assert report["exists"] is False and report["lag_seconds"] is None
    proc = wal_cli(ws)("lag", "--no-kafka", "--max-age", "60")
    assert proc.returncode == 3
    assert "lag unknown (no such slot)" in proc.stderr


def test_lag_without_replication_gives_bytes_and_says_why_seconds_are_unknown(
    ws: OutboxSettings,
) -> None:
    assert wal_cli(ws)("wal", "setup").returncode == 0
    role = f"walviewer_{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    ident = psycopg.sql.Identifier
    with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
        conn.execute(
            psycopg.sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                ident(role), psycopg.sql.Literal(password)
            )
        )
        conn.execute(
            psycopg.sql.SQL(
                "GRANT USAGE ON SCHEMA {s} TO {r}; GRANT SELECT ON ALL TABLES IN SCHEMA {s} TO {r}"
            ).format(s=ident(ws.db_schema), r=ident(role))
        )
    url = make_url(ws.database_url.get_secret_value()).set(username=role, password=password)
    viewer = ws.model_copy(
        update={"database_url": SecretStr(url.render_as_string(hide_password=False))}
    )
    try:
        report = wal_cli(viewer).json("lag", "--no-kafka")["wal"]
    finally:
        with psycopg.connect(ws.libpq_dsn, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP OWNED BY {r}; DROP ROLE {r}").format(r=ident(role)))
    assert report["exists"] and report["retained_bytes"] is not None
    assert report["lag_seconds"] is None
    assert "replication role" in report["lag_unknown"] and "42501" in report["lag_unknown"]
