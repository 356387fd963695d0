"""Read-only questions to Kafka for the operator tools: which topics exist with how many
partitions, how large a record each takes, the end offsets of partitions, and a consumer
group's committed offsets and members.

Nothing here produces, joins a group or commits: the offset reader has no group id, so
looking at a group's lag never disturbs the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar, cast

from aiokafka import TopicPartition
from aiokafka.errors import (
    CoordinatorNotAvailableError,
    KafkaError,
    NotCoordinatorError,
)

from outbox.errors import BrokerUnavailable
from outbox.kafka.admin import partition_counts
from outbox.kafka.clients import kafka_admin, kafka_consumer, start_kafka
from outbox.ops.record_limits import TopicLimits, describe_limits
from outbox.settings import OutboxSettings

_TIMEOUT_MS = 5000
_COORDINATOR_TRIES = 5
T = TypeVar("T")


@dataclass(frozen=True)
class Member:
    """One member of a consumer group."""

    member_id: str
    client_id: str

    @property
    def static(self) -> bool:
        """Kafka names a member ``<client id>-<UUID>``, a static one ``<group instance
        id>-<UUID>`` (DescribeGroups before version 4, all aiokafka sends, has no instance
        id field): a member whose name does not start with its client id is static."""
        return self.member_id[: -len("-00000000-0000-0000-0000-000000000000")] != self.client_id


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

    async def describe_group(self, group: str) -> dict[str, Any]:
        """The group as its coordinator describes it: ``state`` and ``members`` (each
        with ``member_id``, ``client_id``, ``client_host``, ``member_assignment`` bytes)."""
        for attempt in range(_COORDINATOR_TRIES):
            try:
                # One group per request: the coordinators differ.
                [response] = await self._call(self._admin.describe_consumer_groups([group]))
                [described] = response.to_object()["groups"]
                return cast(dict[str, Any], described)
            except (CoordinatorNotAvailableError, NotCoordinatorError):
                await asyncio.sleep(0.2 * (attempt + 1))
        raise BrokerUnavailable(f"no group coordinator for {group!r} (is the cluster healthy?)")

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

    async def members(self, group: str) -> list[Member]:
        """The group's live members, as its coordinator describes them."""
        [response] = await self._call(self._admin.describe_consumer_groups([group]))
        found: list[Member] = []
        for described in response.to_object()["groups"]:
            found.extend(Member(m["member_id"], m["client_id"]) for m in described["members"])
        return found

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            return await asyncio.wait_for(call, 2 * _TIMEOUT_MS / 1000)
        except (CoordinatorNotAvailableError, NotCoordinatorError):
            raise
        except (KafkaError, OSError, TimeoutError) as exc:
            raise BrokerUnavailable(
                f"Kafka at {self._bootstrap} did not answer ({type(exc).__name__})"
            ) from None
