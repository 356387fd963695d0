"""No record stops a consumer: a record whose header NAME is not UTF-8 (Kafka's header names
are strings, but a foreign client can send any bytes), from a raw producer, ahead of
10 good records on the same partition. aiokafka decodes header names strictly and, left
alone, fails every fetch of the partition; `outbox consume` (a subprocess) dead-letters the
record instead (outbox/kafka/aiokafka_internals.py, "undecodable header names"), applies
the 10 behind it and stays up, and `outbox dlq show` shows the name escaped."""

from __future__ import annotations

import asyncio
import signal
import uuid
from collections.abc import Awaitable, Callable

import pytest
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from tests.support.inbox import (
    ce_headers,
    dlq_show,
    effect_counts,
    effects_table,
    numbered_body,
    outbox_cli,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import read_all
from tests.support.raw_headers import RawName, produce_raw_names

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]

BAD_NAME = b"user-\xff\xfename"  # not UTF-8
SHOWN = "user-\\xff\\xfename"  # as the dead letter shows it


async def test_a_header_name_not_utf8_is_dead_lettered_and_the_partition_moves_on(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    group = f"c-{uuid.uuid4().hex[:8]}"
    run = uuid.uuid4().hex[:6]
    bad_headers = [*ce_headers(f"{run}-bad"), (RawName(BAD_NAME), b"v\xff")]
    bad = (b"k", numbered_body(0, False), bad_headers)
    good = [(b"k", numbered_body(10 + i, False), ce_headers(f"{run}-good-{i}")) for i in range(10)]
    # One producer lingering: the bad record and the good ones share a record batch.
    await produce_raw_names(kafka_bootstrap, topic, [bad, *good])

    env = subprocess_env(
        settings,
        INBOX_TEST_CONSUMER=group,
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
        INBOX_TEST_MAX_ATTEMPTS="2",
    )
    consumer = outbox_cli(["consume", "tests.support.inbox_apps:app"], env)
    bad_id = f"{topic}:0:0"  # malformed: known by its position
    try:
        await wait_for(
            lambda: consumer.poll() is not None or len(effect_counts(engine, table)) == 10,
            what="the 10 good records applied",
        )
        await wait_for(
            lambda: consumer.poll() is not None or bad_id in _dead_letters(engine, settings, group),
            what="the record with a header name not UTF-8 dead-lettered",
        )
        await asyncio.sleep(1.0)
        assert consumer.poll() is None, consumer.stderr.read().decode() if consumer.stderr else ""

        assert effect_counts(engine, table) == {f"{run}-good-{i}": 1 for i in range(10)}
        stored = _dead_letters(engine, settings, group)
        assert list(stored) == [bad_id]
        # The table keeps the header values byte for byte and the name escaped (text).
        names, values = stored[bad_id]
        assert names[-1] == SHOWN and values[-1] == b"v\xff"
        assert values[:-1] == [v for _, v in ce_headers(f"{run}-bad")]

        # The dead-letter topic has the record, its name escaped (a producer sends names
        # as UTF-8 strings) and the reason.
        (copy,) = await read_all(kafka_bootstrap, topic + ".dlq", expect=1)
        assert copy.value == numbered_body(0, False) and copy.key == b"k"
        assert copy.headers[SHOWN] == b"v\xff"
        assert copy.headers["dlq_error_class"] == b"MalformedRecord"
        assert copy.headers["dlq_original_offset"] == b"0"

        shown = dlq_show(env, group, [bad_id])[bad_id]
        assert "MalformedRecord: header name user-\\xff\\xfename is not UTF-8" in shown
        assert f"header {SHOWN} = v\\xff" in shown
    finally:
        if consumer.poll() is None:
            consumer.send_signal(signal.SIGTERM)
        code = consumer.wait(60)
        err = consumer.stderr.read().decode() if consumer.stderr else ""
        assert code == 0, err[-4000:]


def _dead_letters(
    engine: Engine, settings: OutboxSettings, group: str
) -> dict[str, tuple[list[str], list[bytes]]]:
    table = f'"{settings.db_schema}"."{settings.table_prefix}dead_letters"'
    with engine.connect() as conn:
        rows = conn.execute(
            text(f"SELECT event_id, header_names, header_values FROM {table} WHERE consumer = :c"),
            {"c": group},
        )
        return {r[0]: (list(r[1]), [bytes(v) for v in r[2]]) for r in rows}
