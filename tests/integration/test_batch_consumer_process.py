"""A batch handler in `outbox consume` subprocesses on real Kafka and PostgreSQL: a poison
event among 500 (dead-lettered alone, then replayed), an event that kills the process
inside a list, SIGKILLs mid-batch, redelivered duplicates, and a per-event handler on the
same topic. Each counts lost events, duplicate effects and out-of-order pairs per key."""

# ruff: noqa: ASYNC221  (one short CLI call; blocking the test loop is harmless here)

from __future__ import annotations

import json
import signal
import subprocess
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from sqlalchemy import Engine, text

from outbox.settings import OutboxSettings
from tests.support.inbox import (
    Headers,
    ce_headers,
    effect_counts,
    effect_rows,
    effect_verdict,
    effects_table,
    outbox_cli,
    produce,
    subprocess_env,
    wait_for,
)
from tests.support.kafka import read_all

pytestmark = pytest.mark.integration
NewTopic = Callable[..., Awaitable[str]]
TARGET = "tests.support.batch_apps:app"


def rec(
    key: str, seq: int, event_type: str = "test.event", event_id: str | None = None, **extra: object
) -> tuple[bytes, bytes, Headers]:
    body = json.dumps({"key": key, "seq": seq, **extra}).encode()
    return key.encode(), body, ce_headers(event_id or f"ev-{key}-{seq}", event_type)


