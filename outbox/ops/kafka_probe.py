"""Read-only questions to Kafka for the operator tools: which topics exist with how many
partitions, how large a record each takes, the end offsets of partitions, and a consumer
group's committed offsets.

Nothing here produces, joins a group or commits: the offset reader has no group id, so
looking at a group's lag never disturbs the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from types import TracebackType
from typing import TypeVar

from aiokafka import TopicPartition
from aiokafka.errors import (
    CoordinatorNotAvailableError,
    KafkaError,
    NotCoordinatorError,
)

from outbox.daemon import kafka_admin, kafka_consumer, partition_counts, start_kafka
from outbox.errors import BrokerUnavailable
from outbox.ops.record_limits import TopicLimits, describe_limits
from outbox.settings import OutboxSettings

_TIMEOUT_MS = 5000
_COORDINATOR_TRIES = 5
T = TypeVar("T")


class KafkaProbe:
    """``async with KafkaProbe(settings) as probe: await probe.partitions([...])``."""

    def __init__(self, settings: OutboxSettings) -> None:
        self._settings = settings
        self._bootstrap = settings.kafka_bootstrap_servers
        self._admin = kafka_admin(settings, request_timeout_ms=_TIMEOUT_MS)
        self._reader = kafka_consumer(
            settings,
            group_id=None,
            enable_auto_commit=False,
            request_timeout_ms=_TIMEOUT_MS,
        )

    async def __aenter__(self) -> KafkaProbe:
        try:
            await asyncio.wait_for(start_kafka(self._admin, self._settings), 3 * _TIMEOUT_MS / 1000)
            await asyncio.wait_for(
                start_kafka(self._reader, self._settings), 3 * _TIMEOUT_MS / 1000
            )
        except (KafkaError, OSError, TimeoutError) as exc:
            await self._close()
            raise BrokerUnavailable(
                f"Kafka at {self._bootstrap} unreachable ({type(exc).__name__})"
            ) from None
        except BaseException:  # refused (BrokerRefused), cancelled: the clients close too
            await self._close()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._close()

    async def _close(self) -> None:
        await self._reader.stop()
        await self._admin.close()

    async def partitions(self, topics: Iterable[str]) -> dict[str, int | None]:
        """Partition count of each topic; None for a topic that does not exist."""
        wanted = sorted(set(topics))
        if not wanted:
            return {}
        return partition_counts(await self._call(self._admin.describe_topics(wanted)), wanted)

    async def limits(self, topics: Iterable[str]) -> dict[str, TopicLimits]:
        """Record size limit and compression of each existing topic this client may
        describe (the others are left out)."""
        found, _ = await self._call(describe_limits(self._admin, topics))
        return found

    async def end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        tps = list(partitions)
        if not tps:
            return {}
        result: dict[TopicPartition, int] = await self._call(self._reader.end_offsets(tps))
        return result

    async def beginning_offsets(
        self, partitions: Iterable[TopicPartition]
    ) -> dict[TopicPartition, int]:
        tps = list(partitions)
        if not tps:
            return {}
        result: dict[TopicPartition, int] = await self._call(self._reader.beginning_offsets(tps))
        return result

    async def topic_end_offsets(self, topics: Iterable[str]) -> dict[TopicPartition, int]:
        """End offsets of every partition of the existing ones among ``topics``."""
        counts = await self.partitions(topics)
        return await self.end_offsets(
            TopicPartition(t, p) for t, n in counts.items() if n for p in range(n)
        )

    async def committed(self, group: str) -> dict[TopicPartition, int]:
        """The group's committed offsets (empty for a group that never committed)."""
        for attempt in range(_COORDINATOR_TRIES):
            try:
                offsets = await self._call(self._admin.list_consumer_group_offsets(group))
                return {tp: om.offset for tp, om in offsets.items() if om.offset >= 0}
            except (CoordinatorNotAvailableError, NotCoordinatorError):
                # A fresh cluster creates __consumer_offsets on the first lookup.
                await asyncio.sleep(0.2 * (attempt + 1))
        raise BrokerUnavailable(f"no group coordinator for {group!r} (is the cluster healthy?)")

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(call, 2 * _TIMEOUT_MS / 1000)
        except (CoordinatorNotAvailableError, NotCoordinatorError):
            raise
        except (KafkaError, OSError, TimeoutError) as exc:
            raise BrokerUnavailable(
                f"Kafka at {self._bootstrap} did not answer ({type(exc).__name__})"
            ) from None
