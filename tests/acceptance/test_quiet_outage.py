"""A 30 s Kafka outage is quiet: ``outbox relay`` and ``outbox consume`` (subprocesses, INFO
logs) each write at most 6 lines about it — one when Kafka goes, one when it is back, and
whatever aiokafka gets through its rate limit — instead of hundreds. Nothing is lost.

The broker is a private one (stopping the shared broker would break everyone's tests). The
daemons' periodic status lines are not outage noise and are not counted (they are listed in
the failure message with everything else).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox.settings import OutboxSettings
from tests.acceptance.conftest import (
    ROOT,
    Cli,
    SchemaFactory,
    handled,
    numbered_app,
    relay_and_consumer,
)
from tests.support.kafka import ServicesFailed, private_broker
from tests.support.relay import publish_numbered

pytestmark = pytest.mark.acceptance

MAX_LINES = 6
_PERIODIC = ("consumer status", "relay status")


@pytest.fixture
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    try:
        with private_broker(tmp_path_factory.mktemp("kafka")) as found:
            yield found
    except ServicesFailed as exc:
        pytest.fail(str(exc), pytrace=False)


async def _wait_handled(
    engine: Engine, settings: OutboxSettings, consumer: str, count: int, within: float
) -> int:
    deadline = time.monotonic() + within
    seen = handled(engine, settings, consumer)
    while seen < count and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        seen = handled(engine, settings, consumer)
    return seen


def _outage_lines(log: Path, start: int, end: int) -> list[str]:
    lines = log.read_bytes()[start:end].decode(errors="replace").splitlines()
    return [line for line in lines if line.strip() and not any(p in line for p in _PERIODIC)]


async def test_a_30s_broker_outage_writes_at_most_6_lines_per_daemon(
    broker: tuple[str, object],
    fresh_schema: SchemaFactory,
    acceptance_engine: Engine,
    tmp_path: Path,
) -> None:
    bootstrap, services = broker
    assert callable(services)
    settings = fresh_schema().model_copy(update={"kafka_bootstrap_servers": bootstrap})
    suffix = uuid.uuid4().hex[:8]
    topic, group = f"quiet-{suffix}", f"quiet-{suffix}"
    app = numbered_app(tmp_path, group, topic)
    cli = Cli(
        settings,
        (
            ("PYTHONPATH", f"{tmp_path}:{ROOT}"),
            ("OUTBOX_LOG_LEVEL", "INFO"),
            ("OUTBOX_RELAY__ACK_TIMEOUT_SECONDS", "3"),
            ("OUTBOX_RETRY__CAP_SECONDS", "3"),
        ),
    )
    with relay_and_consumer(cli, app, topic, 3, tmp_path) as daemons:
        logs = daemons.logs
        publish_numbered(acceptance_engine, settings, topic, 200, keys=10)
        assert await _wait_handled(acceptance_engine, settings, group, 200, 60) == 200, _dump(logs)
        await asyncio.sleep(2)
        marks = {name: path.stat().st_size for name, path in logs.items()}
        await asyncio.to_thread(services, "kafka-stop")
        down_at = time.monotonic()
        publish_numbered(acceptance_engine, settings, topic, 200, keys=10, start=200)
        await asyncio.sleep(max(0.0, 30 - (time.monotonic() - down_at)))
        assert daemons.alive(), _dump(logs)
        await asyncio.to_thread(services, "kafka-start")
        handled = await _wait_handled(acceptance_engine, settings, group, 400, 120)
        await asyncio.sleep(3)  # whatever the recovery still logs
        ends = {name: path.stat().st_size for name, path in logs.items()}
    assert handled == 400, _dump(logs)
    counted = {name: _outage_lines(path, marks[name], ends[name]) for name, path in logs.items()}
    report = "\n".join(
        f"--- {name}: {len(lines)} lines\n" + "\n".join(lines) for name, lines in counted.items()
    )
    print(report)  # the figures for the record (pytest -s)
    assert all(len(lines) <= MAX_LINES for lines in counted.values()), report
    assert any("Kafka unavailable" in line for line in counted["relay"]), report
    assert any("Kafka reachable again" in line for line in counted["relay"]), report
    assert any("Kafka unavailable" in line for line in counted["consumer"]), report
    assert any("Kafka reachable again" in line for line in counted["consumer"]), report


def _dump(logs: dict[str, Path]) -> str:
    return "\n".join(
        f"--- {name}\n{path.read_text(errors='replace')[-3000:]}" for name, path in logs.items()
    )
