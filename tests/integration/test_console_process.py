"""``outbox console`` as a process, held to the daemons' standard (the CLI as a
subprocess): one start-up line with its URL, exit 2 with one line when the database refuses
it or the port is taken, ``/healthz`` 503 while the database cannot be queried (and 200
once it is back), SIGTERM exit 0."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from sqlalchemy.engine import make_url

from outbox.settings import OutboxSettings
from tests.support.console import console_process
from tests.support.inbox import ROOT, subprocess_env
from tests.support.tables import own_tables
from tests.support.tcp_proxy import tcp_proxy

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def psettings(base_settings: OutboxSettings) -> OutboxSettings:
    return own_tables(base_settings, "p")


def _env(settings: OutboxSettings, **extra: str) -> dict[str, str]:
    return subprocess_env(
        settings,
        OUTBOX_TABLE_PREFIX=settings.table_prefix,
        OUTBOX_DB_SCHEMA=settings.db_schema,
        **extra,
    )


def _one_shot(settings: OutboxSettings, *args: str, **env: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "cli", "console", *args],
        env=_env(settings, **env),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def test_one_start_up_line_with_its_url_and_sigterm_exits_0(psettings: OutboxSettings) -> None:
    with console_process(psettings) as (url, proc):
        assert httpx.get(url + "/healthz").text == "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        err = proc.stderr.read().decode()  # type: ignore[union-attr]
    lines = err.strip().splitlines()
    assert lines[0].startswith(f"console on {url} (read-only, no token: loopback only, ")
    assert lines[1:] == ["console stopped"], lines
    password = make_url(psettings.database_url.get_secret_value()).password
    assert password and f":{password}@" not in err and "Traceback" not in err


def test_a_refused_database_or_a_taken_port_is_one_line_and_exit_2(
    psettings: OutboxSettings,
) -> None:
    url = make_url(psettings.database_url.get_secret_value()).set(password="not-the-password")
    wrong = url.render_as_string(hide_password=False)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        runs = {
            "password": _one_shot(psettings, "--port", "1", OUTBOX_DATABASE_URL=wrong),
            "port": _one_shot(psettings, "--port", str(port)),
        }
        outcomes = {what: (p.communicate(timeout=60), p.returncode) for what, p in runs.items()}
    finally:
        taken.close()
    for what, ((_, err), code) in outcomes.items():
        lines = err.decode().strip().splitlines()
        assert code == 2, (what, err)
        assert len(lines) == 1, (what, lines)
        assert "not-the-password" not in lines[0] and "Traceback" not in lines[0]
    assert "authentication failed" in outcomes["password"][0][1].decode()
    assert f"port {port} on 127.0.0.1 is in use" in outcomes["port"][0][1].decode()


def test_healthz_is_503_while_the_database_is_gone_and_200_once_it_is_back(
    psettings: OutboxSettings,
) -> None:
    real = make_url(psettings.database_url.get_secret_value())
    with tcp_proxy((real.host or "127.0.0.1", real.port or 5432)) as proxy:
        through = real.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        with console_process(psettings, OUTBOX_DATABASE_URL=through) as (url, proc):
            assert httpx.get(url + "/healthz").status_code == 200
            proxy.cut()
            sick = _until(url, 503)
            assert "unhealthy" in sick.text and real.password not in sick.text
            page = httpx.get(url + "/dead-letters", timeout=30)
            assert page.status_code == 503 and "database unavailable" in page.text
            proxy.restore()
            assert _until(url, 200).text == "ok"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(20) == 0


def _until(url: str, status: int, within: float = 20.0) -> httpx.Response:
    deadline = time.monotonic() + within
    while True:
        response = httpx.get(url + "/healthz", timeout=10)
        if response.status_code == status or time.monotonic() > deadline:
            assert response.status_code == status, response.text
            return response
        time.sleep(0.3)
