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

from outbox import migrate
from outbox.settings import OutboxSettings
from tests.support.inbox import (
    effect_rows,
    effect_verdict,
    effects_table,
    outbox_cli,
    publish_keyed,
    subprocess_env,
    wait_for,
)

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]
EVENTS, KEYS, CHUNK = 20_000, 100, 200


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
    # ~4,000 events/s, so the kills land mid-stream
    publisher = threading.Thread(
        target=publish_keyed,
        args=(s, topic, EVENTS),
        kwargs={"keys": KEYS, "chunk": CHUNK, "stop": finished},
        daemon=True,
    )
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
    assert effect_verdict(effect_rows(engine, table), EVENTS) == (0, 0, 0)