def keyed(count: int, keys: int, **kinds: str) -> list[tuple[bytes, bytes, Headers]]:
    """``count`` records over ``keys`` keys, seq rising per key (event ids unique per run)."""
    run = uuid.uuid4().hex[:6]
    return [rec(f"key-{n % keys}", n // keys, event_id=f"{run}-{n}", **kinds) for n in range(count)]


def _env(settings: OutboxSettings, topic: str, table: str, **extra: str) -> dict[str, str]:
    return subprocess_env(
        settings,
        INBOX_TEST_CONSUMER=f"batch-{uuid.uuid4().hex[:8]}",
        INBOX_TEST_TOPIC=topic,
        INBOX_TEST_EFFECTS=table,
        **extra,
    )


def applied(engine: Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(text(f"SELECT count(*) FROM {table}")).scalar_one())


def _stop(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    assert code == 0, proc.stderr.read().decode() if proc.stderr else ""
    return code


def lists(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


async def test_one_poison_among_500_is_dead_lettered_alone_and_499_apply_once(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    run = uuid.uuid4().hex[:6]
    poison = f"{run}-250"
    records = [rec("k", n, event_id=f"{run}-{n}", poison=(n == 250)) for n in range(500)]
    await produce(kafka_bootstrap, topic, records)
    fixed = tmp_path / "fixed"
    env = _env(settings, topic, table, INBOX_TEST_FIXED_FILE=str(fixed))
    proc = outbox_cli(["consume", TARGET], env)
    try:
        await wait_for(lambda: applied(engine, table) >= 499, timeout=120, what="499 effects")
        [dead] = await read_all(kafka_bootstrap, topic + ".dlq", expect=1)
        # Lost: the poison one only; no duplicate effect; the key's order held.
        assert effect_verdict(effect_rows(engine, table), 500) == (1, 0, 0)
        assert poison not in effect_counts(engine, table)
        # The handler is fixed: the dead letter is replayed and reaches the list again.
        fixed.touch()
        replay = subprocess.run(
            ["outbox", "dlq", "replay", poison, "--consumer", env["INBOX_TEST_CONSUMER"]],
            env=env,
            capture_output=True,
        )
        assert replay.returncode == 0, replay.stderr
        await wait_for(lambda: applied(engine, table) >= 500, timeout=60, what="the replay")
    finally:
        _stop(proc)
    assert dead.headers["dlq_error_class"] == b"RuntimeError"
    assert dead.headers["dlq_attempts"] == b"3"
    assert json.loads(dead.value)["seq"] == 250
    counts = effect_counts(engine, table)
    assert len(counts) == 500 and set(counts.values()) == {1}


async def test_failures_on_several_partitions_dead_letter_only_their_events(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    # Lists span partitions in shared transactions: a poison event (found by splitting)
    # and one the handler names (Permanent(event=...)) on other partitions.
    topic = await new_topic(partitions=4)
    table = effects_table(engine)
    run = uuid.uuid4().hex[:6]
    records = [
        rec(f"key-{n % 8}", n // 8, event_id=f"{run}-{n}", poison=(n == 333), bad=(n == 610))
        for n in range(800)
    ]
    await produce(kafka_bootstrap, topic, records)
    proc = outbox_cli(["consume", TARGET], _env(settings, topic, table))
    try:
        await wait_for(lambda: applied(engine, table) >= 798, timeout=120, what="798 effects")
        dead = await read_all(kafka_bootstrap, topic + ".dlq", expect=2)
    finally:
        _stop(proc)
    letters = {
        json.loads(d.value)["seq"] * 8 + int(json.loads(d.value)["key"][4:]): (
            d.headers["dlq_error_class"],
            d.headers["dlq_attempts"],
        )
        for d in dead
    }
    assert letters == {333: (b"RuntimeError", b"3"), 610: (b"Permanent", b"1")}
    assert effect_verdict(effect_rows(engine, table), 800) == (2, 0, 0)


async def test_an_event_killing_the_process_in_a_list_is_dead_lettered_after_its_attempts(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = await new_topic()
    table = effects_table(engine)
    await produce(kafka_bootstrap, topic, [rec("k", n, crash=(n == 100)) for n in range(300)])
    runs = tmp_path / "runs"
    env = _env(settings, topic, table, INBOX_TEST_RUNS_FILE=str(runs))
    exits = []
    for _ in range(6):  # restarted after each crash, as a supervisor would
        proc = outbox_cli(["consume", TARGET], env)
        await wait_for(
            lambda proc=proc: proc.poll() is not None or applied(engine, table) >= 299,
            timeout=120,
            what="a crash or 299 effects",
        )
        if proc.poll() is not None:
            exits.append(proc.returncode)
            continue
        [dead] = await read_all(kafka_bootstrap, topic + ".dlq", expect=1)
        _stop(proc)
        break
    # A list died with it, then it alone (the run's events are handled one by one after a
    # crash), until its 3 attempts were used: the process died 3 times, never again.
    assert exits == [3, 3, 3]
    sizes = [int(n) for n in runs.read_text().split()]
    assert len(sizes) == 3 and sizes[0] > 1 and sizes[1:] == [1, 1]
    assert dead.headers["dlq_error_class"] == b"ProcessCrashed"
    assert dead.headers["dlq_attempts"] == b"3"
    assert effect_verdict(effect_rows(engine, table), 300) == (1, 0, 0)


async def test_killed_mid_batch_loses_nothing_and_doubles_nothing(
    settings: OutboxSettings, engine: Engine, new_topic: NewTopic, kafka_bootstrap: str
) -> None:
    events, keys = 20_000, 100
    topic = await new_topic(partitions=8)
    table = effects_table(engine)
    await produce(kafka_bootstrap, topic, keyed(events, keys))
    # Each call sleeps a little before its INSERT, so the kills land inside calls.
    env = _env(settings, topic, table, INBOX_TEST_CALL_SECONDS="0.02")
    kills = []
    proc = outbox_cli(["--log-level", "WARNING", "consume", TARGET], env)
    try:
        for threshold in (3_000, 9_000):
            await wait_for(
                lambda t=threshold: applied(engine, table) >= t, timeout=180, what=f"{threshold}"
            )
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            kills.append(applied(engine, table))
            proc = outbox_cli(["--log-level", "WARNING", "consume", TARGET], env)
        await wait_for(lambda: applied(engine, table) >= events, timeout=300, what="all effects")
    finally:
        _stop(proc)
    assert len(kills) == 2 and kills[-1] < events
    assert effect_verdict(effect_rows(engine, table), events) == (0, 0, 0)


async def test_redelivered_duplicates_never_reach_the_list(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=2)
    table = effects_table(engine)
    first = keyed(400, 20)
    await produce(kafka_bootstrap, topic, first)
    calls = tmp_path / "lists"
    env = _env(settings, topic, table, INBOX_TEST_LISTS_FILE=str(calls))
    proc = outbox_cli(["consume", TARGET], env)
    try:
        await wait_for(lambda: applied(engine, table) >= 400, timeout=120, what="400 effects")
        # The same events again (as a relay re-publishes after a crash), among new ones.
        second = keyed(200, 20)
        mixed = [r for pair in zip(first[:200], second, strict=True) for r in pair] + first[200:]
        await produce(kafka_bootstrap, topic, mixed)
        await wait_for(lambda: applied(engine, table) >= 600, timeout=120, what="600 effects")
    finally:
        _stop(proc)
    ids = [event_id for call in lists(calls) for event_id in call]
    assert len(ids) == len(set(ids)) == 600  # no id reached a list twice
    assert max(len(call) for call in lists(calls)) > 1  # they did arrive in lists
    assert set(effect_counts(engine, table).values()) == {1}


async def test_a_batch_handler_and_a_per_event_handler_share_a_topic_in_order(
    settings: OutboxSettings,
    engine: Engine,
    new_topic: NewTopic,
    kafka_bootstrap: str,
    tmp_path: Path,
) -> None:
    topic = await new_topic(partitions=2)
    table = effects_table(engine)
    run = uuid.uuid4().hex[:6]
    records = [
        rec(f"key-{n % 10}", n // 10, "test.single" if n % 7 == 3 else "test.event", f"{run}-{n}")
        for n in range(700)
    ]
    await produce(kafka_bootstrap, topic, records)
    calls = tmp_path / "lists"
    env = _env(settings, topic, table, INBOX_TEST_LISTS_FILE=str(calls))
    proc = outbox_cli(["consume", TARGET], env)
    try:
        await wait_for(lambda: applied(engine, table) >= 700, timeout=120, what="700 effects")
    finally:
        _stop(proc)
    assert effect_verdict(effect_rows(engine, table), 700) == (0, 0, 0)
    singles = {f"{run}-{n}" for n in range(700) if n % 7 == 3}
    listed = {event_id for call in lists(calls) for event_id in call}
    assert listed == {f"{run}-{n}" for n in range(700)} - singles
    assert max(len(call) for call in lists(calls)) > 1
