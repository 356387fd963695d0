"""Invalid topics and the other inputs the issue found untyped, against real PostgreSQL in
both sources; and an invalid topic that reaches the relay anyway (a row forced in with
SQL) is that row's permanent error: counted, then moved to `failed`, while the rest of its
lane goes on."""

from __future__ import annotations

import asyncio
import math
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import InvalidText, InvalidTopic, Outbox, PayloadError, PayloadTooLarge
from outbox.settings import OutboxSettings
from relay import Relay, list_failed
from tests.support.kafka import read_all
from tests.support.relay import fast
from tests.support.wal import wal_source

pytestmark = pytest.mark.integration

INVALID_TOPICS: list[Any] = ["orders\n", "orders\r\n", "or ders", "", "..", "x" * 250, 42, None]
# The issue's untyped errors on main, each with the typed error and field it gets now.
ISSUE_INPUTS: list[tuple[dict[str, Any], type[PayloadError], str]] = [
    ({"topic": 7}, InvalidTopic, "topic"),
    ({"key": "k\ud800"}, InvalidText, "key"),
    ({"event_type": "a\x00b"}, InvalidText, "event_type"),
    ({"headers": {"h": "\x00"}}, InvalidText, "header 'h'"),
    ({"source": "urn:\x00"}, InvalidText, "source"),
    ({"delay_seconds": math.nan}, PayloadError, "delay_seconds"),
    ({"delay_seconds": math.inf}, PayloadError, "delay_seconds"),
    ({"delay_seconds": 1e15}, PayloadError, "delay_seconds"),
    ({"source": "s" * 70_000}, PayloadError, "source"),
    ({"headers": {"h": "\N{GRINNING FACE}" * 300_000}}, PayloadTooLarge, "payload"),
]


@pytest.fixture(params=["table", "wal"])
def mode_settings(
    request: pytest.FixtureRequest, isolated_settings: OutboxSettings
) -> Iterator[OutboxSettings]:
    if request.param == "table":
        yield isolated_settings
    else:
        with wal_source(isolated_settings) as wal:
            yield wal


def test_invalid_topics_and_the_issues_inputs_are_refused_typed_in_both_sources(
    engine: Engine, mode_settings: OutboxSettings
) -> None:
    ob = Outbox(mode_settings)
    good: dict[str, Any] = {"topic": "orders", "event_type": "t", "payload": {"a": 1}}
    with engine.connect() as conn, conn.begin():
        for topic in INVALID_TOPICS:
            with pytest.raises(InvalidTopic) as info:
                ob.publish(conn, **{**good, "topic": topic})
            assert info.value.field == "topic"
        for fields, error, field in ISSUE_INPUTS:
            if mode_settings.source == "wal" and "delay_seconds" in fields:
                continue  # refused in WAL mode anyway (UnsupportedInWalMode), checked below
            with pytest.raises(error) as caught:
                ob.publish(conn, **{**good, **fields})
            assert caught.value.field == field, fields
        # Nothing was sent to the database: the transaction is as good as before.
        ob.publish(conn, **good)
        assert conn.execute(text("SELECT 1")).scalar() == 1
    if mode_settings.source == "wal":
        with engine.connect() as conn, conn.begin(), pytest.raises(PayloadError) as wal:
            ob.publish(conn, **{**good, "delay_seconds": math.nan})
        assert wal.value.field == "delay_seconds"


@pytest.mark.parametrize("topic", ["orders\n", "bad topic"])
async def test_an_invalid_topic_forced_into_the_table_reaches_failed(
    engine: Engine,
    isolated_settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    running: Callable[[OutboxSettings], Awaitable[Relay]],
    topic: str,
) -> None:
    settings = isolated_settings
    good_topic = await new_topic()
    ob = Outbox(settings)
    events = ob.tables.events.fullname
    forced = uuid.uuid4()
    with engine.begin() as conn:
        before = ob.publish(conn, topic=good_topic, key="k", event_type="t", payload={"n": 0})
        # A row written by hand (or an older version): publish() refuses this topic.
        conn.execute(
            text(
                f"INSERT INTO {events} (event_id, topic, key, lane, event_type, source,"
                " content_type, payload, fingerprint) SELECT :eid, :topic, key, lane,"
                f" event_type, source, content_type, payload, fingerprint FROM {events}"
                " WHERE event_id = :before"
            ),
            {"eid": forced, "topic": topic, "before": before},
        )
        after = ob.publish(conn, topic=good_topic, key="k", event_type="t", payload={"n": 2})
    relay = await running(fast(settings, max_attempts=2))
    records = await read_all(settings.kafka_bootstrap_servers, good_topic, expect=2)
    assert [r.headers["ce_id"].decode() for r in records] == [str(before), str(after)]
    deadline = asyncio.get_running_loop().time() + 30
    while not (rows := list_failed(settings)[0]):
        assert asyncio.get_running_loop().time() < deadline, "the forced row never failed"
        await asyncio.sleep(0.2)
    [failed] = rows
    assert (failed.event_id, failed.topic, failed.attempts) == (str(forced), topic, 2)
    assert "not a valid topic name" in (failed.last_error or "")
    assert relay.metrics.failed._value.get() == 1


async def test_publish_async_refuses_the_same_inputs_typed(
    aengine: AsyncEngine, mode_settings: OutboxSettings
) -> None:
    ob = Outbox(mode_settings)
    good: dict[str, Any] = {"topic": "orders", "event_type": "t", "payload": {"a": 1}}
    async with aengine.connect() as conn, conn.begin():
        for fields, error, field in [({"topic": "orders\n"}, InvalidTopic, "topic"), *ISSUE_INPUTS]:
            if mode_settings.source == "wal" and "delay_seconds" in fields:
                continue
            with pytest.raises(error) as caught:
                await ob.publish_async(conn, **{**good, **fields})
            assert caught.value.field == field, fields
        await ob.publish_async(conn, **good)
