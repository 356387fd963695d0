"""WAL mode fails closed at the producer (issue 51): an event that no slot will read is
refused, and nothing is written.

A logical slot decodes only WAL written after its creation, so a message emitted while the
configured slot does not exist (producers deployed before ``outbox wal setup``; after the
slot was dropped) is gone for good. ``publish`` raises ``WalSlotMissing`` then, the caller's
transaction rolls back with its domain rows, and, even for a caller that catches the error
and commits, no message was emitted (counted on a second slot that does exist).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import ConfigurationError, Message, Outbox, WalSlotMissing
from outbox.envelope import MessageFields
from outbox.settings import OutboxSettings
from tests.support.wal import drop_slot

pytestmark = pytest.mark.integration


@pytest.fixture
def orders(engine: Engine) -> Iterator[str]:
    """A domain table of the test's own."""
    name = f"gate_orders_{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id int PRIMARY KEY)"))
    yield name
    with engine.begin() as conn:
        conn.execute(text(f"DROP TABLE {name}"))


def _without_slot(settings: OutboxSettings) -> OutboxSettings:
    """The same prefix and publication, a slot name that does not exist."""
    wal = settings.wal.model_copy(update={"slot": f"outbox_absent_{uuid.uuid4().hex[:8]}"})
    return settings.model_copy(update={"wal": wal})


def _messages_in(engine: Engine, settings: OutboxSettings) -> int:
    """Logical messages under the prefix in the (existing) slot, peeked, not consumed."""
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                "SELECT data FROM pg_logical_slot_peek_binary_changes(:slot, NULL, NULL,"
                " 'proto_version', '1', 'publication_names', :pub, 'messages', 'true')"
            ),
            {"slot": settings.wal.slot, "pub": settings.wal.publication},
        ).all()
    prefix = settings.wal.prefix.encode() + b"\x00"
    return sum(1 for (data,) in rows if data[:1] == b"M" and prefix in bytes(data[:80]))


def _count(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def _event(n: int) -> Message:
    return Message(topic="orders", key=f"k{n}", event_type="order.created", payload={"n": n})


ONE: MessageFields = {
    "topic": "orders",
    "key": "k1",
    "event_type": "order.created",
    "payload": {"n": 1},
}


def test_no_slot_raises_and_the_transaction_commits_nothing(
    engine: Engine, wal_settings: OutboxSettings, orders: str
) -> None:
    absent = _without_slot(wal_settings)
    ob = Outbox(absent)
    with pytest.raises(WalSlotMissing) as raised, engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {orders} VALUES (1)"))
        ob.publish_many(conn, [_event(n) for n in range(100)])
    assert isinstance(raised.value, ConfigurationError)
    assert absent.wal.slot in str(raised.value) and "outbox wal setup" in str(raised.value)
    assert _count(engine, orders) == 0  # the domain row rolled back with the event
    with pytest.raises(WalSlotMissing), engine.begin() as conn:
        ob.publish(conn, **ONE)
    assert _messages_in(engine, wal_settings) == 0


def test_a_caller_that_swallows_the_error_and_commits_still_emitted_nothing(
    engine: Engine, wal_settings: OutboxSettings, orders: str
) -> None:
    ob = Outbox(_without_slot(wal_settings))
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {orders} VALUES (1)"))
        with pytest.raises(WalSlotMissing):
            ob.publish_many(conn, [_event(n) for n in range(3)])
    assert _count(engine, orders) == 1
    assert _messages_in(engine, wal_settings) == 0  # the gate ran before any message


def test_several_messages_in_one_statement_are_refused_as_one(
    engine: Engine, wal_settings: OutboxSettings
) -> None:
    # Over 256 KiB of events: publish_many packs them into several messages, one statement
    # (the unnest path), and the gate must stop them all, then pass them all.
    big = [
        Message(topic="orders", key=f"k{n}", event_type="t", payload={"pad": "x" * 100_000})
        for n in range(5)
    ]
    with engine.begin() as conn, pytest.raises(WalSlotMissing):
        Outbox(_without_slot(wal_settings)).publish_many(conn, big)
    assert _messages_in(engine, wal_settings) == 0
    with engine.begin() as conn:
        Outbox(wal_settings).publish_many(conn, big)
    assert _messages_in(engine, wal_settings) >= 2


def test_with_the_slot_events_are_emitted_and_after_a_drop_refused(
    engine: Engine, wal_settings: OutboxSettings, orders: str
) -> None:
    ob = Outbox(wal_settings)
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {orders} VALUES (1)"))
        ids = ob.publish_many(conn, [_event(n) for n in range(100)])
        ob.publish(conn, **ONE)
    assert len(ids) == 100
    assert _messages_in(engine, wal_settings) == 2  # publish_many packs 100 in one message
    drop_slot(wal_settings, wait=10)
    with pytest.raises(WalSlotMissing), engine.begin() as conn:
        conn.execute(text(f"INSERT INTO {orders} VALUES (2)"))
        ob.publish(conn, **ONE)
    assert _count(engine, orders) == 1


async def test_async_publish_is_refused_too(
    aengine: AsyncEngine, engine: Engine, wal_settings: OutboxSettings, orders: str
) -> None:
    ob = Outbox(_without_slot(wal_settings))
    with pytest.raises(WalSlotMissing):
        async with aengine.begin() as conn:
            await conn.execute(text(f"INSERT INTO {orders} VALUES (1)"))
            await ob.publish_async(conn, **ONE)
    with pytest.raises(WalSlotMissing):
        async with aengine.begin() as conn:
            await ob.publish_many_async(conn, [_event(n) for n in range(5)])
    assert _count(engine, orders) == 0
    assert _messages_in(engine, wal_settings) == 0
