"""Producer -> relay -> consumer, with the relay and the consumer each SIGKILLed twice.

20,000 events over 100 keys; the handler records (key, seq). Afterwards: 0 lost effects,
0 duplicate effects, 0 out-of-order pairs per key.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import uuid
from collections.abc import Awaitable, Callable

import pytest
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session

from outbox import Message, Outbox, migrate
from outbox.db import sync_engine
from outbox.settings import OutboxSettings
from tests.support.inbox import effect_rows, effects_table, outbox_cli, subprocess_env, wait_for

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]
EVENTS, KEYS, CHUNK = 20_000, 100, 200


def _publisher(settings: OutboxSettings, topic: str, done: threading.Event) -> None:
    engine = sync_engine(settings)
    outbox = Outbox(settings)
    try:
        for start in range(0, EVENTS, CHUNK):
            with Session(engine) as session, session.begin():
                outbox.publish_many(
                    session,
                    [
                        Message(
                            topic=topic,
                            key=f"key-{n % KEYS}",
                            event_type="test.event",
                            payload={"key": f"key-{n % KEYS}", "seq": n // KEYS},
                        )
                        for n in range(start, start + CHUNK)
                    ],
                )
            done.wait(0.05)  # ~4,000 events/s, so the kills land mid-stream
    finally:
        engine.dispose()
        done.set()


async def test_relay_and_consumer_killed_twice_lose_nothing_double_nothing(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic
) -> None:
    s = settings.model_copy(update={"db_schema": f"e2e_{uuid.uuid4().hex[:8]}"})
    migrate.upgrade(s)
    topic = await new_topic(partitions=8)
    table = effects_table(engine)  # in public: the handler names it unqualified
    group = f"e2e-{uuid.uuid4().hex[:8]}"
    env = subprocess_env(
        s,
        OUTBOX_DB_SCHEMA=s.db_schema,
        INBOX_TEST_CONSUMER=group,
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=f"public.{table}",
    )
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(kind: str) -> None:
        args = ["relay"] if kind == "relay" else ["consume", "tests.support.inbox_apps:app"]
        procs[kind] = outbox_cli(["--log-level", "WARNING", *args], env)

    def applied() -> int:
        with engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())

    finished = threading.Event()
    publisher = threading.Thread(target=_publisher, args=(s, topic, finished), daemon=True)
    start("relay")
    start("consumer")
    publisher.start()
    kills = []
    try:
        for threshold, kind in (
            (2_000, "relay"),
            (5_000, "consumer"),
            (9_000, "relay"),
            (13_000, "consumer"),
        ):
            await wait_for(lambda t=threshold: applied() >= t, timeout=180, what=f"{threshold}")
            procs[kind].send_signal(signal.SIGKILL)
            procs[kind].wait(10)
            kills.append((kind, applied()))
            start(kind)
        await wait_for(lambda: applied() >= EVENTS, timeout=300, what="all effects")
        await asyncio.sleep(2)  # room for a late duplicate to show up
    finally:
        finished.set()
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        exit_codes = {k: p.wait(60) for k, p in procs.items()}
    assert len(kills) == 4
    assert exit_codes == {"relay": 0, "consumer": 0}
    rows = effect_rows(engine, table)
    seen: dict[tuple[str, int], int] = {}
    for _, key, seq in rows:
        assert key is not None and seq is not None
        seen[(key, seq)] = seen.get((key, seq), 0) + 1
    lost = EVENTS - len(seen)
    duplicates = sum(c - 1 for c in seen.values())
    last: dict[str, int] = {}
    out_of_order = 0
    for _, key, seq in rows:  # rows in commit (insert id) order
        assert key is not None and seq is not None
        if seq < last.get(key, -1):
            out_of_order += 1
        last[key] = max(seq, last.get(key, -1))
    assert (lost, duplicates, out_of_order) == (0, 0, 0)
