"""The leader watch: while partitions are stalled, ask Kafka how they stand, and replace the
producer of a partition Kafka has acted on.

aiokafka keeps a batch sent to a broker that hangs in flight there for a whole request
timeout, and its retry may wait as long again for a metadata refresh stuck on that broker —
even after Kafka moved the partition's leadership, or took the hung broker out of its
in-sync replicas. So once Kafka has acted on a stalled partition (its leader or in-sync
replicas changed) and the batch still waits, the partition's producer is replaced: a new
one, bootstrapped from brokers that answer, sends its rows at once. (The old batch cannot be
committed by a broker that no longer leads, and a copy that lands later is a duplicate,
never reordered: see relay.kafka.partitions.) The timers are drawn in
docs/operations/kafka-failures.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from outbox.kafka.client import KafkaClients, MetadataClient, MetadataUnavailable, Producer
from outbox.lifecycle import supervise
from relay.kafka.brokers import BrokerView
from relay.kafka.partitions import PartitionHealth
from relay.kafka.producer_pool import ProducerPool

log = logging.getLogger("relay.publisher")

# How often the leaders of stalled partitions are looked up, and how long one broker may
# take to answer. Every probe interval adds to how long a partition stays held after
# Kafka's failover; one small metadata request to a broker that answers, only while
# something is stalled, costs little.
LEADER_PROBE_SECONDS = 0.25
LEADER_PROBE_TIMEOUT_MS = 1500
# After Kafka took a hung broker out of a partition's in-sync replicas, how long the batch
# waiting there gets to be answered before its producer is replaced. It is usually answered
# at once, or after one retry when its request timed out first (three brokers: every
# partition waits for the failover, longer than a request timeout). Replacing it sooner
# re-sends its rows while it lands too, and the consumer reads through the copies
# (docs/operations/kafka-failures.md).
ISR_SETTLE_SECONDS = 1.0
# A start of the watch's client tries the brokers it is given one after the other, one
# probe timeout each; past this it is tried again from a fresh list.
WATCH_START_SECONDS = 5.0
# A stalled batch whose partition Kafka lists with a live leader is answered within about
# one request timeout (the ack timeout): acknowledged, refused (NOT_ENOUGH_REPLICAS, retried
# at once by aiokafka) or timed out and sent again. One the watch has seen unanswered for
# this many ack timeouts while neither the leader nor the in-sync replicas it first saw
# changed waits on something the metadata does not show (its producer's connection or
# state): the producer is replaced, as when Kafka acts. Without this bound such a stall
# lasted until the batch was answered, however long: with Kafka counted as down (nothing
# acknowledged for an ack timeout, e.g. once the stream's other partitions are drained)
# the pipelines wait for that answer before they claim again (Pipeline._kafka_ready).
UNANSWERED_ACK_TIMEOUTS = 3.0

Replace = Callable[[Producer, str], None]


class LeaderWatch:
    def __init__(
        self,
        clients: KafkaClients,
        health: PartitionHealth,
        brokers: BrokerView,
        pool: ProducerPool,
        replace: Replace,
        ack_timeout_seconds: float = 10.0,
    ) -> None:
        self._clients = clients
        self._health = health
        self._brokers = brokers
        self._pool = pool
        self._replace = replace
        self._unanswered_seconds = UNANSWERED_ACK_TIMEOUTS * ack_timeout_seconds
        self._task: asyncio.Task[None] | None = None
        # What ended the watch unexpectedly (the relay's /healthz fails), if anything.
        self.failure: str | None = None

    def ensure(self) -> None:
        """Start the watch unless it runs — or died (a bug: logged at ERROR, and /healthz
        fails until the relay is restarted), or this client cannot send its metadata
        requests (said at start: stalls then wait for the client's own retries)."""
        running = self._task is not None and not self._task.done()
        if running or self.failure is not None or not self._clients.asks_chosen_brokers:
            return
        self._task = asyncio.ensure_future(self.run())
        supervise(self._task, "relay leader watch", log, self._died)

    def _died(self) -> None:
        self.failure = "leader watch died"

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def run(self) -> None:
        """Until no partition is stalled: one metadata request per probe to a broker that
        answers (a client of its own, short timeouts: the broker it happens to ask may be
        the hung one)."""
        loop = asyncio.get_running_loop()
        client: MetadataClient | None = None
        seen: dict[tuple[str, int], tuple[int, ...]] = {}  # in-sync replicas first seen
        acted: dict[tuple[str, int], float] = {}  # when Kafka was first seen to have acted
        # When the watch first saw each stalled partition (again after each replacement).
        since: dict[tuple[str, int], float] = {}
        try:
            while self._health.unavailable:
                await asyncio.sleep(LEADER_PROBE_SECONDS)
                if client is None and (client := await self.client()) is None:
                    continue
                stalled = self._health.leaders()
                # One metadata request: the topics, and the brokers Kafka lists (not
                # fenced). Whether the broker asked answers is news too: when every
                # partition waits for a hung replica (three brokers, replication factor 3)
                # no broker acknowledges anything, and this is how the brokers that still
                # answer are told from the hung one.
                node = self._brokers.pick_node(client.brokers())
                try:
                    view = await asyncio.wait_for(
                        client.ask(node, sorted({t for t, _ in stalled})),
                        LEADER_PROBE_TIMEOUT_MS / 1000 * 2,
                    )
                except MetadataUnavailable:
                    return  # said once at WARNING; stalls wait for the client's own retries
                except Exception as exc:  # asked the sick broker, probably: ask another
                    log.debug("leader watch: broker %s did not answer: %r", node, exc)
                    if node is not None:
                        self._brokers.silent(node)
                    continue
                if node is not None:
                    self._brokers.heard_from(node)
                self._brokers.live = set(view.brokers)
                now = loop.time()
                for tp, state in view.partitions.items():
                    if tp not in stalled or state.leader < 0:
                        continue
                    moved = state.leader != stalled[tp]
                    waited = now - since.setdefault(tp, now)
                    overdue = waited >= self._unanswered_seconds and state.leader in view.brokers
                    if not moved and not overdue and seen.setdefault(tp, state.isr) == state.isr:
                        continue
                    # A new leader: the batch waits on the old one. In-sync replicas
                    # changed: the batch should be answered now; give it a moment.
                    # Unanswered for long with a live leader: see UNANSWERED_ACK_TIMEOUTS.
                    if moved or overdue or now - acted.setdefault(tp, now) >= ISR_SETTLE_SECONDS:
                        producer = self._pool.serving(tp)
                        if producer is not None:
                            if moved:
                                change = f"leader {state.leader}"
                            elif overdue:
                                change = f"unanswered {waited:.0f} s, leader {state.leader}"
                            else:
                                change = f"in-sync {state.isr}"
                            self._replace(producer, f"{tp[0]}[{tp[1]}] stalled, {change}")
                        since[tp] = now  # what stays stalled, or stalls again, starts over
                seen = {tp: v for tp, v in seen.items() if tp in stalled}
                leaders = self._health.leaders()
                acted = {tp: v for tp, v in acted.items() if tp in leaders}
                since = {tp: v for tp, v in since.items() if tp in leaders}
        finally:  # an unexpected error ends the watch loudly (see ensure: supervise)
            if client is not None:
                await client.close()

    async def client(self) -> MetadataClient | None:
        """The watch's client, started; None when it could not start in time (the watch
        tries again at its next probe, from the brokers that answer by then). A hang has
        just begun when the watch starts, so the broker that hangs may still count as
        answering, and a start that asks it fails after one short request timeout."""
        client = self._clients.metadata_client(
            self._brokers.bootstrap(), LEADER_PROBE_TIMEOUT_MS, self._brokers.pick_node
        )
        return client if await client.start(WATCH_START_SECONDS) else None
