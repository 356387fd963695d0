"""`outbox consume` / `outbox dlq` as subprocesses: crashes, SIGKILL, SIGTERM, replay."""

# ruff: noqa: ASYNC221  (short CLI calls; blocking the test loop is harmless here)

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox.ops.kafka_probe import KafkaProbe
from outbox.ops.record_limits import header_room
from outbox.settings import OutboxSettings
from tests.support.inbox import (
    ce_headers,
    committed_offsets,
    effect_counts,
    effects_table,
    outbox_cli,
    produce,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import create_topic, free_port, read_all

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]
TARGET = "tests.support.inbox_apps:app"


def rec(seq: int, **extra: object) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    body = json.dumps({"key": "k", "seq": seq, **extra}).encode()
    return b"k", body, ce_headers(f"ev-{seq}-{uuid.uuid4().hex[:6]}")


async def _wait_exit(proc: subprocess.Popen[bytes], within: float = 60) -> int:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while proc.poll() is None:
        if loop.time() > deadline:
            proc.kill()
            raise AssertionError("consumer did not exit")
        await asyncio.sleep(0.05)
    return proc.returncode


async def _supervise(
    env: dict[str, str], engine: Engine, table: str, *, effects: int, restarts: int
) -> list[int]:
    """Restart the consumer after each crash, like a supervisor, until ``effects`` effects
    are applied; then stop it with SIGTERM. Returns the crashed runs' exit codes (the last
    run must exit 0)."""
    exits = []
    for _ in range(restarts):
        proc = outbox_cli(["consume", TARGET], env)
        try:
            await wait_for(
                lambda proc=proc: (
                    proc.poll() is not None or len(effect_counts(engine, table)) == effects
                ),
                timeout=60,
                what="crash or completion",
            )
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            exits.append(await _wait_exit(proc))
        if len(effect_counts(engine, table)) == effects:
            break
    assert exits[-1] == 0, proc.stderr.read().decode() if proc.stderr else ""
    return exits[:-1]


def _app_env(
    settings: OutboxSettings, topic: str, table: str, group: str, **extra: str
) -> dict[str, str]:
    """The environment of ``tests.support.inbox_apps:app`` for one test."""
    return subprocess_env(
        settings,
        INBOX_TEST_CONSUMER=group,
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
        **extra,
    )


async def _assert_crash_dead_lettered(bootstrap: str, topic: str, seq: int) -> None:
    """The record that killed the process is on the DLQ, after 3 counted attempts."""
    [dead] = await read_all(bootstrap, topic + ".dlq", expect=1)
    assert dead.headers["dlq_error_class"] == b"ProcessCrashed"
    assert dead.headers["dlq_attempts"] == b"3"
    assert json.loads(dead.value)["seq"] == seq


