"""A failing database is never the event's fault (issue #36): ``outbox relay`` and ``outbox
consume`` (subprocesses) under a steady stream while their PostgreSQL fills its disk, or is
switched read-only, then recovers as an operator would make it.

The database is a private cluster on a small tmpfs this test mounts (tests/support/
private_pg.py): filling its disk or switching it read-only must not touch the shared
server. Two producers keep the stream going: one publishes through the outbox (40 keys,
4 KiB payloads, a transaction every 50 ms, each failed transaction retried as it was, with
the same event ids), and, during the fault, one writes straight to Kafka (another service's
records), so that the consumer is sure to meet the fault with records in hand rather than
idle. Every handler stores its payload.

Asserted: lost 0, duplicate effects 0, out-of-order pairs per key 0, dead letters 0, no
attempt counted (every inbox row says attempts 1, no "handler failed" line), both daemons
still running; and that the consumer did meet the fault (its SQLSTATE is in its log), and
that whatever the outbox producer got was a database outage by the SQLSTATE table.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sqlalchemy import Engine, func, select, text

from outbox import migrate
from outbox.db import sync_engine
from outbox.dberrors import OUTAGE, trouble
from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from tests.acceptance.conftest import ROOT, Cli, Daemons, relay_and_consumer
from tests.support.inbox import ce_headers, effect_rows, effect_verdict, produce, until
from tests.support.private_pg import PrivatePostgres
from tests.support.steady import SteadyProducer, effects

pytestmark = pytest.mark.acceptance

KEYS = 40


def _pad() -> str:
    """4 KiB that PostgreSQL cannot compress: each stored payload takes its room on disk."""
    return base64.b64encode(os.urandom(3072)).decode()


def _direct(
    topic: str, start: int, count: int
) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    """Another service's records, straight to Kafka (4 keys of their own)."""
    out = []
    for n in range(start, start + count):
        key = f"direct-{n % 4}"
        body = {"key": key, "seq": n // 4, "pad": _pad()}
        out.append((key.encode(), json.dumps(body).encode(), ce_headers(str(uuid.uuid4()))))
    return out


@dataclass
class Stream:
    pg: PrivatePostgres
    settings: OutboxSettings
    engine: Engine
    topic: str
    group: str
    effects: str
    daemons: Daemons
    producer: SteadyProducer
    direct: int = 0

    def applied(self) -> int:
        with self.engine.connect() as conn:
            return int(conn.execute(text(f"SELECT count(*) FROM {self.effects}")).scalar_one())

    async def wait_applied(self, count: int, within: float) -> int:
        deadline = time.monotonic() + within
        seen = await asyncio.to_thread(self._applied_or_zero)
        while seen < count and time.monotonic() < deadline:
            await asyncio.sleep(0.25)
            seen = await asyncio.to_thread(self._applied_or_zero)
        return seen

    def _applied_or_zero(self) -> int:
        try:
            return self.applied()
        except Exception:
            return 0  # the database is down or refusing: not applied yet, as far as we know

    async def produce_direct(self, count: int) -> None:
        await produce(
            self.settings.kafka_bootstrap_servers,
            self.topic,
            _direct(self.topic, self.direct, count),
        )
        self.direct += count

    def log(self, name: str) -> str:
        return self.daemons.logs[name].read_text(errors="replace")

    def dump(self) -> str:
        return f"{self.daemons.dump()}\n--- postgres\n{self.pg.log_tail()}"

    def alive(self) -> bool:
        return self.daemons.alive()


@pytest.fixture
def stream(pg: PrivatePostgres, kafka_bootstrap: str, tmp_path: Path) -> Iterator[Stream]:
    settings = OutboxSettings(
        database_url=pg.url(),  # type: ignore[arg-type]
        kafka_bootstrap_servers=kafka_bootstrap,
        db_schema=f"acc_{uuid.uuid4().hex[:10]}",
    )
    migrate.upgrade(settings)
    engine = sync_engine(settings, pool_size=2)
    made = effects(engine, tmp_path, "dbfault", pad=True)
    topic, group, module = made.topic, made.group, made.module
    cli = Cli(settings, made.cli_env(tmp_path, ROOT))
    producer = SteadyProducer(settings, topic, pad=_pad)
    try:
        with relay_and_consumer(cli, f"{module}:app", topic, 4, tmp_path) as daemons:
            yield Stream(pg, settings, engine, topic, group, made.table, daemons, producer)
    finally:
        producer.stop.set()
        engine.dispose()


def _verdict(s: Stream, published: int) -> None:
    """The common assertions once the stream is drained."""
    expected = published + s.direct
    rows = effect_rows(s.engine, s.effects)
    lost, duplicates, out_of_order = effect_verdict(rows, expected)
    tables = build_tables(s.settings)
    with s.engine.connect() as conn:
        dead = conn.execute(select(func.count()).select_from(tables.dead_letters)).scalar_one()
        attempts = dict(
            conn.execute(
                select(tables.inbox.c.attempts, func.count())
                .where(tables.inbox.c.consumer == s.group)
                .group_by(tables.inbox.c.attempts)
            ).all()
        )
    consumer_log = s.log("consumer")
    figures = (
        f"expected {expected} (outbox {published}, direct {s.direct}); lost {lost}, "
        f"duplicates {duplicates}, out of order {out_of_order}, dead letters {dead}, "
        f"inbox rows by attempts {attempts}, producer errors {len(s.producer.errors)}, "
        f"consumer outage lines {consumer_log.count('database unavailable; retrying')}"
    )
    print(figures)  # the figures for the record (pytest -s)
    assert (lost, duplicates, out_of_order) == (0, 0, 0), figures + s.dump()
    assert dead == 0, figures + s.dump()
    assert attempts == {1: expected}, figures + s.dump()
    assert "handler failed" not in consumer_log and "ProcessCrashed" not in consumer_log
    # The outage is logged per state change, not per failed try.
    down_lines = consumer_log.count("database unavailable; retrying")
    assert 1 <= down_lines <= 6, figures + s.dump()
    assert s.alive(), s.dump()
    # The producer's errors were outages (the SQLSTATE table), never anything else.
    odd = [e for e in s.producer.errors if trouble(e) is not OUTAGE]
    assert not odd, [f"{type(e).__name__}: {e}"[:300] for e in odd]


async def test_a_full_disk_dead_letters_nothing_and_counts_no_attempt(stream: Stream) -> None:
    s = stream
    s.producer.start()
    assert await s.wait_applied(200, 30) >= 200, s.dump()  # a steady stream is flowing
    s.pg.fill(leave=64 * 1024)
    filled_at = time.monotonic()
    # Another service's records arrive while the disk is full: the consumer meets 53100 in
    # its handlers' INSERTs (and its own statements) with records in hand.
    await s.produce_direct(100)
    met = await until(lambda: "53100" in s.log("consumer"), 20)
    assert met, "the consumer never met the full disk\n" + s.dump()
    await asyncio.sleep(max(0.0, 3 - (time.monotonic() - filled_at)))  # full for 3 s at least
    assert s.alive(), s.dump()
    # Then PostgreSQL gives up, as it does when a WAL write finds no room (a PANIC: every
    # connection drops mid-transaction): made certain here by stopping it the same way.
    # The runs it interrupts must not be taken for crashes once it is back.
    s.pg.stop("immediate")
    await asyncio.sleep(1.5)
    assert s.alive(), s.dump()
    # The operator frees space, and starts PostgreSQL again if it stopped.
    s.pg.free()
    if not s.pg.running():
        s.pg.start()
    assert await until(s.pg.accepts_writes, 20), s.dump()
    await s.produce_direct(20)
    await asyncio.sleep(2)  # the stream goes on after the recovery
    published = s.producer.finish()
    applied = await s.wait_applied(published + s.direct, 40)
    assert applied >= published + s.direct, f"applied {applied}\n" + s.dump()
    await asyncio.sleep(1)  # anything still arriving would be a duplicate
    _verdict(s, published)
    assert any(trouble(e) is OUTAGE for e in s.producer.errors) or "53100" in s.log("relay")


async def test_a_read_only_switch_dead_letters_nothing_and_applies_everything_once(
    stream: Stream,
) -> None:
    s = stream
    s.producer.start()
    assert await s.wait_applied(200, 30) >= 200, s.dump()
    s.pg.sql("ALTER SYSTEM SET default_transaction_read_only = on")
    s.pg.sql("SELECT pg_reload_conf()")
    switched_at = time.monotonic()
    await s.produce_direct(100)
    met = await until(lambda: "25006" in s.log("consumer"), 20)
    assert met, "the consumer never met the read-only switch\n" + s.dump()
    await asyncio.sleep(max(0.0, 3 - (time.monotonic() - switched_at)))
    assert s.alive(), s.dump()
    s.pg.sql("ALTER SYSTEM SET default_transaction_read_only = off")
    s.pg.sql("SELECT pg_reload_conf()")
    assert await until(s.pg.accepts_writes, 20), s.dump()
    await s.produce_direct(20)
    await asyncio.sleep(2)
    published = s.producer.finish()
    applied = await s.wait_applied(published + s.direct, 40)
    assert applied >= published + s.direct, f"applied {applied}\n" + s.dump()
    await asyncio.sleep(1)
    _verdict(s, published)
    assert "25006" in s.log("relay"), s.dump()
