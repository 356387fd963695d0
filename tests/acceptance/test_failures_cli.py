"""Failures keep their cause, as the CLI shows them (run as a subprocess, real services):

* the four ways a database connection fails each give their own clear message (SQLSTATE
  when the server answered) and exit code, and no output carries the password;
* the daemons exit 2 within seconds on a refused configuration, before taking lanes or
  joining a consumer group;
* ``outbox lag`` exits non-zero when it asked Kafka and got no answer, and shows a lag it
  did not measure as unknown, never 0.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr
from sqlalchemy.engine import make_url

from outbox.settings import OutboxSettings
from tests.acceptance.conftest import ROOT, Cli

pytestmark = pytest.mark.acceptance

SECRET = "wrong-Secret-4711"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _with_url(settings: OutboxSettings, **parts: object) -> OutboxSettings:
    url = make_url(settings.database_url.get_secret_value()).set(**parts)  # type: ignore[arg-type]
    return settings.model_copy(
        update={"database_url": SecretStr(url.render_as_string(hide_password=False))}
    )


def _modes(settings: OutboxSettings) -> dict[str, tuple[OutboxSettings, int, str]]:
    """mode -> (settings, exit code, what the message must say)."""
    return {
        "wrong password": (_with_url(settings, password=SECRET), 2, "SQLSTATE 28P01"),
        "unknown database": (
            _with_url(settings, database=f"nope_{uuid.uuid4().hex[:6]}"),
            2,
            "SQLSTATE 3D000",
        ),
        "closed port": (
            _with_url(settings, host="127.0.0.1", port=_closed_port(), password=SECRET),
            1,
            "connection refused",
        ),
        "unknown host": (
            _with_url(settings, host="no-such-host.invalid", password=SECRET),
            2,
            "unknown host",
        ),
    }


def _flat(proc: subprocess.CompletedProcess[str]) -> str:
    return " ".join((proc.stdout + proc.stderr).split())  # undo the console's wrapping


def test_database_failure_modes_have_distinct_messages_and_no_password(
    settings: OutboxSettings,
) -> None:
    password = make_url(settings.database_url.get_secret_value()).password
    messages = {}
    for mode, (bad, code, says) in _modes(settings).items():
        for args in (("lag", "--no-kafka"), ("db", "current"), ("failed", "list")):
            proc = Cli(bad)(*args, timeout=60)
            text = _flat(proc)
            assert proc.returncode == code, (mode, args, text)
            assert says in text, (mode, args, text)
            assert "Traceback" not in text, (mode, args, text)
            assert SECRET not in text and f":{password}@" not in text, (mode, args, text)
            messages.setdefault(mode, text.split("error: ", 1)[-1])
    assert len(set(messages.values())) == 4, messages


@pytest.mark.parametrize("daemon", ["relay", "consume"])
def test_a_daemon_with_a_wrong_password_exits_2_within_seconds(
    settings: OutboxSettings, tmp_path: Path, daemon: str
) -> None:
    bad = _with_url(settings, password=SECRET)
    module = f"app_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(
        f"import inbox\napp = inbox.Consumer(name='{module}', topics=['{module}'])\n"
    )
    cli = Cli(bad, (("PYTHONPATH", f"{tmp_path}:{ROOT}"),))
    args = ["relay"] if daemon == "relay" else ["consume", f"{module}:app"]
    started = time.monotonic()
    proc = cli(*args, timeout=15)
    took = time.monotonic() - started
    text = _flat(proc)
    assert proc.returncode == 2, text
    assert took < 15, took
    assert "SQLSTATE 28P01" in text and "password authentication failed" in text, text
    assert SECRET not in text and "Traceback" not in text, text
    # One clear line: the error, and nothing about lanes or partitions.
    assert text.count("DatabaseRefused") == 1, text
    assert "lanes" not in text and "partitions" not in text, text


def test_lag_exits_1_when_kafka_does_not_answer_and_shows_unknown_lag(
    settings: OutboxSettings,
) -> None:
    group = f"g-{uuid.uuid4().hex[:8]}"
    down = settings.model_copy(update={"kafka_bootstrap_servers": f"127.0.0.1:{_closed_port()}"})
    proc = Cli(down)("lag", "--json", "--group", group, timeout=60)
    assert proc.returncode == 1, _flat(proc)
    report = json.loads(proc.stdout)
    assert report["kafka_error"] and "Traceback" not in proc.stderr
    [g] = [g for g in report["groups"] if g["group"] == group]
    assert g["total_lag"] is None and not g["measured"]
    assert report["totals"]["max_consumer_lag"] is None
    # Without Kafka by choice: unknown as well, but nothing failed.
    skipped = Cli(settings)("lag", "--json", "--no-kafka", "--group", group, timeout=60)
    assert skipped.returncode == 0, _flat(skipped)
    assert json.loads(skipped.stdout)["totals"]["max_consumer_lag"] is None
    # A consumer lag limit that cannot be checked is not a pass.
    limited = Cli(settings)(
        "lag", "--no-kafka", "--group", group, "--max-consumer-lag", "10", timeout=60
    )
    assert limited.returncode == 3 and "lag unknown" in _flat(limited)


def test_no_traceback_reaches_stdout_for_the_python_module_entry_point() -> None:
    # The CLI is also run as `python -m cli`; an unknown command is a usage error (2).
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "no-such-command"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("daemon", ["relay", "consume"])
def test_a_daemon_whose_topic_is_missing_at_start_exits_2(
    settings: OutboxSettings, tmp_path: Path, daemon: str
) -> None:
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{missing.replace('-', '_')}.py").write_text(
        f"import inbox\napp = inbox.Consumer(name='{missing}', topics=['{missing}'])\n"
    )
    cli = Cli(
        settings,
        (("PYTHONPATH", f"{tmp_path}:{ROOT}"), ("OUTBOX_TOPICS__NAMES", f"{missing}:3")),
    )
    args = ["relay"] if daemon == "relay" else ["consume", f"{missing.replace('-', '_')}:app"]
    proc = cli(*args, timeout=30)
    text = _flat(proc)
    assert proc.returncode == 2, text
    assert f"Kafka topic '{missing}' does not exist" in text and "outbox topics ensure" in text
    assert "Traceback" not in text


def test_a_consumer_started_while_kafka_is_down_waits_for_it_and_stops_cleanly(
    settings: OutboxSettings,
) -> None:
    # Kafka down at start is an outage, not a configuration error: the consumer waits
    # (one line), and SIGTERM still ends it cleanly.
    down = Cli(
        settings.model_copy(update={"kafka_bootstrap_servers": f"127.0.0.1:{_closed_port()}"})
    )
    proc = subprocess.Popen(
        down.command("consume", "examples.shop.consumer:app"),
        cwd=ROOT,
        env=down.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        time.sleep(8)
        still_running = proc.poll() is None
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert still_running, out
    assert proc.returncode == 0, out
    assert out.count("Kafka unavailable") == 1 and "Traceback" not in out, out