# The crashing record sits in the first run (its marker committed on its own), or in a
# later run whose marker the previous run's commit armed ahead (small batches, and one
# transaction per event).
@pytest.mark.parametrize(
    ("consumer_env", "crash_at"),
    [
        ({}, 2),
        ({"OUTBOX_CONSUMER__MAX_BATCH_RECORDS": "2"}, 3),
        ({"OUTBOX_CONSUMER__TRANSACTION_PER": "event"}, 3),
    ],
    ids=["first-run", "armed-ahead-batch", "armed-ahead-event"],
)
async def test_handler_calling_os_exit_is_dead_lettered_after_n_runs(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
    consumer_env: dict[str, str],
    crash_at: int,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    runs = tmp_path / "runs"
    group = f"c-{uuid.uuid4().hex[:8]}"
    env = _app_env(
        settings,
        topic,
        table,
        group,
        INBOX_TEST_RUNS_FILE=str(runs),
        INBOX_TEST_MAX_ATTEMPTS="3",
        **consumer_env,
    )
    await produce(
        kafka_bootstrap,
        topic,
        [rec(i, crash=True) if i == crash_at else rec(i) for i in (1, 2, 3, 4)],
    )
    exits = await _supervise(env, engine, table, effects=3, restarts=6)
    assert exits == [3, 3, 3]
    assert len(runs.read_text().split()) == 3  # exactly N runs of the crashing handler
    assert set(effect_counts(engine, table).values()) == {1}
    await _assert_crash_dead_lettered(kafka_bootstrap, topic, crash_at)


# Each commit arms the marker ahead for the next records (no marker write per run). A
# partition quiet for disarm_idle_seconds disarms it; one killed before that looks like one
# that died in its next run: the next owner handles the records armed for in careful mode,
# and charges that phantom run to the one that then kills the process (documented in
# ``inbox/marker.py``).
@pytest.mark.parametrize(
    ("disarm_idle", "runs_of_crasher"),
    [("0", 2), ("0.2", 3)],
    ids=["kept-armed", "disarmed-when-quiet"],
)
async def test_sigkill_while_idle_loses_nothing_and_charges_at_most_one_phantom_run(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
    disarm_idle: str,
    runs_of_crasher: int,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    runs = tmp_path / "runs"
    group = f"c-{uuid.uuid4().hex[:8]}"
    env = _app_env(
        settings,
        topic,
        table,
        group,
        INBOX_TEST_RUNS_FILE=str(runs),
        INBOX_TEST_MAX_ATTEMPTS="3",
        OUTBOX_CONSUMER__DISARM_IDLE_SECONDS=disarm_idle,
    )
    await produce(kafka_bootstrap, topic, [rec(i) for i in (1, 2, 3)])
    first = outbox_cli(["consume", TARGET], env)

    async def idle_and_committed() -> bool:
        return (await committed_offsets(kafka_bootstrap, group)).get((topic, 0)) == 3

    await wait_for(idle_and_committed, what="first records applied and committed")
    await asyncio.sleep(1.0)  # idle
    first.send_signal(signal.SIGKILL)
    assert await _wait_exit(first) == -signal.SIGKILL

    await produce(kafka_bootstrap, topic, [rec(4), rec(5, crash=True), rec(6)])
    exits = await _supervise(env, engine, table, effects=5, restarts=5)
    assert exits == [3] * runs_of_crasher
    assert len(runs.read_text().split()) == runs_of_crasher
    assert set(effect_counts(engine, table).values()) == {1}  # 1-4 and 6, once each
    await _assert_crash_dead_lettered(kafka_bootstrap, topic, 5)


async def test_sigkill_between_db_commit_and_offset_commit_applies_once(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    marker = tmp_path / "killed"
    group = f"c-{uuid.uuid4().hex[:8]}"
    env = _app_env(
        settings,
        topic,
        table,
        group,
        INBOX_TEST_RUNS_FILE=str(marker),
        INBOX_TEST_MODE="kill_after_commit",
    )
    await produce(kafka_bootstrap, topic, [rec(i) for i in range(20)])
    first = outbox_cli(["consume", TARGET], env)
    assert await _wait_exit(first) == -signal.SIGKILL
    applied = len(effect_counts(engine, table))
    assert applied >= 1  # the database commit happened
    assert (topic, 0) not in await committed_offsets(kafka_bootstrap, group)  # offsets did not

    second = outbox_cli(["consume", TARGET], env)
    try:

        async def finished() -> bool:
            return (await committed_offsets(kafka_bootstrap, group)).get((topic, 0)) == 20

        await wait_for(finished, what="all applied and committed")
    finally:
        second.send_signal(signal.SIGTERM)
        assert await _wait_exit(second) == 0
    assert set(effect_counts(engine, table).values()) == {1}
    assert (await committed_offsets(kafka_bootstrap, group))[(topic, 0)] == 20
    err = second.stderr.read().decode() if second.stderr else ""
    assert f" {applied} duplicates," in err  # the re-read events were skipped by the inbox


async def test_dlq_cli_lists_shows_and_replays(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    group = f"c-{uuid.uuid4().hex[:8]}"
    env = _app_env(settings, topic, table, group)
    bad = (b"k", b"{not json", ce_headers("bad-1"))
    await produce(kafka_bootstrap, topic, [bad])
    # Nothing is fixed before the replay, so the replayed copy must fail exactly once more.
    consumer = outbox_cli(["consume", TARGET, "--metrics-port", "0"], env)
    try:
        await read_all(kafka_bootstrap, topic + ".dlq", expect=1)
        listing = subprocess.run(
            ["outbox", "dlq", "list", "--consumer", group], env=env, capture_output=True, check=True
        )
        assert b"bad-1" in listing.stdout, listing.stdout.decode()
        assert b"JSONDecodeError" in listing.stdout, listing.stdout.decode()
        shown = subprocess.run(
            ["outbox", "dlq", "show", "bad-1", "--consumer", group],
            env=env,
            capture_output=True,
            check=True,
        )
        assert b"9 bytes" in shown.stdout and b"{not json" not in shown.stdout
        replay = subprocess.run(
            ["outbox", "dlq", "replay", "bad-1", "--consumer", group],
            env=env,
            capture_output=True,
        )
        assert replay.returncode == 0, replay.stderr
        # The replayed copy goes through the handler again and fails again: a second DLQ
        # record, and the dead letter shows one replay.
        await read_all(kafka_bootstrap, topic + ".dlq", expect=2)
        purge = subprocess.run(
            ["outbox", "dlq", "purge", "--all", "--yes", "--consumer", group],
            env=env,
            capture_output=True,
            check=True,
        )
        assert b"purged 1" in purge.stderr
    finally:
        consumer.send_signal(signal.SIGTERM)
        assert await _wait_exit(consumer) == 0
    assert effect_counts(engine, table) == {}


# ---------------------------------------------------------------- large records (issue 28)
# A team's topic takes records up to 3 MB. On one partition: a 2 MB event its handler
# refuses for good (Permanent), a 2 MB record without CloudEvents headers (malformed), then
# 50 small good events. Random payloads, so compression cannot shrink them under a limit.
BIG_SOURCE_LIMIT = "3000000"


def _big_records() -> list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]:
    pad = base64.b64encode(os.urandom(1_500_000)).decode()  # ~2,000,000 bytes of JSON
    event = json.dumps({"key": "k", "seq": 0, "permanent": True, "pad": pad}).encode()
    big_id = f"big-{uuid.uuid4().hex[:6]}"
    return [
        (b"k", event, ce_headers(big_id)),
        (b"raw", os.urandom(2_000_000), []),
        *(rec(i) for i in range(1, 51)),
    ]


async def _run_until_applied(
    env: dict[str, str],
    engine: Engine,
    table: str,
    bootstrap: str,
    group: str,
    topic: str,
    *args: str,
) -> subprocess.Popen[bytes]:
    """Start the consumer; return it once the 50 good events are applied and every offset
    (52) is committed, the partition having moved past both large records."""
    consumer = outbox_cli(["consume", TARGET, *args], env)

    async def through() -> bool:
        if consumer.poll() is not None:
            raise AssertionError(consumer.stderr.read().decode() if consumer.stderr else "")
        done = (await committed_offsets(bootstrap, group)).get((topic, 0)) == 52
        return done and len(effect_counts(engine, table)) == 50

    await wait_for(through, timeout=120, what="good events applied, offsets committed")
    return consumer


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as answer:
        return str(answer.read().decode())


def _stored_dead_letters(
    engine: Engine, settings: OutboxSettings, group: str
) -> dict[str, tuple[bytes, str | None, int | None]]:
    """event_id -> (value, dlq_refused, dlq_offset) from the database's dead letters."""
    table = f'"{settings.db_schema}"."{settings.table_prefix}dead_letters"'
    with engine.connect() as conn:
        rows = conn.execute(
            text(
                f"SELECT event_id, value, dlq_refused, dlq_offset FROM {table} WHERE consumer = :c"
            ),
            {"c": group},
        )
        return {r[0]: (bytes(r[1]), r[2], r[3]) for r in rows}


async def test_large_records_are_dead_lettered_to_a_topic_the_consumer_sizes_like_its_source(
    settings: OutboxSettings, engine: Engine, kafka_bootstrap: str
) -> None:
    topic = await create_topic(
        kafka_bootstrap,
        configs={"max.message.bytes": BIG_SOURCE_LIMIT, "compression.type": "gzip"},
    )
    table = effects_table(engine)
    group = f"c-{uuid.uuid4().hex[:8]}"
    records = _big_records()
    await produce(kafka_bootstrap, topic, records, partition=0, max_request_size=8_000_000)
    consumer = await _run_until_applied(
        _app_env(settings, topic, table, group), engine, table, kafka_bootstrap, group, topic
    )
    try:
        # The consumer created the dead-letter topic with the source's limit (plus room
        # for the dlq_* headers) and compression, so both large records went there whole.
        dlq = topic + ".dlq"
        async with KafkaProbe(settings) as probe:
            limits = await probe.limits([dlq])
        assert limits[dlq].max_message_bytes == int(BIG_SOURCE_LIMIT) + header_room(500)
        assert limits[dlq].compression == "gzip"
        dead = await read_all(kafka_bootstrap, dlq, expect=2)
        assert [d.value for d in dead] == [records[0][1], records[1][1]]
        assert [d.headers["dlq_error_class"] for d in dead] == [b"Permanent", b"MalformedRecord"]
        stored = _stored_dead_letters(engine, settings, group)
        assert sorted(v for v, _, _ in stored.values()) == sorted([records[0][1], records[1][1]])
        assert {refused for _, refused, _ in stored.values()} == {None}
    finally:
        consumer.send_signal(signal.SIGTERM)
        assert await _wait_exit(consumer) == 0
    # Lost 0, applied once each.
    assert sorted(effect_counts(engine, table).values()) == [1] * 50


async def test_a_dead_letter_topic_refusing_large_records_keeps_them_in_the_database(
    settings: OutboxSettings, engine: Engine, kafka_bootstrap: str, tmp_path: Path
) -> None:
    # The dead-letter topic exists already, made by someone else with a 1 MB limit. The
    # large dead letters are kept in the database (a marker on the topic), the partition
    # moves on, and the event is replayed from the database once its handler is fixed.
    topic = await create_topic(kafka_bootstrap, configs={"max.message.bytes": BIG_SOURCE_LIMIT})
    dlq = await create_topic(
        kafka_bootstrap, topic + ".dlq", configs={"max.message.bytes": "1000000"}
    )
    table = effects_table(engine)
    group = f"c-{uuid.uuid4().hex[:8]}"
    fixed = tmp_path / "fixed"
    port = free_port()
    env = _app_env(settings, topic, table, group, INBOX_TEST_FIXED_FILE=str(fixed))
    records = _big_records()
    big_id = records[0][2][0][1].decode()
    await produce(kafka_bootstrap, topic, records, partition=0, max_request_size=8_000_000)
    consumer = await _run_until_applied(
        env, engine, table, kafka_bootstrap, group, topic, "--metrics-port", str(port)
    )
    try:
        stored = _stored_dead_letters(engine, settings, group)
        assert sorted(v for v, _, _ in stored.values()) == sorted([records[0][1], records[1][1]])
        assert {refused for _, refused, _ in stored.values()} == {"MessageSizeTooLargeError"}
        assert all(offset is not None for _, _, offset in stored.values())  # markers sent
        markers = await read_all(kafka_bootstrap, dlq, expect=2)
        assert [m.value for m in markers] == [b"", b""]
        assert {m.headers["dlq_event_id"].decode() for m in markers} == set(stored)
        assert {m.headers["dlq_stored_in"] for m in markers} == {b"database"}
        assert markers[0].headers["dlq_value_bytes"] == str(len(records[0][1])).encode()
        assert "ce_id" not in markers[0].headers  # a marker is not the event
        metrics = await asyncio.to_thread(_scrape, port)
        assert f'outbox_inbox_dead_letters_refused_total{{consumer="{group}"}} 2.0' in metrics, (
            metrics
        )

        listing = subprocess.run(
            ["outbox", "dlq", "list", "--consumer", group], env=env, capture_output=True, check=True
        )
        assert listing.stdout.decode().count(" marker ") == 2, listing.stdout.decode()
        shown = subprocess.run(
            ["outbox", "dlq", "show", big_id, "--consumer", group],
            env=env,
            capture_output=True,
            check=True,
        ).stdout.decode()
        shown = " ".join(shown.split())  # as the terminal wrapped it
        assert "refused the record (MessageSizeTooLargeError)" in shown, shown
        assert f"value: {len(records[0][1])} bytes" in shown, shown

        fixed.touch()  # the handler is fixed: replay the event from the database
        replay = subprocess.run(
            ["outbox", "dlq", "replay", big_id, "--consumer", group], env=env, capture_output=True
        )
        assert replay.returncode == 0, replay.stderr
        await wait_for(
            lambda: big_id in effect_counts(engine, table), what="the replayed event applied"
        )
    finally:
        consumer.send_signal(signal.SIGTERM)
        assert await _wait_exit(consumer) == 0
    err = consumer.stderr.read().decode() if consumer.stderr else ""
    # One line per topic saying what to change, not one per record; no traceback.
    assert err.count(f"dead-letter topic {dlq} refuses a record") == 1, err
    assert "max.message.bytes" in err and "Traceback" not in err, err
    # Lost 0: the 50 good events and the replayed large one, each applied once.
    counts = effect_counts(engine, table)
    assert len(counts) == 51 and set(counts.values()) == {1}


async def test_a_missing_dead_letter_topic_with_creation_off_stops_the_consumer_at_start(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    # A refusal no record size explains is a configuration error: exit 2, one line.
    topic = await new_topic()
    group = f"c-{uuid.uuid4().hex[:8]}"
    env = _app_env(
        settings, topic, effects_table(engine), group, OUTBOX_CONSUMER__DLQ_CREATE="false"
    )
    await produce(kafka_bootstrap, topic, [rec(1)])
    consumer = outbox_cli(["consume", TARGET], env)
    code = await _wait_exit(consumer, within=90)
    err = consumer.stderr.read().decode() if consumer.stderr else ""
    assert code == 2, err
    assert f"Kafka topic '{topic}.dlq' does not exist" in err and "Traceback" not in err, err
    assert await committed_offsets(kafka_bootstrap, group) == {}
