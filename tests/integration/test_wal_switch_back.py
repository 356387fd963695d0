"""Switching a deployment from the WAL source back to the outbox table, as documented in
docs/howto/wal-source.md: the producers switch, ``outbox wal wait-drained`` waits until the
slot's events are all in Kafka, then the table relay starts and the WAL relay stops —
every key in order, nothing lost. Real PostgreSQL and Kafka, the CLI as subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox.settings import OutboxSettings
from tests.support.relay import (
    RelayProcess,
    outbox_cli,
    publish_numbered,
    read_ids,
    relay_env,
    verdict,
)
from tests.support.wal import wal_relay_env

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(wal_settings: OutboxSettings) -> OutboxSettings:
    return wal_settings


def _one_line(stderr: str) -> None:
    assert "Traceback" not in stderr, stderr
    assert len(stderr.strip().splitlines()) == 1, stderr


async def test_switching_back_to_the_table_under_a_stream_keeps_every_key_in_order(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=4)
    table = settings.model_copy(update={"source": "table"})
    # A WAL relay slowed down (small batches) still has a backlog in the slot when the
    # producers switch: a table relay started then would overtake it on every key.
    slow = {"OUTBOX_RELAY__BATCH_SIZE": "10", "OUTBOX_WAL__HEARTBEAT_SECONDS": "0.5"}
    wal_relay = RelayProcess(wal_relay_env(settings, **slow), tmp_path, "wal")
    table_relay: RelayProcess | None = None
    try:
        wal_ids: list[str] = []
        for chunk in range(40):  # WAL mode: 4,000 events over 40 keys
            wal_ids.extend(
                publish_numbered(engine, settings, topic, 100, keys=40, start=chunk * 100)
            )
        table_ids: list[str] = []
        for chunk in range(40, 80):  # switched: the next 4,000 go to the table
            table_ids.extend(
                publish_numbered(engine, table, topic, 100, keys=40, start=chunk * 100)
            )
        waited = await asyncio.to_thread(
            outbox_cli,
            "wal",
            "wait-drained",
            "--timeout",
            "120",
            env=wal_relay_env(settings),
            timeout=150,
        )
        assert waited.returncode == 0, waited.stderr
        assert "drained" in waited.stderr and "Traceback" not in waited.stderr
        # Frozen from now on: what the slot held must be in Kafka already.
        os.kill(wal_relay.pid, signal.SIGSTOP)
        published = await read_ids(settings.kafka_bootstrap_servers, topic, wal_ids, 30)
        assert verdict(published, wal_ids).lost == 0
        os.kill(wal_relay.pid, signal.SIGCONT)

        table_relay = RelayProcess(relay_env(table), tmp_path, "table")
        code, _ = wal_relay.terminate()
        assert code == 0, wal_relay.log()[-3000:]
        records = await read_ids(settings.kafka_bootstrap_servers, topic, wal_ids + table_ids, 120)
    finally:
        wal_relay.kill()
        if table_relay is not None:
            table_relay.kill()
    v = verdict(records, wal_ids + table_ids)
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v


async def test_wait_drained_without_a_reader_gives_up_after_its_timeout(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
) -> None:
    topic = await new_topic(partitions=1)
    publish_numbered(engine, settings, topic, 10)  # in the slot; no relay reads it
    waited = await asyncio.to_thread(
        outbox_cli, "wal", "wait-drained", "--timeout", "1", env=wal_relay_env(settings)
    )
    assert waited.returncode == 1, waited.stderr
    assert "not drained after 1s" in waited.stderr and "is a WAL relay reading it" in waited.stderr
    assert "Traceback" not in waited.stderr


def test_wait_drained_on_a_missing_slot_exits_2_with_one_line(settings: OutboxSettings) -> None:
    env = wal_relay_env(settings, OUTBOX_WAL__SLOT="outbox_no_such_slot")
    waited = outbox_cli("wal", "wait-drained", "--timeout", "5", env=env)
    assert waited.returncode == 2, waited.stderr
    assert "replication slot 'outbox_no_such_slot' does not exist" in waited.stderr
    _one_line(waited.stderr)
