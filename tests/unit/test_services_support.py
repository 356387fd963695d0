"""How the tests read the secured endpoints of scripts/services (OUTBOX_TEST_* lines), and
that `scripts/services env` prints them only when asked (`--test`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from tests.support.services import ROOT, Endpoints, Secured, ServiceUnavailable

DSN = "postgresql+psycopg://u:p@127.0.0.1:5/db?sslmode=verify-full&sslrootcert=/x/ca.pem"


def exports(tmp_path: Path, dsn: str) -> dict[str, str]:
    files = {}
    for name in ("ca", "untrusted", "cert", "key"):
        (tmp_path / name).write_text("pem")
        files[name] = str(tmp_path / name)
    return {
        "OUTBOX_TEST_KAFKA_SASL_SSL": "127.0.0.1:9",
        "OUTBOX_TEST_KAFKA_USER": "outbox",
        "OUTBOX_TEST_KAFKA_PASSWORD": "pw-7Yz",
        "OUTBOX_TEST_TLS_CA": files["ca"],
        "OUTBOX_TEST_TLS_UNTRUSTED_CA": files["untrusted"],
        "OUTBOX_TEST_TLS_CLIENT_CERT": files["cert"],
        "OUTBOX_TEST_TLS_CLIENT_KEY": files["key"],
        "OUTBOX_TEST_PG_TLS_URL": dsn,
    }


@pytest.mark.parametrize("dsn", [DSN, f"'{DSN}'"], ids=["eval", "export-sed"])
def test_the_dsn_arrives_whole_however_it_was_exported(tmp_path: Path, dsn: str) -> None:
    secured = Secured.parse(exports(tmp_path, dsn))
    assert isinstance(secured, Secured)
    assert secured.pg_tls_url == DSN
    assert secured.ca_file == tmp_path / "ca"
    assert "pw-7Yz" not in repr(secured)


def test_missing_values_are_named_and_fail_instead_of_skipping(tmp_path: Path) -> None:
    values = exports(tmp_path, DSN)
    del values["OUTBOX_TEST_TLS_CA"]
    reason = Secured.parse(values)
    assert reason == "OUTBOX_TEST_TLS_CA not set"
    found = Endpoints("postgresql://x", "127.0.0.1:9", "environment", reason)
    with pytest.raises(ServiceUnavailable, match="OUTBOX_TEST_TLS_CA not set"):
        found.require_secured()


def test_verify_full_points_any_database_url_at_a_ca(tmp_path: Path) -> None:
    secured = Secured.parse(exports(tmp_path, DSN))
    assert isinstance(secured, Secured)
    url = make_url(secured.verify_full("postgresql+psycopg://u:p@127.0.0.1:5/session_db"))
    assert url.database == "session_db"
    assert dict(url.query) == {"sslmode": "verify-full", "sslrootcert": str(tmp_path / "ca")}


def test_services_env_prints_a_users_variables_and_the_test_ones_only_when_asked() -> None:
    script = str(ROOT / "scripts" / "services")
    env = {"PATH": os.environ["PATH"], "OUTBOX_SERVICES_DIR": "/nonexistent/services"}

    def names(*args: str) -> list[str]:
        out = subprocess.run([script, *args], env=env, capture_output=True, text=True, check=True)
        return [line.split("=", 1)[0].removeprefix("export ") for line in out.stdout.splitlines()]

    assert names("env") == ["OUTBOX_DATABASE_URL", "OUTBOX_KAFKA_BOOTSTRAP_SERVERS"]
    tested = names("env", "--test")
    assert tested[:2] == names("env") and set(tested[2:]) == set(Secured.VARS.values())
