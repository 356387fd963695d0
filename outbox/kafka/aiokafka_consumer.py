"""The consumer side of the Kafka client interface (outbox/kafka/client.py) on aiokafka: a
group consumer that never commits on its own. aiokafka's errors become the framework's
here (a refusal of the client :class:`~outbox.errors.BrokerRefused`, a group that drops
this member :class:`~outbox.errors.GroupError`, a commit the group took away
:class:`~outbox.errors.CommitRefused`, the rest :class:`~outbox.errors.BrokerUnavailable`);
what this client offers beyond the interface — the fetch wait the linger changes, the
group generation static membership reads, the metadata watch, reading a header name that
is not UTF-8 — goes through outbox/kafka/aiokafka_internals.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

from aiokafka import AIOKafkaConsumer
from aiokafka import __version__ as aiokafka_version
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError

from outbox.errors import BrokerUnavailable, CommitRefused, GroupError, RecordUnreadable
from outbox.kafka import aiokafka_internals
from outbox.kafka.client import Assigned, Partition
from outbox.kafka.clients import start_kafka
from outbox.kafka.errors import kafka_refusal
from outbox.kafka.metadata_watch import MetadataWatch
from outbox.settings import OutboxSettings

log = logging.getLogger("outbox.inbox")


def _unavailable(exc: BaseException, what: str) -> Exception:
    return kafka_refusal(exc) or BrokerUnavailable(f"{what} failed: {type(exc).__name__}")


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]  # aiokafka is untyped
    def __init__(self, assigned: Assigned, revoked: Assigned) -> None:
        self._assigned = assigned
        self._revoked = revoked

    async def on_partitions_revoked(self, revoked: Sequence[Partition]) -> None:
        await self._revoked(list(revoked))

    async def on_partitions_assigned(self, assigned: Sequence[Partition]) -> None:
        await self._assigned(list(assigned))


class AioConsumer:
    def __init__(self, consumer: AIOKafkaConsumer, settings: OutboxSettings) -> None:
        self._consumer = consumer
        self._settings = settings  # for the diagnosis of a refused start

    # -- the interface -------------------------------------------------------------------
    async def start(self) -> None:
        # A header name that is not UTF-8 comes as an UndecodedHeader, not as an error
        # that fails the partition's every fetch (said at start when this aiokafka cannot).
        aiokafka_internals.install_lenient_header_names()
        try:
            await start_kafka(self._consumer, self._settings)
        except KafkaError as exc:
            raise _unavailable(exc, "Kafka consumer start") from exc

    async def stop(self) -> None:
        await self._consumer.stop()

    def subscribe(self, topics: Sequence[str], assigned: Assigned, revoked: Assigned) -> None:
        self._consumer.subscribe(list(topics), listener=_Listener(assigned, revoked))

    async def fetch(self, timeout_ms: int, max_records: int) -> dict[Partition, list[Any]]:
        try:
            batches = await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        except KafkaError as exc:
            refused = kafka_refusal(exc)
            if refused is not None:
                raise refused from exc
            # The group's errors, named (aiokafka wraps a join's error as KafkaError(repr)).
            raise GroupError(type(exc).__name__, str(exc) or type(exc).__name__) from exc
        except UnicodeDecodeError as exc:  # only when the room could not read such names
            raise RecordUnreadable(
                f"aiokafka {aiokafka_version} cannot read a fetched record (a header name is "
                f"not UTF-8: {exc.object[exc.start : exc.start + 8]!r}), so it cannot be "
                "dead-lettered: see the WARNING at start on undecodable header names"
            ) from exc
        return cast(dict[Partition, list[Any]], batches)

    def assignment(self) -> set[Partition]:
        return cast(set[Partition], self._consumer.assignment())

    def pause(self, tp: Partition) -> None:
        self._consumer.pause(tp)

    def resume(self, tp: Partition) -> None:
        with contextlib.suppress(IllegalStateError):  # no longer assigned
            self._consumer.resume(tp)

    def paused(self) -> set[Partition]:
        return cast(set[Partition], self._consumer.paused())

    def highwater(self, tp: Partition) -> int | None:
        high = self._consumer.highwater(tp)
        return None if high is None else int(high)

    async def position(self, tp: Partition) -> int | None:
        try:
            return int(await self._consumer.position(tp))
        except IllegalStateError:  # no longer assigned, or being reset
            return None

    async def end_offsets(self, tps: Sequence[Partition]) -> dict[Partition, int]:
        try:
            ends = await self._consumer.end_offsets(list(tps))
        except (KafkaError, OSError) as exc:
            raise _unavailable(exc, "end offsets") from exc
        return cast(dict[Partition, int], ends)

    async def commit(self, offsets: Mapping[Partition, int]) -> None:
        try:
            await self._consumer.commit(dict(offsets))
        except (CommitFailedError, IllegalStateError) as exc:
            raise CommitRefused(type(exc).__name__) from exc
        except KafkaError as exc:
            raise _unavailable(exc, "offset commit") from exc

    # -- what aiokafka offers beyond it (aiokafka_internals: lost ones say so at start) ----
    def metadata_watch(self, topics: Sequence[str], each_seconds: float) -> MetadataWatch:
        """The watch that keeps this consumer's view of the partition leaders fresh when a
        broker hangs (a plain topic listing when aiokafka does not let it ask a broker)."""
        return MetadataWatch(self._consumer, topics, each_seconds, self._consumer.topics)

    def fetch_wait(self) -> tuple[int, int] | None:
        """``(fetch_min_bytes, fetch_max_wait_ms)`` as the fetcher uses them, or None."""
        return aiokafka_internals.fetch_wait(self._consumer)

    def set_fetch_wait(self, min_bytes: int, max_wait_ms: int) -> bool:
        return aiokafka_internals.set_fetch_wait(self._consumer, min_bytes, max_wait_ms)

    def group_generation(self) -> int | None:
        return aiokafka_internals.group_generation(self._consumer)

    def reset_member(self) -> bool:
        """Forget the member id, so that the next join is a fresh one."""
        return aiokafka_internals.reset_group_member(self._consumer)
