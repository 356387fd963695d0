"""PostgreSQL over TLS through the DSN (sslmode, sslrootcert, sslcert, sslkey): verify-full
against the test CA connects and doctor says so; a CA that did not sign the server's
certificate is refused with libpq's reason, as a typed error without the DSN or password,
and the relay exits instead of retrying."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy import text
from sqlalchemy.engine import make_url

from outbox import Outbox
from outbox.db import sync_engine, translated_errors
from outbox.errors import ConnectionRefused
from outbox.settings import OutboxSettings
from tests.security.conftest import Daemon, cli, run_daemon, secret
from tests.support.services import Secured

pytestmark = pytest.mark.integration


def over_tls(settings: OutboxSettings, url: str) -> OutboxSettings:
    return settings.model_copy(update={"database_url": SecretStr(url)})


def test_verify_full_connects_publishes_and_doctor_reports_tls(
    base_settings: OutboxSettings, secured: Secured
) -> None:
    url = secured.verify_full(base_settings.database_url.get_secret_value())
    client = make_url(url).update_query_dict(
        {"sslcert": str(secured.client_cert_file), "sslkey": str(secured.client_key_file)}
    )
    s = over_tls(base_settings, client.render_as_string(hide_password=False))
    engine = sync_engine(s)
    try:
        with engine.begin() as conn:
            ssl, dn = conn.execute(
                text("SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
            ).one()
            Outbox(s).publish(conn, topic="tls-topic", event_type="t.e", payload={"a": 1})
    finally:
        engine.dispose()
    assert ssl is True and "CN=outbox" in dn

    doctor = cli(s, "doctor", "--json", "--no-kafka")
    tls = [f for f in json.loads(doctor.stdout) if f["check"] == "tls"]
    assert tls == [
        {
            "check": "tls",
            "level": "ok",
            "what": tls[0]["what"],
            "action": None,
            "details": {"service": "database", "tls": True},
        }
    ], doctor.stdout
    assert "sslmode verify-full" in tls[0]["what"] and "TLS" in tls[0]["what"]


def test_plain_connection_is_reported_as_not_encrypted(base_settings: OutboxSettings) -> None:
    doctor = cli(base_settings, "doctor", "--json", "--no-kafka")
    tls = [f for f in json.loads(doctor.stdout) if f["check"] == "tls"]
    assert [f["details"] for f in tls] == [{"service": "database", "tls": False}]
    assert "not encrypted" in tls[0]["what"]


def untrusted(base_settings: OutboxSettings, secured: Secured) -> tuple[OutboxSettings, str]:
    """Settings whose DSN trusts the wrong CA, with a password of its own to look for."""
    password = secret(f"pg-pw-{uuid.uuid4().hex[:10]}")
    url = make_url(
        secured.verify_full(
            base_settings.database_url.get_secret_value(), secured.untrusted_ca_file
        )
    ).set(password=password)
    s = over_tls(base_settings, url.render_as_string(hide_password=False))
    return s.model_copy(update={"table_prefix": f"p{uuid.uuid4().hex[:8]}_"}), password


def test_an_untrusted_ca_is_refused_with_a_clear_typed_error(
    base_settings: OutboxSettings, secured: Secured
) -> None:
    s, password = untrusted(base_settings, secured)
    engine = sync_engine(s)
    try:
        with pytest.raises(ConnectionRefused) as caught, translated_errors():
            engine.connect().close()
    finally:
        engine.dispose()
    message = str(caught.value)
    assert caught.value.service == "PostgreSQL" and not caught.value.retriable
    assert "certificate verify failed" in message
    assert password not in message and "sslrootcert=" not in message


def test_the_relay_exits_when_postgres_refuses_its_tls(
    base_settings: OutboxSettings, secured: Secured, daemons: list[Daemon], tmp_path: Path
) -> None:
    s, password = untrusted(base_settings, secured)
    relay = run_daemon(daemons, s, tmp_path, "relay")
    code = relay.wait(60)
    out = relay.output()
    assert code == 2, f"relay still running or exit {code}:\n{out[-3000:]}"
    assert "database configuration error" in out and "certificate verify failed" in out
    assert password not in out
