"""The README's producer and consumer snippets, run as printed against the real services:
the producer snippet commits an event, a relay publishes it, ``outbox consume`` runs the
consumer snippet and its handler writes the shipment.

Only the names shared with other test runs are changed (the topic ``orders`` and the group
``shipping`` live on a shared broker); everything else is the README's text.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from tests.acceptance.conftest import ROOT, Cli, SchemaFactory
from tests.support.snippets import snippets

pytestmark = pytest.mark.acceptance


def readme_snippets() -> dict[str, str]:
    """Fenced python blocks that follow an ``<!-- snippet: NAME -->`` comment."""
    found = snippets("README.md")
    assert {"producer", "consumer"} <= set(found), sorted(found)
    return found


def test_the_snippets_fit_together() -> None:
    snippets = readme_snippets()
    published = re.findall(r'event_type="([\w.]+)"', snippets["producer"])
    handled = re.findall(r'@app\.handler\("([\w.]+)"', snippets["consumer"])
    assert published and set(published) <= set(handled)


def test_readme_producer_and_consumer_run_as_printed(
    fresh_schema: SchemaFactory, acceptance_engine: Engine, tmp_path: Path
) -> None:
    settings: OutboxSettings = fresh_schema()
    suffix = uuid.uuid4().hex[:8]
    topic, group = f"orders-{suffix}", f"shipping-{suffix}"
    snippets = {
        name: code.replace('"orders"', f'"{topic}"').replace('"shipping"', f'"{group}"')
        for name, code in readme_snippets().items()
    }
    (tmp_path / "shipping.py").write_text(snippets["consumer"])
    (tmp_path / "producer.py").write_text(snippets["producer"])
    shipments = f"{settings.db_schema}.shipments"
    with acceptance_engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {shipments} (order_id int PRIMARY KEY)"))
    # The snippet's unqualified table name resolves in the test's schema.
    cli = Cli(settings, (("PGOPTIONS", f"-c search_path={settings.db_schema}"),))
    env = {**cli.env, "PYTHONPATH": str(ROOT)}
    ensured = _run(cli.command("topics", "ensure", "--topic", topic, "--app", "shipping:app"),
                   tmp_path, env)  # fmt: skip
    assert ensured.returncode == 0, ensured.stdout + ensured.stderr
    outbox = [sys.executable, "-m", "cli"]
    logs = {name: (tmp_path / f"{name}.log").open("wb") for name in ("relay", "consumer")}
    daemons = [
        subprocess.Popen(
            [*outbox, "relay"],
            cwd=tmp_path,
            env=env,
            stdout=logs["relay"],
            stderr=subprocess.STDOUT,
        ),
        subprocess.Popen(
            [*outbox, "consume", "shipping:app"],
            cwd=tmp_path,
            env=env,
            stdout=logs["consumer"],
            stderr=subprocess.STDOUT,
        ),
    ]
    try:
        produced = _run([sys.executable, "producer.py"], tmp_path, env)
        assert produced.returncode == 0, produced.stderr
        shipped: list[int] = []
        deadline = time.monotonic() + 60
        while not shipped and time.monotonic() < deadline:
            assert all(d.poll() is None for d in daemons), _logs(tmp_path)
            with acceptance_engine.connect() as conn:
                shipped = list(conn.execute(text(f"SELECT order_id FROM {shipments}")).scalars())
            time.sleep(0.3)
    finally:
        for d in daemons:
            d.terminate()
        for d in daemons:
            d.wait(30)
        for sink in logs.values():
            sink.close()
    assert shipped == [42], _logs(tmp_path)
    assert [d.returncode for d in daemons] == [0, 0], _logs(tmp_path)


def _run(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=60, check=False
    )


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in tmp_path.glob("*.log")
    )
