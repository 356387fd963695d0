"""Pure parts of issue 14: the cause of a database error, Kafka refusals, the up/down state
of a dependency and the third-party log limit, topic specs."""

from __future__ import annotations

import logging
import socket

import psycopg
import pytest
from aiokafka import errors as kerr

from outbox.db import describe, unavailable
from outbox.errors import ConfigurationError, DatabaseRefused, DatabaseUnavailable
from outbox.kafka.clients import security_refusal
from outbox.kafka.errors import kafka_refusal
from outbox.ops.topics import TopicSpec, _merge, parse_spec
from outbox.outages import Dependency, limit_third_party_logs
from outbox.settings import OutboxSettings

_SERVER = 'connection failed: connection to server at "10.0.0.5", port 5432 failed: '


@pytest.mark.parametrize(
    ("message", "kind", "sqlstate", "says"),
    [
        (_SERVER + 'FATAL:  password authentication failed for user "app"', DatabaseRefused,
         "28P01", 'password authentication failed for user "app"'),
        (_SERVER + 'FATAL:  database "shop" does not exist', DatabaseRefused, "3D000",
         'database "shop" does not exist'),
        (_SERVER + "FATAL:  no pg_hba.conf entry for host", DatabaseRefused, "28000", "pg_hba"),
        (_SERVER + "Connection refused\n\tIs the server running on that host?",
         DatabaseUnavailable, None, "connection refused"),
        ("failed to resolve host 'db.invalid': [Errno -2] Name or service not known",
         DatabaseRefused, None, "unknown host"),
        (_SERVER + "FATAL:  the database system is starting up", DatabaseUnavailable, "57P03",
         "starting"),
    ],
)  # fmt: skip
def test_connection_failures_keep_their_cause(
    message: str, kind: type[Exception], sqlstate: str | None, says: str
) -> None:
    error = unavailable(psycopg.OperationalError(message))
    assert type(error) is kind and error.sqlstate == sqlstate
    assert says in str(error)
    assert "10.0.0.5" in str(error) or "db.invalid" in str(error)  # where, for the operator
    assert error.retriable is (kind is DatabaseUnavailable)


def test_no_dsn_or_password_survives_in_a_message() -> None:
    message = "could not connect to postgresql://app:hunter2@db:5432/shop password=hunter2"
    _, text, _ = describe(psycopg.OperationalError(message))
    assert "hunter2" not in text


def test_kafka_refusals_are_configuration_errors_even_when_wrapped() -> None:
    try:
        try:
            raise kerr.SaslAuthenticationFailed("bad credentials")
        except kerr.KafkaError as inner:
            raise kerr.KafkaConnectionError("connect failed") from inner
    except kerr.KafkaError as outer:
        refused = kafka_refusal(outer)
    assert isinstance(refused, ConfigurationError) and "SaslAuthenticationFailed" in str(refused)
    assert kafka_refusal(kerr.KafkaConnectionError("down")) is None


async def test_a_broker_that_never_answers_is_not_a_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A hung broker (GC pause, stuck disk) accepts the connection and answers nothing: that
    # is retried, not a "wrong protocol" configuration error (exit 2) — the relay's leader
    # watch stopped on it while the broker hung. A protocol mismatch gets the connection
    # closed at once (tests/security/test_kafka_sasl_ssl.py).
    monkeypatch.setattr("outbox.kafka.clients._PROBE_SECONDS", 0.3)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        host, port = silent.getsockname()
        settings = OutboxSettings(kafka_bootstrap_servers=f"{host}:{port}")
        assert await security_refusal(settings) is None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_dependency_logs_down_up_and_one_reminder_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock, changes = Clock(), []
    dep = Dependency("database", logging.getLogger("t.dep"), on_change=changes.append, clock=clock)
    with caplog.at_level(logging.INFO, logger="t.dep"):
        for _ in range(100):  # 100 failed tries over 99 s
            dep.failed(DatabaseUnavailable("refused"))
            clock.now += 1
        dep.ok()
        dep.ok()
    messages = [r.getMessage() for r in caplog.records if r.name == "t.dep"]
    assert messages == [
        "database unavailable; retrying with backoff",
        "database still unavailable",
        "database reachable again",
    ]
    assert changes == [False, True] and (dep.tries, dep.failures, dep.outages) == (100, 0, 1)


def test_third_party_records_are_limited_to_one_a_minute() -> None:
    root = logging.getLogger()
    seen: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.name)

    sink, clock = Sink(), Clock()
    old_level, old_handlers = root.level, root.handlers[:]
    root.handlers[:] = [sink]
    root.setLevel(logging.INFO)
    try:
        limit_third_party_logs(clock=clock)
        for second in range(120):
            clock.now = second
            logging.getLogger("aiokafka.conn").error("Unable connect")
            logging.getLogger("aiokafka").warning("metadata")
        logging.getLogger("relay").warning("ours")
    finally:
        root.handlers[:] = old_handlers
        root.setLevel(old_level)
    assert seen.count("relay") == 1
    assert len([n for n in seen if n.startswith("aiokafka")]) == 2  # at 0 s and 60 s


def test_topic_specs() -> None:
    assert parse_spec("orders:12") == TopicSpec("orders", 12)
    assert parse_spec(" orders ") == TopicSpec("orders")
    assert parse_spec("customers:compact") == TopicSpec("customers", compact=True)
    assert parse_spec("customers:6:compact") == TopicSpec("customers", 6, compact=True)
    bad_specs = ("orders:0", "orders:x", "bad topic", "c:compact:6", "c:6:6", "c:compact:compact")
    for bad in bad_specs:
        with pytest.raises(ConfigurationError, match=r"NAME|not a valid Kafka name"):
            parse_spec(bad)
    merged = _merge([TopicSpec("a.dlq", dead_letter_of="a"), TopicSpec("a"), TopicSpec("a", 4)])
    assert merged == [TopicSpec("a", 4), TopicSpec("a.dlq", dead_letter_of="a")]
    # Compaction asked anywhere sticks; a dead-letter topic never inherits it.
    merged = _merge(
        [TopicSpec("c", 3), TopicSpec("c", compact=True), TopicSpec("c.dlq", None, "c")]
    )
    assert merged == [TopicSpec("c", 3, compact=True), TopicSpec("c.dlq", dead_letter_of="c")]


def test_server_errors_on_a_live_connection_stay_retriable() -> None:
    class LockTimeout(psycopg.errors.LockNotAvailable):
        sqlstate = "55P03"

    error = unavailable(LockTimeout("canceling statement due to lock timeout"))
    assert isinstance(error, DatabaseUnavailable) and error.sqlstate == "55P03"
