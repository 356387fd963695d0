"""The relay's wake-up (outbox/wake.py): producers notify only while a relay sleeps with a
wake slot, never lose a wake-up, and a sleeping relay publishes at once, well before its
poll would have."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import Engine

from outbox import Outbox
from outbox.envelope import Message
from outbox.settings import OutboxSettings
from outbox.wake import WAKE_SLOTS, trigger_name, wake_channel, wake_namespace
from tests.support.relay import RelayProcess, pending, publish_numbered, read_ids, relay_env

pytestmark = pytest.mark.integration
# Wake slots held (the namespace's advisory locks of two keys).
_HELD = (
    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
    " AND classid = %s AND objsubid = 2"
)


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> OutboxSettings:
    # A relay publishes every pending row of its tables: give each test tables of its own.
    return isolated_settings


def _notified(listener: psycopg.Connection[tuple[object, ...]], seconds: float) -> int:
    return sum(1 for _ in listener.notifies(timeout=seconds))


def test_producers_notify_only_while_a_slot_is_held_and_an_open_producer_blocks_it(
    engine: Engine, settings: OutboxSettings
) -> None:
    dsn = settings.libpq_dsn
    ns = wake_namespace(settings.db_schema, settings.table_prefix)
    channel = wake_channel(settings.db_schema, settings.table_prefix)
    with (
        psycopg.connect(dsn, autocommit=True) as listener,
        psycopg.connect(dsn, autocommit=True) as sleeper,
    ):
        listener.execute(f"LISTEN {channel}")
        publish_numbered(engine, settings, "wake-test", 3, per_tx=1)
        assert _notified(listener, 0.5) == 0  # no relay sleeps: no producer notifies

        # The last slot, say: every slot is tried.
        assert sleeper.execute(
            "SELECT pg_try_advisory_lock(%s, %s)", (ns, WAKE_SLOTS - 1)
        ).fetchone() == (True,)
        publish_numbered(engine, settings, "wake-test", 2, per_tx=1)
        assert _notified(listener, 1.0) == 2  # one per committed transaction
        sleeper.execute("SELECT pg_advisory_unlock(%s, %s)", (ns, WAKE_SLOTS - 1))

        # A producer that inserted and has not committed holds the slots in shared mode:
        # a relay cannot start sleeping then (it would miss that commit), so it polls.
        with engine.connect() as producer:
            message = Message(topic="wake-test", event_type="t", payload={})
            Outbox(settings).publish_many(producer, [message])
            free = sleeper.execute("SELECT pg_try_advisory_lock(%s, 0)", (ns,)).fetchone()
            assert free == (False,)
            producer.commit()
        assert sleeper.execute("SELECT pg_try_advisory_lock(%s, 0)", (ns,)).fetchone() == (True,)


async def test_a_sleeping_relay_publishes_a_new_event_at_once(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=1)
    # Every sleep of this relay is 1.5 s or more (30 s once idle): without a wake-up an
    # event would wait ~0.75-1.5 s for the next poll.
    env = relay_env(
        settings,
        OUTBOX_RELAY__MIN_POLL_INTERVAL_SECONDS="1.5",
        OUTBOX_RELAY__POLL_INTERVAL_SECONDS="30",
    )
    relay = RelayProcess(env, tmp_path, "relay")
    ns = wake_namespace(settings.db_schema, settings.table_prefix)
    try:
        latencies = []
        ids: list[str] = []
        with psycopg.connect(settings.libpq_dsn, autocommit=True) as watch:
            for n in range(3):
                await asyncio.to_thread(_until_sleeping, watch, ns, relay)
                started = time.monotonic()
                ids += publish_numbered(engine, settings, topic, 1, start=n)
                latencies.append(await asyncio.to_thread(_published, engine, settings, started))
        # Each took a claim and a Kafka round trip, not a poll interval.
        assert max(latencies) < 0.6, latencies
        got = await read_ids(settings.kafka_bootstrap_servers, topic, ids)
        assert sorted({r.headers["ce_id"].decode() for r in got}) == sorted(ids)
    finally:
        code, _ = relay.terminate()
    assert code == 0, relay.log()


def _published(engine: Engine, settings: OutboxSettings, started: float) -> float:
    """Seconds from ``started`` until the outbox is empty again: Kafka acknowledged the
    event and the relay committed."""
    while pending(engine, settings) and time.monotonic() - started < 10:
        time.sleep(0.01)
    return time.monotonic() - started


def _until_sleeping(
    watch: psycopg.Connection[tuple[object, ...]], ns: int, relay: RelayProcess
) -> None:
    """Until the relay's claim session holds a wake slot (it sleeps after an empty claim)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert relay.alive(), relay.log()
        (held,) = watch.execute(_HELD, (ns,)).fetchone() or (0,)
        if held:
            return
        time.sleep(0.05)
    raise AssertionError(f"the relay never slept with a wake slot: {relay.log()}")


async def test_without_the_trigger_the_relay_polls_as_before(
    engine: Engine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    # A schema from a team's own Alembic history has no trigger: no slot is worth holding
    # (no producer would notify), so the relay keeps its polling schedule.
    topic = await new_topic(partitions=1)
    events = f'"{settings.db_schema}"."{settings.table_prefix}events"'
    with engine.begin() as conn:
        conn.exec_driver_sql(f'DROP TRIGGER "{trigger_name(settings.table_prefix)}" ON {events}')
    relay = RelayProcess(relay_env(settings), tmp_path, "relay")
    ns = wake_namespace(settings.db_schema, settings.table_prefix)
    try:
        await asyncio.sleep(3)  # registered, lanes taken, polls long empty
        with psycopg.connect(settings.libpq_dsn, autocommit=True) as watch:
            assert watch.execute(_HELD, (ns,)).fetchone() == (0,)
        started = time.monotonic()
        publish_numbered(engine, settings, topic, 1)
        # Within the idle backoff (0.2 s at most) and a round trip.
        assert await asyncio.to_thread(_published, engine, settings, started) < 1.0
    finally:
        code, _ = relay.terminate()
    assert code == 0, relay.log()
    assert "no wake-up trigger" in relay.log()
