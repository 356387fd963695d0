"""A Kafka client's view of who leads what, kept fresh when a broker hangs (the consumer's
Kafka watch; see :class:`MetadataWatch`)."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiokafka.errors import KafkaError

from outbox.kafka import aiokafka_internals


class MetadataWatch:
    """Keeps a Kafka client's view of who leads what fresh when a broker hangs.

    aiokafka's own refresh, and its choice of a broker for a coordinator lookup, take one
    broker at random and wait a whole request timeout when that one hangs: meanwhile the
    partitions Kafka moved away from it are still fetched from it, and a consumer whose
    group coordinator hung may look up the hung one again and be thrown out of the group.
    :meth:`refresh` asks the brokers one at a time, the one that answered last first, each
    for at most ``each_seconds``; the client's random choice becomes the broker that
    answered the last refresh, else one that did not fail to answer.

    ``owner`` is the consumer (or any aiokafka client); the requests go through
    :mod:`outbox.kafka.aiokafka_internals`. Without its metadata capability (an aiokafka
    that changed the internals, said at start) a refresh is ``fallback()`` — a public
    request such as ``consumer.topics()`` — which tells an outage but leaves leadership to
    aiokafka."""

    def __init__(
        self,
        owner: Any,
        topics: Sequence[str],
        each_seconds: float,
        fallback: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._owner = owner
        self._kafka = aiokafka_internals.client_of(owner)
        self._topics = list(topics)
        self._each = each_seconds
        self._fallback = fallback
        self._answered: int | None = None
        self._silent: dict[int, float] = {}  # broker -> when it last failed to answer
        aiokafka_internals.prefer_brokers(owner, lambda _client: self.pick())

    def _quiet(self) -> set[int]:
        """Brokers that failed to answer in the last SILENT_SECONDS."""
        since = time.monotonic() - self.SILENT_SECONDS
        return {n for n, at in self._silent.items() if at > since}

    SILENT_SECONDS = 30.0

    def pick(self) -> int | None:
        """Where aiokafka sends a group coordinator lookup. Heartbeats stop while the
        coordinator is unknown (after a commit timed out, say, waiting for a hung replica),
        and a lookup sent to a hung broker waits a whole request timeout: long enough for
        the group to drop this member (session 10 s) and rebalance. A broker that has not
        failed to answer yet may be the hung one; the one that answered the last refresh
        (a second ago) is not."""
        nodes = [b.nodeId for b in self._kafka.cluster.brokers()]
        quiet = self._quiet()
        if self._answered in nodes and self._answered not in quiet:
            return self._answered
        answering = [n for n in nodes if n not in quiet]
        return random.choice(answering or nodes) if nodes else None

    async def refresh(self) -> bool:
        """True when a broker answered (and the client's view was updated)."""
        if not aiokafka_internals.usable(aiokafka_internals.METADATA):
            return await self._refresh_publicly()
        quiet = self._quiet()
        nodes = [b.nodeId for b in self._kafka.cluster.brokers()]
        nodes.sort(key=lambda n: (n != self._answered, n in quiet))
        for node in nodes:
            try:
                response = await asyncio.wait_for(
                    aiokafka_internals.ask_metadata(self._owner, node, self._topics), self._each
                )
            except aiokafka_internals.MetadataUnavailable:
                return await self._refresh_publicly()
            except (KafkaError, OSError, TimeoutError):
                self._silent[node] = time.monotonic()
                continue
            if response.brokers:
                aiokafka_internals.update_cluster(self._owner, response)
                self._answered = int(node)
                self._silent.pop(node, None)
                return True
        return False

    async def _refresh_publicly(self) -> bool:
        if self._fallback is None:
            return True  # nothing to ask: aiokafka's own refresh is all there is
        try:
            await asyncio.wait_for(self._fallback(), self._each * 3)
        except (KafkaError, OSError, TimeoutError):
            return False
        return True
