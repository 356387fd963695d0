"""Daemons check the schema before they join anything, and say what to run.

``outbox consume`` pointed at a schema without the framework's tables (or behind this
version) exits 2 with one line naming ``outbox db upgrade`` before it joins its consumer
group: the group's running member keeps all its partitions (no rebalance). ``outbox relay``
does the same before taking lanes (also tests/integration/test_relay_process.py). An app
that cannot be imported is exit 2 and one line that names the module and what failed while
importing it.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox import migrate
from outbox.settings import OutboxSettings
from tests.acceptance.conftest import ROOT, Cli, SchemaFactory, numbered_app

pytestmark = pytest.mark.acceptance

PARTITIONS = 4
# Longer than the member's heartbeat interval (3 s): a join by the second process would
# have reached it as a rebalance by then.
REBALANCE_SETTLE_SECONDS = 8.0


def _lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]


def _assignments(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "assigned" in line]


def test_a_consumer_without_the_schema_exits_2_and_the_group_keeps_its_partitions(
    fresh_schema: SchemaFactory, tmp_path: Path
) -> None:
    good = fresh_schema()
    suffix = uuid.uuid4().hex[:8]
    group, topic = f"schema-{suffix}", f"schema-{suffix}"
    app = numbered_app(tmp_path, group, topic)
    path = (("PYTHONPATH", f"{tmp_path}:{ROOT}"),)
    member = Cli(good, (*path, ("OUTBOX_LOG_LEVEL", "INFO")))
    ensured = member("topics", "ensure", "--topic", f"{topic}:{PARTITIONS}", "--app", app)
    assert ensured.returncode == 0, ensured.stdout + ensured.stderr
    log = tmp_path / "member.log"
    running = member.popen("consume", app, log=log)
    try:
        deadline = time.monotonic() + 60
        while not _assignments(log) and time.monotonic() < deadline and running.poll() is None:
            time.sleep(0.2)
        [first] = _assignments(log)
        assert all(f"partition={p}" in first for p in range(PARTITIONS)), first

        # Same group, a schema where `outbox db upgrade` never ran.
        empty = good.model_copy(update={"db_schema": f"empty_{suffix}"})
        started = time.monotonic()
        refused = Cli(empty, path)("consume", app, timeout=60)
        took = time.monotonic() - started
        # The start line (what it was asked to run), then the error: nothing else.
        start, line = _lines(refused)
        assert refused.returncode == 2, line
        assert start.startswith(f"consumer {group} on {topic} (1 handler, "), start
        assert line.startswith("error: SchemaMissing: no outbox tables in schema "), line
        assert "run `outbox db upgrade`" in line and "Traceback" not in line

        time.sleep(REBALANCE_SETTLE_SECONDS)
        assert running.poll() is None, log.read_text()
        assert _assignments(log) == [first], log.read_text()[-3000:]  # no rebalance
    finally:
        running.terminate()
        running.wait(30)
    assert took < 30, took


def test_a_consumer_or_relay_on_an_older_schema_exits_2_naming_both_revisions(
    settings: OutboxSettings, acceptance_engine: Engine, tmp_path: Path
) -> None:
    older = settings.model_copy(update={"db_schema": f"older_{uuid.uuid4().hex[:8]}"})
    migrate.upgrade(older, "0007")
    head = migrate.head()
    app = numbered_app(tmp_path, f"older-{uuid.uuid4().hex[:6]}", "older-topic")
    cli = Cli(older, (("PYTHONPATH", f"{tmp_path}:{ROOT}"),))
    for args in (["consume", app], ["relay"]):
        proc = cli(*args, timeout=60)
        *start, line = _lines(proc)
        assert proc.returncode == 2, line
        assert len(start) == (1 if args[0] == "consume" else 0), start  # the consumer's start
        assert line.startswith("error: SchemaOutdated: database schema "), line
        assert f"at revision 0007, this version of outbox-inbox needs {head}" in line, line
        assert "run `outbox db upgrade` to bring them up to date" in line


@pytest.mark.parametrize(
    ("source", "says"),
    [
        ("import requests_not_installed_anywhere\n", "ModuleNotFoundError: No module named "),
        ("def broken(:\n    pass\n", "SyntaxError: invalid syntax"),
        ("import os\nSETTING = os.environ['NOT_SET_ANYWHERE_42']\n", "KeyError: "),
    ],
    ids=["missing dependency", "syntax error", "exception"],
)
def test_an_app_that_cannot_be_imported_is_one_line_naming_the_module_and_exit_2(
    settings: OutboxSettings, tmp_path: Path, source: str, says: str
) -> None:
    module = f"broken_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(source)
    cli = Cli(settings, (("PYTHONPATH", f"{tmp_path}:{ROOT}"),))
    for args in (["consume", f"{module}:app"], ["topics", "ensure", "--app", f"{module}:app"]):
        proc = cli(*args, timeout=60)
        [line] = _lines(proc)
        assert proc.returncode == 2, line
        assert f"cannot import {module!r}: importing it raised {says}" in line, line
        assert f"{module}.py line " in line, line
