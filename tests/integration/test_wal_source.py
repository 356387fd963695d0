"""The relay's WAL source (issue 39) as a subprocess on real PostgreSQL and Kafka: events
published as logical-decoding messages reach Kafka in per-key order, survive SIGKILLs of
the reader (a standby takes over), a refused event goes to the failed table, and a slot
lost under the relay stops it with exit 2 and one line."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.ext.asyncio import AsyncEngine

from outbox import TOMBSTONE, Message, Outbox, UnsupportedInWalMode
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.support.relay import (
    RelayProcess,
    publish_numbered,
    read_ids,
    relay_env,
    verdict,
)
from tests.support.wal import confirmed_lsn, wal_env, wal_source

pytestmark = pytest.mark.integration


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> Iterator[OutboxSettings]:
    with wal_source(isolated_settings) as own:
        yield own


def _env(settings: OutboxSettings, **extra: str) -> dict[str, str]:
    return relay_env(settings, **wal_env(settings), **extra)


def _wait_for(what: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


async def test_round_trip_in_key_order_with_every_envelope_field(
    engine: Engine,
    aengine: AsyncEngine,
    settings: OutboxSettings,
    new_topic: Callable[..., Awaitable[str]],
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=4)
    ob = Outbox(settings)
    # 40 keys, in transactions of 100 (publish_many) and one by one (publish).
    ids = publish_numbered(engine, settings, topic, 4_000, keys=40)
    with engine.begin() as conn:
        for n in range(4_000, 4_040):
            ids.append(
                str(
                    ob.publish(
                        conn,
                        topic=topic,
                        key=f"k{n % 40}",
                        event_type="test.numbered",
                        payload={"key": f"k{n % 40}", "seq": n},
                        headers={"x-trace": "t1"},
                    )
                )
            )
    async with aengine.begin() as aconn:
        ids.append(
            str(
                await ob.publish_async(
                    aconn,
                    topic=topic,
                    key="k0",
                    event_type="test.numbered",
                    payload={"key": "k0", "seq": 4_040},
                    source="urn:async",
                )
            )
        )
        tomb = await ob.publish_many_async(
            aconn,
            [Message(topic=topic, key="gone", event_type="test.deleted", payload=TOMBSTONE)],
        )
    with engine.begin() as conn, pytest.raises(UnsupportedInWalMode):
        ob.publish(conn, topic=topic, event_type="t", payload={}, delay_seconds=5)
    # Nothing went through the outbox table.
    events = build_tables(settings).events
    with engine.connect() as conn:
        assert conn.execute(text(f"SELECT count(*) FROM {events.fullname}")).scalar_one() == 0
    before = confirmed_lsn(settings)
    relay = RelayProcess(_env(settings), tmp_path, "wal")
    try:
        records = await read_ids(settings.kafka_bootstrap_servers, topic, [*ids, str(tomb[0])])
        assert relay.alive(), relay.log()[-3000:]
        code, _ = relay.terminate()
    finally:
        relay.kill()
    assert code == 0, relay.log()[-3000:]
    numbered = [r for r in records if r.headers["ce_type"] == b"test.numbered"]
    v = verdict(numbered, ids)
    assert (v.lost, v.duplicates, v.out_of_order, v.unexpected) == (0, 0, 0, 0), v
    by_id = {r.headers["ce_id"].decode(): r for r in records}
    last = by_id[ids[-1]]
    assert last.headers["ce_source"] == b"urn:async"
    assert last.headers["content-type"] == b"application/json"
    assert json.loads(last.value) == {"key": "k0", "seq": 4_040}
    assert by_id[ids[-2]].headers["x-trace"] == b"t1"
    assert by_id[ids[-2]].headers["ce_specversion"] == b"1.0"
    assert by_id[ids[-2]].headers["ce_time"].endswith(b"Z")
    gone = by_id[str(tomb[0])]
    assert (gone.key, gone.value, "content-type" in gone.headers) == (b"gone", None, False)
    # The slot was confirmed past everything it published.
    after = confirmed_lsn(settings)
    assert before is not None and after is not None and after != before
