"""The consumer's Kafka side: one librdkafka consumer, driven by one background thread.

Why librdkafka: fetching, decompression and the protocol run in C. At 1,000 records/s
a bare librdkafka consumer loop cost 64 µs of CPU per record on this project's machine,
aiokafka's pure-Python one 263 µs; on two shared cores that difference is latency.

Why a thread: librdkafka's calls block and its consumer is not thread-safe. So one thread
owns it and makes every call to it; the event loop only queues commands (commit, pause,
resume) that the thread runs between polls, and receives fetched batches through
``on_records``. At most ``_MAX_IN_FLIGHT`` batches wait for the loop, so memory stays
bounded; the thread does not wait for each hand-over (a thread wake-up per batch cost as
much CPU as the fetch itself).

Rebalances: librdkafka runs its rebalance callbacks on the polling thread, inside
``poll``. A revocation asks the loop to finish the revoked partitions' in-flight runs
(``on_revoked``, a coroutine returning their finished offsets) and commits those offsets
synchronously before returning, i.e. before librdkafka rejoins the group: the next owner
starts after everything this member applied. Batches handed over before the revocation
reach the loop before it (the loop runs callbacks in the order they were scheduled), so
none crosses a rebalance. ``close`` revokes whatever is still assigned the same way, so
shutdown needs no path of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

import confluent_kafka as ck

from outbox.errors import BrokerUnavailable, ConfigurationError

log = logging.getLogger("outbox.inbox")


class TopicPartition(NamedTuple):
    topic: str
    partition: int


Offsets = dict[TopicPartition, int]  # next offset to read, as Kafka commits them
Records = dict[TopicPartition, list[ck.Message]]
_Command = Callable[[ck.Consumer], None]
_MAX_IN_FLIGHT = 4


class Fetcher:
    """A librdkafka consumer in a group, for an asyncio daemon.

    ``on_records`` runs on the event loop with each fetched batch, grouped by partition
    and in offset order. ``on_revoked`` runs on the loop when partitions leave this
    member; it must stop their work and return the offsets to commit for them.
    """

    def __init__(
        self,
        config: Mapping[str, Any],
        topics: Sequence[str],
        *,
        on_records: Callable[[Records], None],
        on_revoked: Callable[[list[TopicPartition]], Coroutine[Any, Any, Offsets]],
        max_records: int,
        poll_seconds: float,
    ) -> None:
        self._config = {
            **config,
            "enable.auto.commit": False,
            "error_cb": self._client_error,
            "on_commit": self._committed,
            "logger": logging.getLogger("outbox.inbox.kafka"),
        }
        self._topics = list(topics)
        self._on_records = on_records
        self._on_revoked = on_revoked
        self._max_records = max(max_records, 2)
        self._poll_seconds = poll_seconds
        self._commands: deque[_Command] = deque()
        # Hand-over accounting: each counter is written by one thread only.
        self._handed = 0  # by the polling thread
        self._taken = 0  # by the event loop
        self._full = False  # the polling thread waits for ``_room``
        self._room = threading.Event()
        self._stopping = threading.Event()
        self._fatal: ck.KafkaError | None = None
        self._last_error: int | None = None
        self._assigned: frozenset[TopicPartition] = frozenset()
        self._thread = threading.Thread(target=self._run, name="inbox-fetcher", daemon=True)

    # ------------------------------------------------------------------ event loop side

    async def start(self) -> None:
        """Create the client (a bad option raises :class:`ConfigurationError` here) and
        start fetching."""
        self._loop = asyncio.get_running_loop()
        self._started: asyncio.Future[None] = self._loop.create_future()
        self.done: asyncio.Future[None] = self._loop.create_future()
        self._thread.start()
        await self._started

    def assignment(self) -> frozenset[TopicPartition]:
        return self._assigned

    def commit(self, offsets: Offsets) -> None:
        """Commit in the background; a refusal (the partition moved) is only logged:
        the next owner re-reads from the last committed offset and the inbox dedupes."""
        parts = _partitions(offsets)
        self._commands.append(lambda c: self._commit_async(c, parts))

    def pause(self, tp: TopicPartition) -> None:
        parts = [ck.TopicPartition(tp.topic, tp.partition)]
        self._commands.append(lambda c: _tolerant(c.pause, parts))

    def resume(self, tp: TopicPartition) -> None:
        parts = [ck.TopicPartition(tp.topic, tp.partition)]
        self._commands.append(lambda c: _tolerant(c.resume, parts))

    async def stop(self) -> None:
        """Revoke what is assigned (``on_revoked`` runs, offsets commit), leave the group
        and end the thread. Raises what made the thread fail, if anything did."""
        if self._thread.ident is None:
            return  # never started
        self._stopping.set()
        self._room.set()
        await asyncio.shield(self.done)

    def _deliver(self, batch: list[ck.Message]) -> None:
        try:
            records: Records = {}
            for message in batch:
                tp = TopicPartition(message.topic() or "", message.partition() or 0)
                records.setdefault(tp, []).append(message)
            self._on_records(records)
        finally:
            self._taken += 1
            if self._full:
                self._room.set()

    @staticmethod
    def _settle(future: asyncio.Future[None], failure: BaseException | None) -> None:
        if future.done():
            return
        if failure is None:
            future.set_result(None)
        else:
            future.set_exception(failure)

    # ------------------------------------------------------------------ polling thread

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            return False
        return True

    def _run(self) -> None:
        try:
            consumer = ck.Consumer(self._config)
        except (ck.KafkaException, ValueError, TypeError) as exc:
            error = ConfigurationError(f"invalid Kafka consumer option: {_reason(exc)}")
            self._to_loop(self._settle, self._started, error)
            self._to_loop(self._settle, self.done, None)
            return
        self._to_loop(self._settle, self._started, None)
        failure: BaseException | None = None
        try:
            consumer.subscribe(
                self._topics,
                on_assign=self._assigned_cb,
                on_revoke=self._revoked_cb,
                on_lost=self._lost_cb,
            )
            while not self._stopping.is_set():
                self._run_commands(consumer)
                batch = self._poll(consumer)
                if batch and self._to_loop(self._deliver, batch):
                    self._handed += 1
                    self._wait_for_room()
        except BaseException as exc:
            failure = exc
        try:
            self._run_commands(consumer)
            consumer.close()
        except BaseException as exc:
            failure = failure or exc
        self._to_loop(self._settle, self.done, _as_broker_error(failure))

    def _wait_for_room(self) -> None:
        while self._handed - self._taken >= _MAX_IN_FLIGHT and not self._stopping.is_set():
            self._room.clear()
            self._full = True
            if self._handed - self._taken >= _MAX_IN_FLIGHT:  # the loop may have just taken one
                self._room.wait(self._poll_seconds)
            self._full = False

    def _run_commands(self, consumer: ck.Consumer) -> None:
        while self._commands:
            self._commands.popleft()(consumer)

    def _poll(self, consumer: ck.Consumer) -> list[ck.Message]:
        # ``consume(n, timeout)`` waits for n records or the timeout; ``poll`` returns at the
        # first one. So: wait for one, then take what else is already fetched.
        first = consumer.poll(self._poll_seconds)
        if self._fatal is not None:
            raise ck.KafkaException(self._fatal)
        if first is None:
            return []
        batch = [first, *consumer.consume(self._max_records - 1, 0)]
        good = []
        for message in batch:
            error = message.error()
            if error is None:
                good.append(message)
            elif error.fatal():
                raise ck.KafkaException(error)
            else:
                self._client_error(error)
        return good

    def _commit_async(self, consumer: ck.Consumer, parts: list[ck.TopicPartition]) -> None:
        try:
            consumer.commit(offsets=parts, asynchronous=True)
        except ck.KafkaException as exc:  # e.g. no longer in the group: never fatal here
            self._committed(exc.args[0], [])

    def _assigned_cb(self, consumer: ck.Consumer, partitions: list[ck.TopicPartition]) -> None:
        # A partition paused under a former assignment would stay paused; its new lane
        # starts empty, so it must fetch.
        _tolerant(consumer.resume, partitions)
        tps = _tps(partitions)
        self._assigned = self._assigned | tps
        log.info("partitions assigned", extra={"partitions": sorted(map(_name, tps))})

    def _revoked_cb(self, consumer: ck.Consumer, partitions: list[ck.TopicPartition]) -> None:
        offsets = self._release(partitions)
        if not offsets:
            return
        try:
            results = consumer.commit(offsets=_partitions(offsets), asynchronous=False)
        except ck.KafkaException as exc:
            self._committed(exc.args[0], [])
            return
        self._committed(None, results or [])

    def _lost_cb(self, consumer: ck.Consumer, partitions: list[ck.TopicPartition]) -> None:
        # The group already gave them away (this member missed its session timeout): stop
        # their work; a commit would be refused.
        log.warning("partitions lost", extra={"partitions": sorted(map(_name, _tps(partitions)))})
        self._release(partitions)

    def _release(self, partitions: list[ck.TopicPartition]) -> Offsets:
        tps = _tps(partitions)
        self._assigned = self._assigned - tps
        if self._loop.is_closed():
            return {}
        waiting: Future[Offsets] = asyncio.run_coroutine_threadsafe(
            self._on_revoked(sorted(tps)), self._loop
        )
        return waiting.result()

    def _committed(self, error: ck.KafkaError | None, partitions: list[ck.TopicPartition]) -> None:
        refused = {f"{p.topic}-{p.partition}": p.error.name() for p in partitions if p.error}
        if error is None and not refused:
            return
        # The partition moved to another member, or the broker is away: the next owner
        # re-reads from the last committed offset and the inbox skips what was applied.
        log.warning(
            "offset commit refused",
            extra={"error": error.name() if error is not None else None, "partitions": refused},
        )

    def _client_error(self, error: ck.KafkaError) -> None:
        if error.fatal():
            self._fatal = error
            return
        code = error.code()
        if code == self._last_error:
            return  # librdkafka repeats e.g. "all brokers down" on every reconnect attempt
        self._last_error = code
        log.warning("kafka client error", extra={"error": error.name(), "detail": error.str()})


def _tolerant(
    call: Callable[[list[ck.TopicPartition]], None], parts: list[ck.TopicPartition]
) -> None:
    with contextlib.suppress(ck.KafkaException):  # revoked meanwhile: its lane is gone too
        call(parts)


def _partitions(offsets: Offsets) -> list[ck.TopicPartition]:
    return [ck.TopicPartition(tp.topic, tp.partition, offset) for tp, offset in offsets.items()]


def _tps(partitions: list[ck.TopicPartition]) -> frozenset[TopicPartition]:
    return frozenset(TopicPartition(p.topic, p.partition) for p in partitions)


def _name(tp: TopicPartition) -> str:
    return f"{tp.topic}-{tp.partition}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ck.KafkaException) and exc.args and isinstance(exc.args[0], ck.KafkaError):
        return str(exc.args[0].str())
    return str(exc)


def _as_broker_error(exc: BaseException | None) -> BaseException | None:
    if isinstance(exc, ck.KafkaException):
        return BrokerUnavailable(f"Kafka consumer failed: {_reason(exc)}")
    return exc
