"""Pooler settings, engine options and the probe's pure parts (no database: the probe
itself runs against a real PgBouncer in tests/integration/test_poolers.py)."""

from __future__ import annotations

import pytest
from pydantic import SecretStr

from outbox.db import _engine_options, connect_options
from outbox.errors import ConfigurationError, PoolerUnsupported
from outbox.poolers import SessionProbe, _moved, _pooler_name, refusal
from outbox.settings import OutboxSettings, load_settings
from relay.database import check_session

APP = "postgresql+psycopg://app:app-pw@pooler.example:6432/shop"
DIRECT = "postgresql+psycopg://relay:relay-pw@db.example:5432/shop"


def test_db_pooler_defaults_to_none_and_rejects_other_modes() -> None:
    assert OutboxSettings().db_pooler == "none"
    with pytest.raises(ConfigurationError, match="db_pooler"):
        load_settings(db_pooler="statement")


def test_daemon_urls_replace_database_url_for_their_daemon_only() -> None:
    s = OutboxSettings(
        database_url=SecretStr(APP),
        db_pooler="transaction",
        relay={"database_url": DIRECT},  # type: ignore[arg-type]
    )
    relay = s.for_relay()
    assert relay.database_url.get_secret_value() == DIRECT
    assert relay.db_pooler == "none"  # db_pooler describes database_url only
    assert s.for_consumer() is s  # no consumer URL: the application's
    assert s.database_url.get_secret_value() == APP


def test_a_daemon_url_is_validated_without_echoing_it() -> None:
    with pytest.raises(ConfigurationError) as info:
        load_settings(relay={"database_url": "mysql://u:secret-pw@h/db"})
    assert "relay.database_url must point to PostgreSQL" in str(info.value)
    assert "secret-pw" not in str(info.value)


def test_a_transaction_pooler_turns_prepared_statements_off() -> None:
    assert connect_options(OutboxSettings(db_pooler="transaction")) == {"prepare_threshold": None}
    assert connect_options(OutboxSettings(db_pooler="session")) == {}
    assert connect_options(OutboxSettings()) == {}
    merged = _engine_options(
        OutboxSettings(db_pooler="transaction"),
        {"connect_args": {"prepare_threshold": 3, "connect_timeout": 2}},
    )
    assert merged["connect_args"] == {"prepare_threshold": 3, "connect_timeout": 2}  # caller wins
    assert merged["pool_pre_ping"] is True


def test_a_session_moved_when_the_pid_changed_or_the_lock_is_elsewhere() -> None:
    assert _moved(10, 10, [10]) is None
    assert "backends 10 and 11" in (_moved(10, 11, [10]) or "")
    assert "lost the session lock" in (_moved(10, 10, []) or "")


@pytest.mark.parametrize(
    ("host", "port", "name"),
    [
        ("aws-0-eu-central-1.pooler.supabase.com", 5432, "Supavisor"),
        ("db.internal", 6543, "Supavisor"),
        ("shop.proxy-abc123.eu-west-1.rds.amazonaws.com", 5432, "RDS Proxy"),
        ("pgbouncer.internal", 6432, "PgBouncer"),
    ],
)
async def test_poolers_are_named_by_their_usual_hosts_and_ports(
    host: str, port: int, name: str
) -> None:
    assert await _pooler_name("unused", host, port) == name


def test_the_refusal_is_one_line_naming_the_pooler_and_the_setting() -> None:
    probe = SessionProbe("transaction", "PgBouncer", "10.0.0.5:6432", "two client connections")
    error = refusal("the relay", probe.describe(), "session locks", "OUTBOX_RELAY__DATABASE_URL")
    assert isinstance(error, ConfigurationError)  # daemons exit 2
    text = str(error)
    assert "\n" not in text
    assert "PgBouncer in transaction mode at 10.0.0.5:6432" in text
    assert "OUTBOX_RELAY__DATABASE_URL" in text and "docs/howto/poolers.md" in text


async def test_the_relay_takes_a_declared_transaction_pooler_at_its_word() -> None:
    # No database is contacted: the URL points nowhere.
    s = OutboxSettings(
        database_url=SecretStr("postgresql+psycopg://u:p@127.0.0.1:1/db"), db_pooler="transaction"
    )
    with pytest.raises(PoolerUnsupported, match="OUTBOX_DB_POOLER=transaction"):
        await check_session(s)
    assert not SessionProbe("transaction", None, "-", "-").stable
    assert SessionProbe("session", "PgBouncer", "-", "-").stable
