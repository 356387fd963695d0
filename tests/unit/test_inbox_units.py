"""Pure parts of the inbox: record decoding, failure classification, handler registry."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import TYPE_CHECKING

import psycopg.errors
import pytest
from aiokafka import errors as kerr
from pydantic import BaseModel, ValidationError
from sqlalchemy.exc import IntegrityError, OperationalError

import inbox
from inbox.envelopes.cloudevents import decode
from inbox.event import InboxEvent
from inbox.failures import classify, crashed
from outbox.errors import InvalidIdentifier
from outbox.kafka.metadata_watch import MetadataWatch
from tests.support.records import Rec

if TYPE_CHECKING:
    from inbox.offsets import OffsetCommitter
    from inbox.processor import PartitionProcessor
    from inbox.runner import ConsumerDaemon


class Thing(BaseModel):
    n: int


def test_decode_reads_cloudevents_headers() -> None:
    e = decode(Rec(headers=(("ce_id", b"abc"), ("ce_type", b"x.y"), ("ce_source", b"s"))))
    assert (e.event_id, e.event_type, e.source, e.malformed) == ("abc", "x.y", "s", None)
    assert e.timestamp_ms == 1_700_000_000_000


@pytest.mark.parametrize(
    "headers",
    [(), (("ce_type", b"x"),), (("ce_id", b"\xff\xfe"), ("ce_type", b"x")), (("ce_id", b"a"),)],
)
def test_records_without_usable_id_or_type_are_malformed_with_a_position_id(
    headers: tuple[tuple[str, bytes], ...],
) -> None:
    e = decode(Rec(headers=headers))
    assert e.malformed is not None
    assert e.event_id == "t:2:7"


def test_decode_sets_every_field_and_keeps_the_header_pairs() -> None:
    headers = (("ce_id", b"abc"), ("ce_type", b"x.y"), ("k", b"v"))
    e = decode(Rec(headers=headers))
    # decode fills the frozen dataclass's fields at once: none may be left to a default.
    assert set(vars(e)) == {f.name for f in dataclasses.fields(InboxEvent)}
    assert e == InboxEvent("abc", "x.y", "t", 2, 7, b"k", b"{}", headers, None, 1_700_000_000_000)
    assert e.headers == headers and isinstance(e.headers, tuple)


def test_decode_makes_odd_header_values_bytes_and_the_last_id_wins() -> None:
    raw = [["ce_id", b"first"], ("ce_type", bytearray(b"x")), ("n", None), ("ce_id", b"last")]
    e = decode(Rec(headers=raw))  # type: ignore[arg-type]
    assert (e.event_id, e.event_type, e.malformed) == ("last", "x", None)
    assert e.headers == (("ce_id", b"first"), ("ce_type", b"x"), ("n", b""), ("ce_id", b"last"))
    # An empty (or null) last ce_id makes the record malformed, like a missing one.
    assert decode(Rec(headers=(("ce_id", b"a"), ("ce_id", None), ("ce_type", b"x")))).malformed  # type: ignore[arg-type]


def test_fetch_linger_holds_fetches_only_while_records_flow() -> None:
    from inbox.linger import LINGER_MIN_BYTES, FetchLinger

    # A consumer's fetch settings as the client interface reads and changes them
    # (aiokafka's are tested in test_aiokafka_internals.py and the canary).
    class _Consumer:
        def __init__(self, wait: tuple[int, int] | None) -> None:
            self.wait = wait

        def fetch_wait(self) -> tuple[int, int] | None:
            return self.wait

        def set_fetch_wait(self, min_bytes: int, max_wait_ms: int) -> bool:
            if self.wait is None:
                return False
            self.wait = (min_bytes, max_wait_ms)
            return True

    consumer, off, renamed = _Consumer((1, 500)), _Consumer((1, 500)), _Consumer(None)
    linger = FetchLinger(consumer, 5)  # type: ignore[arg-type]
    linger.fetched(False)
    assert consumer.wait == (1, 500)
    linger.fetched(True)
    assert consumer.wait == (LINGER_MIN_BYTES, 5)
    linger.fetched(True)
    linger.fetched(False)  # a quiet spell: the next record is fetched at once
    assert consumer.wait == (1, 500)
    # Off: never touches the consumer; a client without these settings turns it off.
    FetchLinger(off, 0).fetched(True)  # type: ignore[arg-type]
    assert off.wait == (1, 500)
    lost = FetchLinger(renamed, 5)  # type: ignore[arg-type]
    lost.fetched(True)
    assert lost.linger_ms == 0 and renamed.wait is None


def test_validation_errors_are_permanent_and_never_echo_input() -> None:
    with pytest.raises(ValidationError) as info:
        Thing.model_validate_json(b'{"n": "secret-value"}')
    f = classify(info.value, 500)
    assert not f.retryable and "secret-value" not in f.message and "n:" in f.message


def test_database_conflicts_are_retryable_integrity_errors_follow_the_default() -> None:
    for orig in (psycopg.errors.SerializationFailure(), psycopg.errors.DeadlockDetected()):
        assert classify(OperationalError("s", {}, orig), 100).retryable
    assert classify(inbox.Retryable("x"), 100).retryable
    assert not classify(inbox.Permanent("x"), 100).retryable
    assert not classify(ValueError("x"), 100).retryable
    assert classify(IntegrityError("s", {}, Exception()), 100).retryable is True


def test_messages_are_cut() -> None:
    f = classify(RuntimeError("x" * 1000), 50)
    assert len(f.message) == 50 and f.message.endswith("…")
    assert crashed(3, None, 500).error_class == "ProcessCrashed"


def test_handler_model_comes_from_the_annotation() -> None:
    app = inbox.Consumer(name="c", topics=["t"])

    @app.handler("a")
    async def typed(event: Thing, session: object) -> None: ...

    @app.handler("b", max_attempts=2)
    def raw(event: inbox.InboxEvent, session: object) -> None: ...

    assert app.handlers["a"].model is Thing and app.handlers["a"].is_async
    assert app.handlers["b"].model is None and not app.handlers["b"].is_async
    assert app.handlers["b"].max_attempts == 2


def test_bad_declarations_are_refused() -> None:
    app = inbox.Consumer(name="c", topics=["t"])

    @app.handler("a")
    async def one(event: Thing, session: object) -> None: ...

    with pytest.raises(inbox.HandlerConfigurationError, match="already has"):
        app.handler("a")(one)
    with pytest.raises(inbox.HandlerConfigurationError, match="session"):
        app.handler("z")(lambda event: None)
    with pytest.raises(inbox.HandlerConfigurationError, match="group_id"):
        inbox.Consumer(name="c", topics=["t"], kafka_options={"group_id": "x"})
    with pytest.raises(InvalidIdentifier):
        inbox.Consumer(name="bad name", topics=["t"])


def _daemon() -> ConsumerDaemon:
    """A consumer daemon that is never started (its settings point nowhere)."""
    from inbox.runner import ConsumerDaemon
    from outbox.settings import OutboxSettings

    settings = OutboxSettings(
        database_url="postgresql+psycopg://u:p@127.0.0.1:1/db",  # type: ignore[arg-type]
        kafka_bootstrap_servers="127.0.0.1:1",
    )
    return ConsumerDaemon(inbox.Consumer(name="c", topics=["t"]), settings)


def test_healthz_is_unhealthy_only_when_waiting_records_make_no_progress() -> None:
    import time
    from types import SimpleNamespace

    from inbox.runner import STALLED_AFTER_SECONDS

    daemon = _daemon()
    assert not daemon.healthy()  # not started
    daemon._running = True
    assert daemon.healthy()  # no partitions: idle, not unhealthy
    daemon._lanes = {"tp": SimpleNamespace(events=[object()])}  # type: ignore[dict-item]
    assert daemon.healthy()  # records waiting, progress recent
    daemon._progress_at = time.monotonic() - STALLED_AFTER_SECONDS - 1
    assert not daemon.healthy()  # waiting and nothing committed for too long
    daemon._lanes["tp"].events.clear()  # type: ignore[attr-defined]
    assert daemon.healthy()  # caught up: quiet is fine


def _committer() -> OffsetCommitter:
    """An offset committer (inbox/offsets.py) with no consumer yet."""
    import logging

    from inbox.offsets import OffsetCommitter
    from outbox.outages import Dependency
    from outbox.resilience.retry import RetryPolicy

    return OffsetCommitter(Dependency("Kafka", logging.getLogger("t")), RetryPolicy(0.1, 1, 3), 100)


async def test_a_commit_cancelled_at_shutdown_leaves_its_offsets_for_the_last_commit() -> None:
    # The committer is cancelled when the consumer stops, possibly while Kafka has its
    # request: the offsets it took must be pending again, or release() commits nothing and
    # the next owner re-reads what this one finished.
    from aiokafka import TopicPartition

    class Kafka:
        def __init__(self) -> None:
            self.asked = asyncio.Event()

        async def commit(self, offsets: dict[TopicPartition, int]) -> None:
            self.asked.set()
            await asyncio.Event().wait()  # no answer before the shutdown

    offsets = _committer()
    kafka = offsets.consumer = Kafka()
    a, b = TopicPartition("t", 0), TopicPartition("t", 1)
    offsets.done(a, 10)
    offsets.done(b, 7)
    committing = asyncio.create_task(offsets.flush())
    await kafka.asked.wait()
    assert offsets._pending == {}  # taken by the commit under way
    offsets.done(a, 11)  # finished meanwhile: the newer offset wins
    committing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await committing
    assert offsets._pending == {a: 11, b: 7} and offsets._ready.is_set()


async def test_an_offset_commit_kafka_did_not_take_is_tried_again() -> None:
    # The group coordinator's broker died: the commit fails. The offsets stay pending (a
    # newer one finished meanwhile wins) and go with the next commit, so a restart re-reads
    # no more than what was never committed.
    from aiokafka import TopicPartition

    from outbox.errors import BrokerUnavailable

    class Kafka:  # the client interface's commit (outbox/kafka/client.py)
        def __init__(self) -> None:
            self.fail = True
            self.committed: list[dict[TopicPartition, int]] = []

        async def commit(self, offsets: dict[TopicPartition, int]) -> None:
            if self.fail:
                raise BrokerUnavailable("offset commit failed: KafkaConnectionError")
            self.committed.append(dict(offsets))

    offsets = _committer()
    kafka = offsets.consumer = Kafka()
    a, b = TopicPartition("t", 0), TopicPartition("t", 1)
    offsets.done(a, 10)
    offsets.done(b, 7)
    assert not await offsets.flush()
    assert offsets._pending == {a: 10, b: 7} and offsets._ready.is_set()
    assert not offsets.kafka.up  # one line for the outage
    offsets.done(a, 12)  # finished while Kafka was away: the newer offset wins
    kafka.fail = False
    assert await offsets.flush()
    assert kafka.committed == [{a: 12, b: 7}] and offsets._pending == {}
    assert offsets.committed == {a: 12, b: 7}  # the lag's reference
    assert offsets.kafka.up


class _Cluster:
    def __init__(self, nodes: list[int]) -> None:
        self._brokers = [SimpleNamespace(nodeId=n) for n in nodes]

    def brokers(self) -> list[SimpleNamespace]:
        return self._brokers

    def update_metadata(self, response: object) -> None:
        pass


class _Client:
    """What MetadataWatch uses of an aiokafka client; ``hung`` brokers never answer."""

    def __init__(self, nodes: list[int], hung: set[int]) -> None:
        self.cluster = _Cluster(nodes)
        self.hung = hung

    async def send(self, node: int, request: object) -> SimpleNamespace:
        if node in self.hung:
            raise kerr.RequestTimedOutError()
        return SimpleNamespace(brokers=self.cluster.brokers())


async def test_a_coordinator_lookup_goes_to_the_broker_that_answered_last() -> None:
    # A lookup sent to a hung broker waits a whole request timeout with heartbeats stopped:
    # the group dropped the member and rebalanced. Not yet known to be silent is not
    # enough; the broker that answered the last refresh answers.
    client = _Client([1, 2, 3], hung={1})
    watch = MetadataWatch(client, ["orders"], each_seconds=0.1)
    assert await watch.refresh()  # 1 does not answer, 2 does
    assert {watch.pick() for _ in range(50)} == {2}
    client.hung.add(2)
    assert await watch.refresh()  # 2 first, then 3 (1 failed lately: last)
    assert {watch.pick() for _ in range(50)} == {3}
    client.hung = {1, 2, 3}
    assert not await watch.refresh()  # nobody answers: any broker, none preferred
    assert {watch.pick() for _ in range(200)} == {1, 2, 3}


async def test_a_background_task_that_dies_fails_the_consumers_health_loudly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The metadata watch, the committer, the sharer: a death is a bug, never unobserved.
    import logging

    daemon = _daemon()
    daemon._running = True
    assert daemon.healthy()

    async def broken() -> None:
        raise RuntimeError("a bug in the watch")

    task = asyncio.ensure_future(broken())
    task.add_done_callback(daemon._watch)
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.sleep(0)
    assert not daemon.healthy()
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "a bug in the watch" in error.getMessage() and error.exc_info is not None


def test_a_lane_uses_only_its_host_offers_pauses_and_resumes() -> None:
    # inbox/lane.py: the lane sees its daemon through LaneHost alone. Records far beyond a
    # transaction's worth pause the partition; as transactions finish them, the lane trims
    # them and reports the offset, and it resumes fetching at half the pause mark, while
    # the rest is still being handled (not once the lane has run dry).
    import logging

    from aiokafka import TopicPartition

    from inbox.lane import Lane, LaneHost, Slots
    from outbox.outages import Dependency
    from outbox.resilience.retry import RetryPolicy
    from outbox.settings import ConsumerSettings

    calls: list[tuple[str, object]] = []
    host = LaneHost(
        config=ConsumerSettings(max_batch_records=2),
        slots=Slots(1),
        policy=RetryPolicy(0.1, 1, 3),
        database=Dependency("database", logging.getLogger("t")),
        kafka=Dependency("Kafka", logging.getLogger("t")),
        offer=lambda lane: calls.append(("offer", lane.tp)),
        finished=lambda tp, offset: calls.append(("finished", offset)),
        pause=lambda tp: calls.append(("pause", tp)),
        resume=lambda tp: calls.append(("resume", tp)),
    )
    tp = TopicPartition("t", 0)
    decode = lambda r: SimpleNamespace(offset=r.offset, record_value=r.value)  # noqa: E731
    lane = Lane(host, tp, SimpleNamespace(), decode)  # type: ignore[arg-type]
    lane.feed([SimpleNamespace(offset=o, value=b"v") for o in range(8)])  # type: ignore[misc]
    assert calls == [("offer", tp), ("pause", tp)] and lane.paused
    assert [e.offset for e in lane.queued(3, 2)] == [4, 5]
    lane.busy = True  # a run of several transactions is under way
    asyncio.run(lane.progress(2))  # its first transaction committed: 6 records left
    assert calls[2:] == [("finished", 2)] and lane.paused
    assert [e.offset for e in lane.events] == [2, 3, 4, 5, 6, 7] and lane.fetched_bytes == 6
    asyncio.run(lane.progress(4))  # 4 left: two transactions' worth, fetch again now
    assert calls[3:] == [("finished", 4), ("resume", tp)] and not lane.paused
    asyncio.run(lane.progress(8))  # every record committed in the database
    lane.settle()
    assert calls[5:] == [("finished", 8)]
    assert lane.events == [] and lane.fetched_bytes == 0 and not lane.paused
    assert host.dependency_of(OSError()) is host.database


async def test_slots_are_handed_out_in_turn_and_say_when_one_is_wanted() -> None:
    from inbox.lane import Slots

    slots = Slots(1)
    order: list[str] = []
    assert not slots.in_use() and not slots.wanted()

    async def lane(name: str) -> None:
        async with slots:
            order.append(name)
            await asyncio.sleep(0)

    async with slots:
        assert slots.in_use() and not slots.wanted()
        waiters = [asyncio.create_task(lane(n)) for n in "ab"]
        await asyncio.sleep(0)
        assert slots.wanted()  # a holder gives its slot back after its transaction
    await asyncio.gather(*waiters)
    assert order == ["a", "b"] and not slots.in_use() and not slots.wanted()


def _processor(max_batch_records: int) -> PartitionProcessor:
    """A partition processor whose transactions are a fake that finishes every run."""
    from inbox.processor import PartitionProcessor
    from outbox.settings import ConsumerSettings

    processor = PartitionProcessor(
        app=inbox.Consumer(name="c", topics=["t"]),
        config=ConsumerSettings(max_batch_records=max_batch_records),
        store=None,  # type: ignore[arg-type]
        sessions=None,  # type: ignore[arg-type]
        connections=None,  # type: ignore[arg-type]
        sink=None,  # type: ignore[arg-type]
        policy=None,  # type: ignore[arg-type]
        metrics=None,  # type: ignore[arg-type]
        topic="t",
        partition=0,
    )
    processor.marker.known = None  # read: no marker

    async def step(run: list[object], following: object) -> int:
        return len(run)

    processor._step = step  # type: ignore[assignment,method-assign]
    return processor


async def test_a_lane_with_a_backlog_gives_its_slot_back_after_each_transaction_when_wanted() -> (
    None
):
    # issue 52: a backlogged lane kept its slot for up to 4 x max_batch_records records.
    events = [SimpleNamespace(offset=o) for o in range(6)]

    def queued(after: int, limit: int) -> list[SimpleNamespace]:
        return [e for e in events if e.offset > after][:limit]

    assert await _processor(2).process(queued) == 6  # nobody waits: the whole backlog
    assert await _processor(2).process(queued, lambda: True) == 2  # one transaction


async def test_while_lanes_are_behind_only_short_runs_share_the_transaction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # issue 52: a long run of a lane catching up in the shared transaction held every
    # caught-up partition's records as long; it goes to its lane's own task instead.
    import inbox.runner
    from inbox.runner import SHORT_RUN

    shared: list[list[int]] = []

    async def together(members: list[tuple[object, list[SimpleNamespace]]]) -> None:
        shared.append([len(run) for _, run in members])

    monkeypatch.setattr(inbox.runner, "process_together", together)

    def lane(name: int, records: int) -> SimpleNamespace:
        run = [SimpleNamespace(offset=o) for o in range(records)]
        return SimpleNamespace(
            tp=name,
            busy=False,
            events=run,
            queued=None,
            processor=SimpleNamespace(ready_run=lambda _queued: run),
            wake=asyncio.Event(),
            settle=lambda: None,
        )

    daemon = _daemon()

    async def share(*lanes: SimpleNamespace) -> list[int]:
        for one in lanes:
            one.busy = False
            one.wake.clear()
        daemon._offered = {one.tp: one for one in lanes}
        before = len(shared)
        await daemon._share_once()
        return shared[before] if len(shared) > before else []

    short, long_, longer = lane(1, SHORT_RUN), lane(2, SHORT_RUN + 1), lane(3, SHORT_RUN + 9)
    # Every partition brings a long run and none is behind (a high steady rate): all share.
    assert await share(long_, longer) == [SHORT_RUN + 1, SHORT_RUN + 9]
    # Caught-up partitions beside partitions catching up: the long runs go to own tasks.
    assert await share(short, long_, longer) == [SHORT_RUN]
    assert long_.wake.is_set() and longer.wake.is_set() and not short.wake.is_set()
    async with daemon._slots:  # a lane runs on its own: partitions are behind
        assert await share(long_, longer) == []
        assert long_.wake.is_set() and longer.wake.is_set()
