"""One trace from the request that published an event, through the relay, to the handler.

Everything runs as a separate process with an OpenTelemetry SDK writing spans to a file
(tests/support/traced.py): a producer publishing inside a "checkout" span, the real
`outbox relay` and `outbox consume` daemons. The spans are then joined by trace id.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, select

from outbox.settings import OutboxSettings
from outbox.tables import build_tables
from outbox.tracing import BATCH_COUNT, MESSAGE_ID
from tests.support.inbox import wait_for
from tests.support.wrapped import Wrapped

pytestmark = pytest.mark.integration
Span = dict[str, Any]


@pytest.fixture
def settings(isolated_settings: OutboxSettings) -> OutboxSettings:
    # A relay publishes every pending row of its tables: give this test tables of its own.
    return isolated_settings


def _spans(path: Path) -> list[Span]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _hex(span_id: str) -> str:
    return span_id.removeprefix("0x")


async def test_one_trace_links_producer_relay_and_consumer_with_retry_and_dead_letter(
    settings: OutboxSettings, new_topic: Callable[..., Awaitable[str]], tmp_path: Path
) -> None:
    topic = await new_topic(1)
    run = Wrapped("tests.support.traced", settings, topic, tmp_path, ".jsonl")
    payloads = [
        {"n": 1},
        {"n": 2, "fail_times": 1},
        {"n": 3, "poison": True},
        {"n": 4, "type": "order.shipped"},  # a sync handler, which publishes a follow-up
    ]
    trace_of: dict[str, str] = json.loads(run.publish(json.dumps(payloads)))
    ok_id, retried_id, poisoned_id, shipped_id = trace_of  # event_id -> producer's trace id

    def follow_up_links() -> list[Span]:
        # The relay's links to messages of the shipped event's trace other than the event.
        return [
            link
            for s in _spans(run.out["relay"])
            for link in s["links"]
            if _hex(link["context"]["trace_id"]) == trace_of[shipped_id]
            and link["attributes"]["messaging.message.id"] != shipped_id
        ]

    def done() -> bool:
        finished = {
            s["attributes"].get("messaging.message.id")
            for s in _spans(run.out["consumer"])
            if s["status"]["status_code"] != "ERROR" or s["attributes"].get("outbox.dead_letter")
        }
        return {ok_id, retried_id, poisoned_id, shipped_id} <= finished and bool(follow_up_links())

    async with run.daemons():
        await wait_for(
            done,
            timeout=90,
            what="the consumer's spans of all four events and the follow-up's send",
        )

    [checkout] = [
        s for s in _spans(run.out["producer"]) if _hex(s["context"]["trace_id"]) == trace_of[ok_id]
    ]
    trace_id = trace_of[ok_id]

    # The relay's send span links to the producer's span (it starts a trace of its own:
    # a batch may carry events of many traces).
    sends = [s for s in _spans(run.out["relay"]) if s["name"] == f"send {topic}"]
    linked = [
        s
        for s in sends
        for link in s["links"]
        if _hex(link["context"]["trace_id"]) == trace_id
        and link["context"]["span_id"] == checkout["context"]["span_id"]
        and link["attributes"]["messaging.message.id"] == ok_id
    ]
    assert linked, sends
    assert linked[0]["kind"] == "SpanKind.PRODUCER"
    assert linked[0]["attributes"]["messaging.system"] == "kafka"
    assert linked[0]["attributes"]["messaging.operation.type"] == "send"

    # The consumer's process span is a child of the producer's span: same trace. (The
    # event ran in one transaction with its failing neighbour first, so it may show that
    # rolled-back run too: its handler did run.)
    spans = _spans(run.out["consumer"])
    ok_runs = [s for s in spans if s["attributes"].get("messaging.message.id") == ok_id]
    assert {s["parent_id"] for s in ok_runs} == {checkout["context"]["span_id"]}
    assert {_hex(s["context"]["trace_id"]) for s in ok_runs} == {trace_id}
    processed = ok_runs[-1]
    assert processed["kind"] == "SpanKind.CONSUMER"
    assert processed["name"] == f"process {topic}"
    attributes = processed["attributes"]
    assert attributes["messaging.system"] == "kafka"
    assert attributes["messaging.operation.type"] == "process"
    assert attributes["messaging.destination.name"] == topic
    assert attributes["messaging.destination.partition.id"] == "0"
    assert attributes["messaging.kafka.message.key"] == "k"
    assert attributes["messaging.kafka.offset"] == 0
    assert attributes["messaging.consumer.group.name"] == run.group
    assert attributes["outbox.attempt"] == 1
    assert processed["status"]["status_code"] == "UNSET"

    # The retry: attempt 1 failed (ERROR, exception recorded), attempt 2 succeeded, both
    # in the producer's trace.
    runs = sorted(
        (s for s in spans if s["attributes"].get("messaging.message.id") == retried_id),
        key=lambda s: s["attributes"]["outbox.attempt"],
    )
    assert [s["attributes"]["outbox.attempt"] for s in runs] == [1, 2]
    assert {_hex(s["context"]["trace_id"]) for s in runs} == {trace_of[retried_id]}
    assert runs[0]["status"]["status_code"] == "ERROR"
    assert runs[0]["attributes"]["error.type"] == "Retryable"
    assert [e["name"] for e in runs[0]["events"]] == ["exception"]
    assert runs[1]["status"]["status_code"] == "UNSET"
    assert [e["name"] for e in runs[1]["events"]] == ["retry"]

    # The dead letter: the failed run, then a span saying where it went and why.
    dead = [s for s in spans if s["attributes"].get("messaging.message.id") == poisoned_id]
    [letter] = [s for s in dead if s["attributes"].get("outbox.dead_letter")]
    assert {_hex(s["context"]["trace_id"]) for s in dead} == {trace_of[poisoned_id]}
    assert letter["status"]["status_code"] == "ERROR"
    assert letter["attributes"]["error.type"] == "Permanent"
    assert letter["attributes"]["outbox.dead_letter.topic"] == topic + ".dlq"
    assert "cannot be handled" in letter["attributes"]["outbox.dead_letter.reason"]
    assert [e["name"] for e in letter["events"]] == ["dead_lettered"]

    # A sync handler's publish continues the trace: the follow-up's context is the shipped
    # event's process span (the handler runs in SQLAlchemy's greenlet, not the task).
    # (If a neighbour's failure rolled back its first run, the last run is the committed one.)
    shipped = [s for s in spans if s["attributes"].get("messaging.message.id") == shipped_id]
    [follow_up] = follow_up_links()
    assert follow_up["context"]["span_id"] == shipped[-1]["context"]["span_id"]


async def test_a_batch_handlers_call_links_every_events_trace_through_the_daemons(
    settings: OutboxSettings, new_topic: Callable[..., Awaitable[str]], tmp_path: Path
) -> None:
    topic = await new_topic(1)
    run = Wrapped("tests.support.traced", settings, topic, tmp_path, ".jsonl")
    payloads = [{"n": n, "type": "order.batched", "poison": n == 7} for n in range(12)]
    trace_of: dict[str, str] = json.loads(run.publish(json.dumps(payloads)))
    ids = list(trace_of)  # in publishing order
    poisoned = ids[7]

    def calls() -> list[Span]:
        return [s for s in _spans(run.out["consumer"]) if BATCH_COUNT in s["attributes"]]

    def linked(span: Span) -> dict[str, str]:
        """{event id: the trace its link points to} of one call's span."""
        return {
            link["attributes"][MESSAGE_ID]: _hex(link["context"]["trace_id"])
            for link in span["links"]
        }

    def done() -> bool:
        applied = {e for s in calls() if s["status"]["status_code"] == "UNSET" for e in linked(s)}
        letters = [
            s for s in _spans(run.out["consumer"]) if s["attributes"].get("outbox.dead_letter")
        ]
        return set(ids) - {poisoned} <= applied and bool(letters)

    async with run.daemons():
        await wait_for(done, timeout=90, what="the batch handler's spans of all twelve events")

    spans = calls()
    committed = [s for s in spans if s["status"]["status_code"] == "UNSET"]
    for span in spans:
        assert span["name"] == f"process {topic}"
        assert span["kind"] == "SpanKind.CONSUMER"
        # Its own trace (a list spans many), linked to each event's producer trace.
        assert _hex(span["context"]["trace_id"]) not in trace_of.values()
        assert span["attributes"][BATCH_COUNT] == len(span["links"])
        assert span["attributes"]["messaging.consumer.group.name"] == run.group
        assert all(trace_of[e] == t for e, t in linked(span).items())
    # Every event but the poison one was applied by exactly one committed call; the poison
    # one by none (it is dead-lettered alone, in its own trace).
    applied = [e for s in committed for e in linked(s)]
    assert sorted(applied) == sorted(set(ids) - {poisoned})
    failed = [s for s in spans if s["status"]["status_code"] == "ERROR"]
    assert failed and all(poisoned in linked(s) for s in failed)
    [letter] = [s for s in _spans(run.out["consumer"]) if s["attributes"].get("outbox.dead_letter")]
    assert letter["attributes"][MESSAGE_ID] == poisoned
    assert _hex(letter["context"]["trace_id"]) == trace_of[poisoned]
    assert letter["attributes"]["error.type"] == "Permanent"


async def test_idempotent_requests_carry_the_key_and_replay_on_their_spans(
    settings: OutboxSettings, engine: Engine, tmp_path: Path
) -> None:
    topic, key = f"refunds-{uuid.uuid4().hex[:8]}", f"key-{uuid.uuid4()}"
    run = Wrapped("tests.support.traced", settings, topic, tmp_path, ".jsonl")
    first, second = json.loads(run.produce("idempotent", key))
    requests = {_hex(s["context"]["trace_id"]): s for s in _spans(run.out["producer"])}
    ran, replayed = requests[first]["attributes"], requests[second]["attributes"]
    assert ran["outbox.idempotency.key"] == replayed["outbox.idempotency.key"] == key
    assert (ran["outbox.idempotency.replayed"], ran["outbox.idempotency.stored"]) == (False, True)
    assert replayed["outbox.idempotency.replayed"] is True
    # The event published inside the first request carries that request's trace.
    events = build_tables(settings).events
    with engine.connect() as conn:
        [headers] = conn.execute(select(events.c.headers).where(events.c.topic == topic)).scalars()
    assert headers["traceparent"].split("-")[1] == first
