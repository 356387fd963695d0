"""Acceptance fixtures: the ``outbox`` CLI run as a subprocess against the real services.

Every test that counts rows gets its own PostgreSQL schema (``OUTBOX_DB_SCHEMA``), migrated
to head, so counts never include rows of another test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, func, select

from outbox import migrate
from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.private_pg import PrivatePostgres, PrivatePostgresFailed, private_postgres

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL cluster of the test's own (tests/support/private_pg.py)."""
    try:
        with private_postgres(size_mb=64) as found:
            yield found
    except PrivatePostgresFailed as exc:
        pytest.fail(str(exc), pytrace=False)


@dataclass(frozen=True)
class Cli:
    """Runs ``python -m cli ...`` with the environment that points at ``settings``."""

    settings: OutboxSettings
    extra_env: tuple[tuple[str, str], ...] = ()

    @property
    def env(self) -> dict[str, str]:
        s = self.settings
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env.update(
            OUTBOX_DATABASE_URL=s.database_url.get_secret_value(),
            OUTBOX_KAFKA_BOOTSTRAP_SERVERS=s.kafka_bootstrap_servers,
            OUTBOX_DB_SCHEMA=s.db_schema,
            OUTBOX_LANES=str(s.lanes),
            OUTBOX_RELAY__KEEP_PUBLISHED_HOURS=str(s.relay.keep_published_hours),
            OUTBOX_CONSUMER__DEDUPE_WINDOW_DAYS=str(s.consumer.dedupe_window_days),
            OUTBOX_LOG_LEVEL="WARNING",
        )
        env.update(self.extra_env)
        return env

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cli", *args]

    def __call__(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(*args),
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def json(self, *args: str, expect_rc: int = 0) -> Any:
        """Run with ``--json``; assert the exit code; return the parsed stdout."""
        proc = self(*args, "--json")
        assert proc.returncode == expect_rc, (
            f"outbox {' '.join(args)} exited {proc.returncode} (expected {expect_rc})\n"
            f"stdout: {proc.stdout[-3000:]}\nstderr: {proc.stderr[-3000:]}"
        )
        return json.loads(proc.stdout)

    def popen(self, *args: str, log: Path) -> subprocess.Popen[bytes]:
        with log.open("wb") as sink:
            return subprocess.Popen(
                self.command(*args), cwd=ROOT, env=self.env, stdout=sink, stderr=subprocess.STDOUT
            )


@dataclass(frozen=True)
class Daemons:
    """``outbox relay`` and ``outbox consume APP`` running, each logging to its own file."""

    logs: dict[str, Path]
    procs: dict[str, subprocess.Popen[bytes]]

    def alive(self) -> bool:
        return all(p.poll() is None for p in self.procs.values())

    def dump(self) -> str:
        return "\n".join(
            f"--- {name}\n{path.read_text(errors='replace')[-3000:]}"
            for name, path in self.logs.items()
        )


@contextmanager
def relay_and_consumer(
    cli: Cli, app: str, topic: str, partitions: int, logs_dir: Path
) -> Iterator[Daemons]:
    """Ensure ``topic`` (and the app's dead-letter topic), start both daemons, and stop
    them afterwards (terminated; killed if they do not stop within 30 s)."""
    ensured = cli("topics", "ensure", "--topic", f"{topic}:{partitions}", "--app", app)
    assert ensured.returncode == 0, ensured.stdout + ensured.stderr
    logs = {name: logs_dir / f"{name}.log" for name in ("relay", "consumer")}
    procs = {
        "relay": cli.popen("relay", log=logs["relay"]),
        "consumer": cli.popen("consume", app, log=logs["consumer"]),
    }
    try:
        yield Daemons(logs, procs)
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def numbered_app(directory: Path, consumer: str, topic: str) -> str:
    """Write a consumer app module into ``directory`` (put it on PYTHONPATH) whose handler
    takes every ``test.numbered`` event of ``topic`` and does nothing; its MODULE:ATTR."""
    module = f"numbered_app_{uuid.uuid4().hex[:8]}"
    (directory / f"{module}.py").write_text(
        "import inbox\n"
        f"app = inbox.Consumer(name={consumer!r}, topics=[{topic!r}])\n"
        "@app.handler('test.numbered')\n"
        "async def handle(event: inbox.InboxEvent, session: object) -> None:\n"
        "    pass\n"
    )
    return f"{module}:app"


def handled(engine: Engine, settings: OutboxSettings, consumer: str) -> int:
    """How many events ``consumer``'s inbox holds."""
    inbox = build_tables(settings).inbox
    with engine.connect() as conn:
        query = select(func.count()).select_from(inbox).where(inbox.c.consumer == consumer)
        return int(conn.execute(query).scalar_one())


@pytest.fixture(scope="session")
def acceptance_engine(settings: OutboxSettings) -> Iterator[Engine]:
    # Tables are schema-qualified, so one engine on the test database serves every schema.
    engine = sync_engine(settings, pool_size=4)
    yield engine
    engine.dispose()


SchemaFactory = Callable[..., OutboxSettings]


@pytest.fixture(scope="session")
def fresh_schema(settings: OutboxSettings) -> SchemaFactory:
    """``fresh_schema(keep_published_hours=1, ...)``: settings for a new, migrated schema."""

    def make(
        keep_published_hours: float = 0, dedupe_window_days: float = 7, lanes: int = 8
    ) -> OutboxSettings:
        s = OutboxSettings(
            database_url=settings.database_url,
            kafka_bootstrap_servers=settings.kafka_bootstrap_servers,
            db_schema=f"acc_{uuid.uuid4().hex[:10]}",
            lanes=lanes,
            relay={"keep_published_hours": keep_published_hours},  # type: ignore[arg-type]
            consumer={"dedupe_window_days": dedupe_window_days},  # type: ignore[arg-type]
        )
        migrate.upgrade(s)
        return s

    return make
