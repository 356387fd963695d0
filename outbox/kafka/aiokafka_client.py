"""The Kafka client interface (outbox/kafka/client.py) on aiokafka, the one implementation
today: producers that deliver record batches per partition and the leader watch's metadata
client. aiokafka's errors become the framework's here (outbox/kafka/errors.py); its
internals, where needed, are reached through outbox/kafka/aiokafka_internals.py.

Why per-key order survives retries: aiokafka keeps at most one produce request in flight
per broker and mutes a partition while its batch is in flight, and with idempotence a
retriable failure is retried in place (batches never expire), so a retry can never
overtake a later batch of the same partition. A batch the broker rejects for good leaves
a sequence gap, so the later batches of that partition fail too (OutOfOrderSequence):
those are :class:`~outbox.errors.ProducerBroken`, and the relay replaces the producer,
which again re-sends them in order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka import TopicPartition as KafkaPartition
from aiokafka import errors as kerr
from aiokafka.admin import AIOKafkaAdminClient

from outbox.errors import BrokerUnavailable, RecordRejected
from outbox.kafka import aiokafka_internals
from outbox.kafka.client import (
    Broker,
    ClusterView,
    MetadataUnavailable,
    PartitionState,
    PickBroker,
    ProducerOptions,
    RecordBatch,
    TopicPartition,
)
from outbox.kafka.clients import kafka_admin, kafka_producer, start_kafka
from outbox.kafka.errors import producer_failure
from outbox.settings import OutboxSettings

log = logging.getLogger("relay.publisher")
# How long a topic's metadata may take when this client does not know the topic (aiokafka's
# own wait would poll for its request timeout).
METADATA_SECONDS = 10.0


def _preferring(pick: PickBroker) -> Any:
    """aiokafka's "random broker" choice, routed to ``pick`` over the brokers it knows."""
    return lambda client: pick([b.nodeId for b in client.cluster.brokers()])


def _observed(future: asyncio.Future[Any]) -> None:
    """Mark a batch's failure as seen (whoever waits for it reads it as well)."""
    if not future.cancelled():
        future.exception()


class AioProducer:
    def __init__(self, producer: AIOKafkaProducer, settings: OutboxSettings) -> None:
        self._producer = producer
        self._settings = settings  # for the diagnosis of a refused start

    async def start(self) -> None:
        try:
            await start_kafka(self._producer, self._settings)
        except BaseException as exc:  # a cancelled start must not leak the producer either
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._producer.stop(), 2.0)
            if isinstance(exc, Exception):
                raise producer_failure(exc) from exc
            raise

    def new_batch(self) -> RecordBatch:
        batch: RecordBatch = self._producer.create_batch()
        return batch

    async def deliver(
        self, tp: TopicPartition, batches: Sequence[RecordBatch]
    ) -> list[Exception | None]:
        futures: list[asyncio.Future[Any]] = []
        refused: Exception | None = None
        for batch in batches:
            try:
                future = await self._producer.send_batch(batch, tp[0], partition=tp[1])
            except Exception as exc:
                # Not queued: no later batch of this partition may overtake it.
                refused = producer_failure(exc)
                break
            # Its answer is read below, unless this delivery is cancelled first (the relay
            # stopping, the loop closing) and the batch fails later — a retired producer's
            # batches fail with ProducerClosed when it is closed: read it anyway, or asyncio
            # prints "Future exception was never retrieved" for each at exit. (The batch's
            # own future, behind this shield, is read by aiokafka_internals.abandon_queued.)
            future.add_done_callback(_observed)
            futures.append(future)
        results: list[Exception | None] = []
        for future in futures:
            try:
                await future
                results.append(None)
            except Exception as exc:
                results.append(producer_failure(exc))
        results.extend([refused] * (len(batches) - len(results)))
        return results

    async def partitions(self, topic: str) -> list[int] | None:
        client = self._producer.client
        known = client.cluster.partitions_for_topic(topic)
        if known is None:
            # Ask the broker (aiokafka's own wait would poll for request_timeout_ms).
            client.add_topic(topic)
            try:
                answered = await asyncio.wait_for(client.force_metadata_update(), METADATA_SECONDS)
            except (kerr.KafkaError, OSError, TimeoutError) as exc:
                raise producer_failure(exc) from exc
            if not answered:
                raise BrokerUnavailable("Kafka unavailable: metadata request failed")
            if topic in client.cluster.unauthorized_topics:
                raise RecordRejected(f"not authorized to write to Kafka topic {topic!r}")
            known = client.cluster.partitions_for_topic(topic)
            if known is None:
                return None
        return sorted(known)

    def leader(self, tp: TopicPartition) -> int | None:
        leader = self._producer.client.cluster.leader_for_partition(KafkaPartition(*tp))
        return None if leader is None else int(leader)

    def brokers(self) -> list[Broker]:
        return [Broker(b.nodeId, b.host, b.port) for b in self._producer.client.cluster.brokers()]

    async def close(self, flush_within: float, in_flight_within: float) -> None:
        # stop() flushes, and a batch waiting on a dead or hung broker never finishes. Rows
        # not acked are still in the database (or the slot), so failing what is still
        # queued loses nothing; then the producer closes its sender and connections instead
        # of retrying forever. (aiokafka has no public "close without flushing".) Its sender
        # still waits ``in_flight_within`` seconds for its requests in flight; after that
        # the stop is cancelled. Its connections are then never closed: the relay is
        # exiting, and asyncio.run() cancels the client's tasks on the way out.
        stopping = asyncio.ensure_future(self._producer.stop())
        try:
            await asyncio.wait({stopping}, timeout=flush_within)
            if not stopping.done():
                aiokafka_internals.abandon_queued(self._producer, kerr.ProducerClosed())
                await asyncio.wait({stopping}, timeout=in_flight_within)
            if stopping.done() and not stopping.cancelled() and stopping.exception():
                log.debug("producer stop failed: %r", stopping.exception())
        finally:
            if not stopping.done():
                stopping.cancel()


