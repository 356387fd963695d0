"""The relay's producers: up to ``relay.producers`` idempotent producers, each serving the
partitions mapped to it, started on first use and replaced alone when one breaks.

Why several: Kafka answers a produce request once every partition in it is acknowledged,
and one connection serves one request at a time; a single producer would tie every
partition a broker leads to the slowest of them (with ``acks=all``, to any partition
waiting for a dead in-sync replica). A partition keeps its producer for the life of the
relay (a producer's sequence numbers order that partition's batches); a replaced producer's
successor takes over its partitions.
"""

from __future__ import annotations

import asyncio
import logging

from outbox.kafka.client import KafkaClients, Producer, ProducerOptions, TopicPartition
from outbox.settings import RelaySettings
from relay.kafka.brokers import BrokerView

log = logging.getLogger("relay.publisher")
# A stopping relay's producer, its batches failed, waits this long for its requests in
# flight; then its stop is cancelled.
_IN_FLIGHT_AT_STOP_SECONDS = 1.0


def producer_options(settings: RelaySettings, max_payload_bytes: int) -> ProducerOptions:
    return ProducerOptions(
        client_id="outbox-relay",
        linger_ms=settings.linger_ms,
        max_batch_bytes=settings.max_batch_bytes,
        # Larger than any single batch we build, so one request can carry a batch for
        # every partition of the claim.
        max_request_bytes=max(settings.max_batch_bytes, max_payload_bytes) * 4,
        request_timeout_ms=int(settings.ack_timeout_seconds * 1000),
        retry_backoff_ms=200,
    )


class ProducerPool:
    def __init__(
        self,
        settings: RelaySettings,
        options: ProducerOptions,
        clients: KafkaClients,
        brokers: BrokerView,
    ) -> None:
        self._flush_seconds = settings.ack_timeout_seconds
        self._options = options
        self._clients = clients
        self._brokers = brokers
        # Producer i serves the partitions mapped to it (any one answers metadata questions
        # and builds batches).
        self._producers: list[Producer | None] = [None] * settings.producers
        self._starting: dict[int, asyncio.Task[Producer]] = {}
        self._index_of: dict[TopicPartition, int] = {}
        self._closing: set[asyncio.Task[None]] = set()  # retired producers, flushing

    def running(self) -> Producer | None:
        """Any running producer (its client knows the cluster), or None."""
        return next((p for p in self._producers if p is not None), None)

    def index_of(self, tp: TopicPartition) -> int:
        """The producer serving ``tp``: assigned round-robin on first sight, then kept."""
        index = self._index_of.get(tp)
        if index is None:
            index = self._index_of[tp] = len(self._index_of) % len(self._producers)
        return index

    def serving(self, tp: TopicPartition) -> Producer | None:
        """The running producer that serves ``tp``, if any."""
        return self._producers[self._index_of.get(tp, 0)]

    def leader(self, tp: TopicPartition) -> int | None:
        """``tp``'s leader as the producers' metadata has it."""
        producer = self.serving(tp) or self.running()
        return None if producer is None else producer.leader(tp)

    async def start(self, index: int) -> Producer:
        """Producer ``index``, started if it is not (one start at a time per index);
        raises the framework's error when Kafka cannot be reached."""
        producer = self._producers[index]
        if producer is not None:
            return producer
        task = self._starting.get(index)
        if task is None:
            task = self._starting[index] = asyncio.ensure_future(self._connect(index))
            task.add_done_callback(lambda _: self._starting.pop(index, None))
        return await asyncio.shield(task)

    async def _connect(self, index: int) -> Producer:
        bootstrap = self._brokers.bootstrap()
        producer = self._clients.producer(bootstrap, self._options, self._brokers.pick_node)
        started = asyncio.get_running_loop().time()
        await producer.start()
        # Registered here, before anyone waiting for this start resumes: once the start is
        # done a caller arriving before them would find neither a producer nor a start and
        # start a second one, used for its batches but never kept — so never closed, and
        # never replaced when a partition it sent to stalls (the stall then lasted until its
        # batch timed out).
        self._producers[index] = producer
        log.debug(
            "producer %d started in %.2f s (bootstrap %s)",
            index,
            asyncio.get_running_loop().time() - started,
            bootstrap,
        )
        return producer

    def retire(self, producer: Producer, why: str) -> bool:
        """Take a broken producer out of service (a new producer id restarts the sequence
        numbers); the next batch of its partitions starts a new one. False when it was
        retired already (several of its partitions said so)."""
        if producer not in self._producers:
            return False
        log.debug("producer replaced: %s", why)
        for i, current in enumerate(self._producers):
            if current is producer:
                self._producers[i] = None
        # Its queued batches may still be acknowledged (copies of rows that are back in the
        # outbox: duplicates, never reordered); let it flush in the background.
        flush = self._flush_seconds
        task = asyncio.ensure_future(producer.close(flush, flush))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)
        return True

    async def stop(self, within: float) -> None:
        """Close every producer: each may flush for ``within`` seconds; then what it still
        holds is failed, and a second later its stop is cancelled, requests in flight or
        not (a broker that does not answer would hold them for the ack timeout)."""
        producers = [p for p in self._producers if p is not None]
        self._producers = [None] * len(self._producers)
        for task in [*self._closing, *self._starting.values()]:
            task.cancel()
        in_flight = _IN_FLIGHT_AT_STOP_SECONDS
        await asyncio.gather(*(p.close(within, in_flight) for p in producers))
