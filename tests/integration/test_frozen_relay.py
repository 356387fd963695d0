"""A frozen relay (SIGSTOP: a long pause, a stuck VM) is taken over from: the others end its
idle sessions once it has been silent for ``relay.takeover_seconds`` (relay/takeover.py) and
take the WAL slot or its lanes; when it wakes it publishes nothing more (relay/fence.py).
Both sources, as subprocesses on real PostgreSQL and Kafka, under a steady stream."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine

from outbox.settings import OutboxSettings
from tests.support.kafka import Record, create_topic
from tests.support.relay import RelayProcess, publish_numbered, read_ids, relay_env, verdict
from tests.support.wal import wait_until, wal_relay_env

pytestmark = pytest.mark.integration

# The default takeover_seconds (10): events must flow again within 15 s of the freeze.
FLOWS_AGAIN_WITHIN = 15.0


class _Stream:
    """10 events every 0.1 s over 40 keys, each chunk's commit time noted."""

    def __init__(self, engine: Engine, settings: OutboxSettings, topic: str) -> None:
        self.ids: list[str] = []
        self.committed: dict[str, float] = {}
        self._args = (engine, settings, topic)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            ids = publish_numbered(*self._args, 10, keys=40, per_tx=10, start=n)
            now = time.time()
            self.ids.extend(ids)
            self.committed.update(dict.fromkeys(ids, now))
            n += 10
            time.sleep(0.1)

    def __enter__(self) -> _Stream:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _first_appends(records: list[Record]) -> tuple[dict[str, float], list[float]]:
    """Each event's first append (broker clock, s), and the append times of later copies."""
    first: dict[str, float] = {}
    copies: list[float] = []
    for rec in records:
        ce_id = rec.headers["ce_id"].decode()
        at = rec.timestamp / 1000
        if ce_id in first:
            copies.append(at)
        else:
            first[ce_id] = at
    return first, copies


async def _freeze(
    engine: Engine,
    settings: OutboxSettings,
    env: dict[str, str],
    tmp_path: Path,
    ready: str,
    frozen_one: Callable[[list[RelayProcess]], RelayProcess | None],
    freeze_seconds: float,
) -> None:
    bootstrap = settings.kafka_bootstrap_servers
    # LogAppendTime: the broker says when each copy was appended (same clock as this test).
    topic = await create_topic(
        bootstrap, partitions=6, configs={"message.timestamp.type": "LogAppendTime"}
    )
    relays = [RelayProcess(env, tmp_path, "a")]
    try:
        assert await asyncio.to_thread(wait_until, lambda: ready in relays[0].log(), 30)
        relays.append(RelayProcess(env, tmp_path, "b"))
        with _Stream(engine, settings, topic) as stream:
            await asyncio.sleep(4)  # both relays settled, events flowing
            victim = frozen_one(relays)
            assert victim is not None
            other = next(r for r in relays if r is not victim)
            frozen_at = time.time()
            os.kill(victim.pid, signal.SIGSTOP)
            try:
                took_over = await asyncio.to_thread(
                    wait_until, lambda: "has been silent for" in other.log(), 30
                )
                taken_at = time.time()
                await asyncio.sleep(max(0.0, frozen_at + freeze_seconds - time.time()))
            finally:
                os.kill(victim.pid, signal.SIGCONT)
            woken_at = time.time()
            await asyncio.sleep(5)
        records = await read_ids(bootstrap, topic, stream.ids, 60)
        codes = [r.terminate()[0] for r in relays]
    finally:
        for r in relays:
            r.kill()
    v = verdict(records, stream.ids)
    first, copies = _first_appends(records)
    # How late each event was past the moment it could have been published: its commit, or
    # for one committed during the freeze, FLOWS_AGAIN_WITHIN after the freeze.
    late = max(
        first[i] - max(c, frozen_at + FLOWS_AGAIN_WITHIN)
        for i, c in stream.committed.items()
        if i in first
    )
    after_wake = [at for at in copies if at > woken_at + 0.5]
    print(
        f"frozen {freeze_seconds:.0f} s: taken over after {taken_at - frozen_at:.1f} s, "
        f"{len(stream.ids)} events, {v.duplicates} duplicates ({len(after_wake)} after the "
        f"wake), worst lateness past commit or freeze+{FLOWS_AGAIN_WITHIN:.0f} s: {late:.2f} s"
    )
    assert (v.lost, v.out_of_order, v.unexpected) == (0, 0, 0), v
    assert took_over and taken_at - frozen_at < FLOWS_AGAIN_WITHIN, other.log()[-3000:]
    assert late < 1.0, (late, other.log()[-3000:])
    # The woken relay published nothing again: no copy appended after it woke.
    assert after_wake == [], (after_wake, victim.log()[-3000:])
    assert codes == [0, 0], [r.log()[-2000:] for r in relays]
    assert "this relay was frozen for" in victim.log()  # it says so when it wakes
    assert "Traceback" not in victim.log()


async def test_a_frozen_wal_reader_is_replaced_within_15_s_and_publishes_nothing_on_waking(
    engine: Engine, wal_settings: OutboxSettings, tmp_path: Path
) -> None:
    def reader(relays: list[RelayProcess]) -> RelayProcess | None:
        return next((r for r in relays if "reading the slot" in r.log()), None)

    env = wal_relay_env(wal_settings)
    await _freeze(engine, wal_settings, env, tmp_path, "reading the slot", reader, 30)


async def test_a_frozen_table_relay_gives_up_its_lanes_within_15_s(
    engine: Engine, settings: OutboxSettings, tmp_path: Path
) -> None:
    await _freeze(
        engine, settings, relay_env(settings), tmp_path, "acquired lanes", lambda rs: rs[0], 20
    )
