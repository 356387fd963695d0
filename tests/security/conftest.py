"""Fixtures of the security tests: settings for the SASL_SSL listener of the test services,
the CLI and daemons as subprocesses with those settings, and the record of every output.

Every log record of these tests (at DEBUG, any logger, aiokafka's included) and every
stdout/stderr of the subprocesses they run is kept in ``OUTPUTS``; every password the tests
use is registered in ``PASSWORDS``. ``test_zz_no_secrets.py`` searches the one for the
other.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from pydantic import SecretStr

from outbox import migrate
from outbox.kafka.clients import kafka_environment
from outbox.settings import KafkaSettings, OutboxSettings
from tests.support.relay import relay_env
from tests.support.services import Secured

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
OUTPUTS: list[tuple[str, str]] = []  # (where, text)
PASSWORDS: set[str] = set()


def secret(value: str) -> str:
    """Register a password the outputs must never show."""
    PASSWORDS.add(value)
    return value


def record(where: str, text: str) -> str:
    OUTPUTS.append((where, text))
    return text


@pytest.fixture(autouse=True)
def _keep_log_records(
    caplog: pytest.LogCaptureFixture, request: pytest.FixtureRequest
) -> Iterator[None]:
    caplog.set_level(logging.DEBUG)
    yield
    for rec in caplog.records:
        # Every attribute: the message, its arguments, extras, the formatted traceback.
        text = json.dumps(
            {**rec.__dict__, "message": rec.getMessage(), "exc_text": _exc_text(rec)},
            default=repr,
        )
        record(f"{request.node.nodeid} log {rec.name}", text)


def _exc_text(rec: logging.LogRecord) -> str | None:
    if rec.exc_info:
        return logging.Formatter().formatException(rec.exc_info)
    return rec.exc_text


@pytest.fixture(scope="session", autouse=True)
def _register_service_passwords(secured: Secured) -> None:
    secret(secured.kafka_password)


def sasl_ssl(
    settings: OutboxSettings,
    secured: Secured,
    *,
    password: str | None = None,
    ca_file: Path | None = None,
    mechanism: str = "SCRAM-SHA-512",
    token_provider: str = "tests.support.oauth_tokens:valid",
    **update: object,
) -> OutboxSettings:
    """``settings`` connecting to the SASL_SSL listener with SCRAM, PLAIN or OAUTHBEARER
    (``token_provider``, see tests/support/oauth_tokens.py)."""
    credentials: dict[str, Any] = (
        {"sasl_oauth_token_provider": token_provider}
        if mechanism == "OAUTHBEARER"
        else {
            "sasl_username": secured.kafka_user,
            "sasl_password": SecretStr(secret(password or secured.kafka_password)),
        }
    )
    kafka = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism=mechanism,  # type: ignore[arg-type]
        ssl_ca_file=ca_file or secured.ca_file,
        client_id="outbox-security-tests",
        **credentials,
    )
    return settings.model_copy(
        update={"kafka_bootstrap_servers": secured.kafka_sasl_ssl, "kafka": kafka, **update}
    )


@pytest.fixture
def sasl_settings(base_settings: OutboxSettings, secured: Secured) -> OutboxSettings:
    """SASL_SSL + SCRAM-SHA-512 with the right password and CA, on tables of its own."""
    s = sasl_ssl(base_settings, secured, table_prefix=f"s{uuid.uuid4().hex[:8]}_")
    migrate.upgrade(s)
    return s


def environment(settings: OutboxSettings, **extra: str) -> dict[str, str]:
    """The environment of a CLI or daemon subprocess configured like ``settings``, Kafka
    security settings included."""
    return relay_env(settings, **kafka_environment(settings), PYTHONPATH=str(ROOT), **extra)


def cli(
    settings: OutboxSettings, *args: str, timeout: float = 120, **extra: str
) -> subprocess.CompletedProcess[str]:
    """``outbox ARGS`` as a subprocess; its outputs are recorded."""
    proc = subprocess.run(
        [sys.executable, "-m", "cli", *args],
        cwd=ROOT,
        env=environment(settings, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    record(f"outbox {' '.join(args)} stdout", proc.stdout)
    record(f"outbox {' '.join(args)} stderr", proc.stderr)
    return proc


@dataclass
class Daemon:
    """``outbox ARGS`` running in the background, its output in a file (recorded at stop)."""

    settings: OutboxSettings
    args: tuple[str, ...]
    log_path: Path
    extra: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Daemon:
        with self.log_path.open("wb") as sink:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cli", "--log-level", "DEBUG", *self.args],
                cwd=ROOT,
                env=environment(self.settings, **self.extra),
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        return self

    def wait(self, timeout: float) -> int | None:
        """Exit code, or None if still running after ``timeout`` seconds."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.output()
        return int(self.proc.returncode)

    def output(self) -> str:
        text = self.log_path.read_text(errors="replace")
        return record(f"outbox {' '.join(self.args)} output", text)


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[Daemon]]:
    """Started daemons are stopped (and their output recorded) at the end of the test."""
    started: list[Daemon] = []
    yield started
    for d in started:
        d.stop()


def run_daemon(
    started: list[Daemon], settings: OutboxSettings, log_dir: Path, *args: str, **extra: str
) -> Daemon:
    name = "-".join(args[:1]) + f"-{len(started)}"
    d = Daemon(settings, args, log_dir / f"{name}.log", extra).start()
    started.append(d)
    return d


def until(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
