"""The one verdict (relay/verdict.py) both sources carry out on what Kafka did not
acknowledge, and the one database-outage guard (relay/outage.py) every relay loop uses."""

from __future__ import annotations

import asyncio
import logging

import psycopg
import pytest

from outbox.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    ProducerBroken,
    RecordRejected,
    SchemaMissing,
    TopicMissing,
)
from outbox.outages import Dependency
from outbox.resilience.retry import RetryPolicy
from outbox.settings import RetrySettings
from relay.errors import PartitionUnavailable, RecordTooLarge
from relay.outage import OutageGuard
from relay.verdict import MISSING_TOPIC_RECHECK_SECONDS, Verdict, Verdicts


@pytest.fixture
def missing() -> list[tuple[str, float]]:
    return []


@pytest.fixture
def verdicts(missing: list[tuple[str, float]]) -> Verdicts:
    retry = RetrySettings(base_seconds=0.1, cap_seconds=2.0)
    return Verdicts(3, retry, lambda topic, delay: missing.append((topic, delay)))


def test_a_refused_record_counts_an_attempt_and_fails_at_the_limit(verdicts: Verdicts) -> None:
    first = verdicts.of(RecordTooLarge(10, 5), "t", 0)
    assert (first.attempts, first.refused, first.failed, first.kafka_down) == (
        1,
        True,
        False,
        False,
    )
    assert 0 <= first.delay <= 0.2  # full jitter under base * 2**attempts
    assert verdicts.of(RecordRejected("no"), "t", 1).attempts == 2
    last = verdicts.of(RecordRejected("no"), "t", 2)
    assert last == Verdict(3, 0.0, failed=True, refused=True)


def test_a_missing_topic_waits_without_an_attempt_and_is_asked_for_again(
    verdicts: Verdicts, missing: list[tuple[str, float]]
) -> None:
    verdict = verdicts.of(TopicMissing("orders"), "orders", 2)
    assert verdict == Verdict(2, MISSING_TOPIC_RECHECK_SECONDS)
    assert missing == [("orders", MISSING_TOPIC_RECHECK_SECONDS)]


def test_an_unavailable_partition_waits_its_delay_without_an_attempt(verdicts: Verdicts) -> None:
    verdict = verdicts.of(PartitionUnavailable(("orders", 3), 0.3, 1), "orders", 1)
    assert verdict == Verdict(1, 0.3)


def test_kafka_s_trouble_is_not_the_event_s(verdicts: Verdicts) -> None:
    assert verdicts.of(BrokerUnavailable("down"), "t", 1) == Verdict(1, 0.0, kafka_down=True)
    # A broken producer is replaced by the publisher: its events go again at once.
    assert verdicts.of(ProducerBroken("fenced"), "t", 1) == Verdict(1, 0.0)


def _guard() -> tuple[OutageGuard, Dependency, list[str]]:
    database = Dependency("database", logging.getLogger("t.guard"))
    counted: list[str] = []
    guard = OutageGuard(
        database, RetryPolicy(0.01, 0.01), lambda exc: counted.append(type(exc).__name__)
    )
    return guard, database, counted


async def test_an_outage_closes_the_connection_sleeps_and_is_reported_once() -> None:
    guard, database, counted = _guard()
    closed: list[int] = []

    async def close() -> None:
        closed.append(1)

    stopping = asyncio.Event()
    for _ in range(2):
        await guard.survive(DatabaseUnavailable("gone"), stopping, close)
    assert (closed, counted, guard.failures, database.up) == (
        [1, 1],
        ["DatabaseUnavailable"] * 2,
        2,
        False,
    )
    guard.ok()
    assert guard.failures == 0 and database.up


async def test_a_missing_table_and_a_permanent_error_stop_the_relay() -> None:
    guard, database, _ = _guard()

    async def close() -> None:
        raise AssertionError("not an outage: nothing to close")

    with pytest.raises(SchemaMissing, match="relay table missing"):
        await guard.survive(psycopg.errors.UndefinedTable("no"), asyncio.Event(), close)
    with pytest.raises(Exception) as info:
        await guard.survive(psycopg.errors.DataError("bad"), asyncio.Event(), close)
    assert not isinstance(info.value, psycopg.Error)  # the framework's error, not the driver's
    assert database.up
