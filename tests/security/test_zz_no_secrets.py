"""No password in any output: every log record (DEBUG and up, any logger) and every CLI and
daemon output produced by the security tests is searched for every password they used.

Named to run last in this directory (pytest runs files in name order). It produces outputs
of its own first — a refused relay, a refused `doctor`, a refused PostgreSQL connection, all
at DEBUG — so the search is never vacuous, also when this file runs alone."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from outbox import migrate
from outbox.settings import OutboxSettings
from tests.security.conftest import OUTPUTS, PASSWORDS, Daemon, cli, run_daemon, sasl_ssl, secret
from tests.support.services import Secured

pytestmark = pytest.mark.integration


def test_no_password_in_any_log_line_or_cli_output(
    base_settings: OutboxSettings, secured: Secured, daemons: list[Daemon], tmp_path: Path
) -> None:
    wrong = secret(f"wrong-{uuid.uuid4().hex[:10]}")
    s = sasl_ssl(base_settings, secured, password=wrong, table_prefix=f"z{uuid.uuid4().hex[:8]}_")
    migrate.upgrade(s)
    relay = run_daemon(daemons, s, tmp_path, "relay")
    assert relay.wait(90) == 2
    relay.output()
    cli(s, "--log-level", "DEBUG", "doctor")
    cli(s, "--log-level", "DEBUG", "config", "show")
    pg_password = secret(f"pg-{uuid.uuid4().hex[:10]}")
    bad_ca = make_url(
        secured.verify_full(
            base_settings.database_url.get_secret_value(), secured.untrusted_ca_file
        )
    ).set(password=pg_password)
    refused_pg = base_settings.model_copy(
        update={"database_url": SecretStr(bad_ca.render_as_string(hide_password=False))}
    )
    cli(refused_pg, "--log-level", "DEBUG", "db", "current")

    assert secured.kafka_password in PASSWORDS and wrong in PASSWORDS
    assert len(OUTPUTS) >= 4
    leaks = [
        (where, text[max(0, text.find(p) - 200) : text.find(p) + 50])
        for where, text in OUTPUTS
        for p in PASSWORDS
        if p in text
    ]
    assert not leaks, f"passwords found in {len(leaks)} outputs, first: {leaks[:3]}"