class AioMetadataClient:
    def __init__(self, admin: AIOKafkaAdminClient) -> None:
        self._admin = admin

    async def start(self, within: float) -> bool:
        # Not start_kafka: after a failed start it asks the first configured broker — maybe
        # a hung one — for a long while whether the client was refused, and a refusal is
        # the producers' to report.
        try:
            await asyncio.wait_for(self._admin.start(), within)
        except Exception as exc:
            log.debug("leader watch: its client did not start: %r", exc)
            await self.close()
            return False
        return True

    def brokers(self) -> list[int]:
        client = aiokafka_internals.client_of(self._admin)
        return [b.nodeId for b in client.cluster.brokers()]

    async def ask(self, node: int | None, topics: Sequence[str]) -> ClusterView:
        try:
            answer = await aiokafka_internals.ask_metadata(self._admin, node, topics)
        except aiokafka_internals.MetadataUnavailable as exc:
            raise MetadataUnavailable(str(exc)) from exc
        metadata = answer.to_object()
        partitions = {
            (topic["topic"], p["partition"]): PartitionState(p["leader"], tuple(sorted(p["isr"])))
            for topic in metadata["topics"]
            for p in topic["partitions"]
        }
        return ClusterView(frozenset(int(b["node_id"]) for b in metadata["brokers"]), partitions)

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._admin.close(), 2.0)


class AioKafkaClients:
    """The relay's clients on aiokafka, with the connection settings of ``settings``."""

    def __init__(self, settings: OutboxSettings) -> None:
        self._settings = settings
        self.bootstrap = [a.strip() for a in settings.kafka_bootstrap_servers.split(",")]

    @property
    def chooses_brokers(self) -> bool:
        return aiokafka_internals.usable(aiokafka_internals.BROKER_CHOICE)

    @property
    def asks_chosen_brokers(self) -> bool:
        return aiokafka_internals.usable(aiokafka_internals.METADATA)

    def producer(self, bootstrap: str, options: ProducerOptions, pick: PickBroker) -> AioProducer:
        producer = kafka_producer(
            self._settings,
            bootstrap_servers=bootstrap,
            client_id=options.client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=options.linger_ms,
            max_batch_size=options.max_batch_bytes,
            max_request_size=options.max_request_bytes,
            request_timeout_ms=options.request_timeout_ms,
            retry_backoff_ms=options.retry_backoff_ms,
        )
        aiokafka_internals.prefer_brokers(producer, _preferring(pick))
        return AioProducer(producer, self._settings)

    def metadata_client(
        self, bootstrap: str, request_timeout_ms: int, pick: PickBroker
    ) -> AioMetadataClient:
        admin = kafka_admin(
            self._settings, bootstrap_servers=bootstrap, request_timeout_ms=request_timeout_ms
        )
        # Its metadata requests go to a broker chosen at random, as a producer's id does:
        # the same preference for brokers that answer.
        aiokafka_internals.prefer_brokers(admin, _preferring(pick))
        return AioMetadataClient(admin)
