"""A producer, the relay and a consumer as subprocesses, each started through a bootstrap
module that prepares the process first (``tests.support.traced``: an OpenTelemetry SDK
writing spans to a file; ``tests.support.no_otel``: OpenTelemetry unimportable).

Each process gets its own output file in ``out_dir`` (``producer``, ``relay``,
``consumer`` + ``suffix``); the consumer runs ``tests.support.traced_apps:app``.
"""

# ruff: noqa: ASYNC220  (starting the processes; blocking the test loop is harmless)

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from outbox.settings import OutboxSettings
from tests.support.inbox import ROOT, subprocess_env
from tests.support.relay import relay_env

CONSUMER_APP = "tests.support.traced_apps:app"


class Wrapped:
    def __init__(
        self, bootstrap: str, settings: OutboxSettings, topic: str, out_dir: Path, suffix: str
    ) -> None:
        self.bootstrap = bootstrap
        self.topic = topic
        self.group = f"wrapped-{topic}"
        self.out = {name: out_dir / f"{name}{suffix}" for name in ("producer", "relay", "consumer")}
        self.env = relay_env(
            settings, PYTHONPATH=str(ROOT), OUTBOX_RELAY__MIN_POLL_INTERVAL_SECONDS="0.01"
        )
        self.consumer_env = subprocess_env(
            settings,
            OUTBOX_DB_SCHEMA=settings.db_schema,
            OUTBOX_TABLE_PREFIX=settings.table_prefix,
            INBOX_TEST_CONSUMER=self.group,
            INBOX_TEST_TOPIC=self.topic,
        )

    def _argv(self, name: str, *args: str) -> list[str]:
        return [sys.executable, "-m", self.bootstrap, str(self.out[name]), *args]

    def publish(self, *args: str) -> str:
        """Run the bootstrap's ``publish`` mode for the topic; returns its stdout."""
        return self.produce("publish", *args)

    def produce(self, mode: str, *args: str) -> str:
        """Run one of the bootstrap's producing modes for the topic; returns its stdout."""
        done = subprocess.run(
            self._argv("producer", mode, self.topic, *args),
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout

    @asynccontextmanager
    async def daemons(self) -> AsyncIterator[None]:
        """Relay and consumer running; SIGTERM'd on exit, which must end them cleanly."""
        procs = [
            subprocess.Popen(
                argv, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
            )
            for argv, env in (
                (self._argv("relay", "cli", "relay"), self.env),
                (self._argv("consumer", "cli", "consume", CONSUMER_APP), self.consumer_env),
            )
        ]
        try:
            yield
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
        for proc in procs:
            assert proc.returncode == 0, proc.stderr.read().decode() if proc.stderr else ""
