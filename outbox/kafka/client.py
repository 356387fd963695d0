"""The Kafka client interface of the daemons: what the relay and the consumer really call of
Kafka, and nothing more, so that a second client library could stand beside aiokafka as one
more implementation of it (outbox/kafka/aiokafka_client.py is the one today).

Errors come out of it in the framework's tree (outbox/errors.py), mapped at this border: a
record Kafka refuses for good is :class:`~outbox.errors.RecordRejected`, a producer that
must be recreated :class:`~outbox.errors.ProducerBroken`, a refusal of the client's
security settings :class:`~outbox.errors.BrokerRefused`, the rest
:class:`~outbox.errors.BrokerUnavailable` (retried).

Topic-partitions are ``(topic, partition)`` tuples; records are appended to a client's own
record batches, one call per record with no wrapper in between (the relay's hot path), and
fetched records are the client's own, handed over as they come.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

TopicPartition = tuple[str, int]
# Which broker of ``nodes`` a client should ask a question it would send to one chosen at
# random (a producer id, metadata): the relay prefers brokers known to answer.
PickBroker = Callable[[list[int]], int | None]


class UndecodedHeader(tuple[str, bytes | None]):
    """A consumed record's header whose name is not UTF-8 (Kafka's header names are
    strings; a foreign producer can send any bytes): ``(name, value)`` as every header, the
    name's bytes that are not UTF-8 escaped (``\\xff``). A client hands such a header in
    this type, never a plain tuple, so that the inbox dead-letters the record
    (inbox/envelopes) instead of reading a name the producer did not send."""

    __slots__ = ()


class Broker(NamedTuple):
    node_id: int
    host: str
    port: int


class RecordBatch(Protocol):
    def append(
        self,
        *,
        key: bytes | None,
        value: bytes | None,
        timestamp: int | None,
        headers: list[tuple[str, bytes]],
    ) -> object | None:
        """Add one record; None when the batch is full (a new batch takes it)."""
        ...


@dataclass(frozen=True)
class ProducerOptions:
    """What the relay asks of its idempotent producers (``acks=all``, always)."""

    client_id: str
    linger_ms: int
    max_batch_bytes: int
    max_request_bytes: int
    request_timeout_ms: int
    retry_backoff_ms: int


class Producer(Protocol):
    """An idempotent producer delivering whole record batches per partition."""

    async def start(self) -> None:
        """Connect; the framework's error when Kafka cannot be reached or refuses."""
        ...

    def new_batch(self) -> RecordBatch: ...

    async def deliver(
        self, tp: TopicPartition, batches: Sequence[RecordBatch]
    ) -> list[Exception | None]:
        """Queue ``batches`` for ``tp`` in order and wait for each answer: None where Kafka
        acknowledged, the framework's error where it did not. A batch that could not be
        queued fails every batch after it (none may overtake it)."""
        ...

    async def partitions(self, topic: str) -> list[int] | None:
        """``topic``'s partitions (asking the brokers when this client does not know the
        topic); None when it does not exist. :class:`~outbox.errors.RecordRejected` when
        this client may not write to it."""
        ...

    def leader(self, tp: TopicPartition) -> int | None:
        """``tp``'s leader as this client's metadata has it."""
        ...

    def brokers(self) -> list[Broker]:
        """The brokers this client's metadata lists."""
        ...

    async def close(self, flush_within: float, in_flight_within: float) -> None:
        """Stop: what is queued may be delivered for ``flush_within`` seconds; then what it
        still holds is failed (its rows are still in the outbox or the slot), and requests
        in flight get ``in_flight_within`` more before the stop is given up."""
        ...


@dataclass(frozen=True)
class PartitionState:
    leader: int  # -1: none
    isr: tuple[int, ...]  # in-sync replicas


@dataclass(frozen=True)
class ClusterView:
    """One metadata answer: the brokers Kafka lists (not fenced), and the partitions asked."""

    brokers: frozenset[int]
    partitions: Mapping[TopicPartition, PartitionState] = field(default_factory=dict)


class MetadataUnavailable(Exception):
    """This client cannot send a metadata request to a chosen broker (said once at WARNING
    where the capability was lost)."""


class MetadataClient(Protocol):
    """A client of its own for metadata questions to a chosen broker (the leader watch)."""

    async def start(self, within: float) -> bool:
        """Connect within ``within`` seconds; False when it could not (tried again later)."""
        ...

    def brokers(self) -> list[int]: ...

    async def ask(self, node: int | None, topics: Sequence[str]) -> ClusterView:
        """One metadata request for ``topics`` to broker ``node``; raises what the request
        raises (a broker that does not answer), or :class:`MetadataUnavailable`."""
        ...

    async def close(self) -> None: ...


class KafkaClients(Protocol):
    """Makes the relay's Kafka clients, with the connection settings it was made with."""

    bootstrap: list[str]  # the configured brokers, host:port

    @property
    def chooses_brokers(self) -> bool:
        """Whether its clients can ask the broker ``pick`` says (else: one at random)."""
        ...

    @property
    def asks_chosen_brokers(self) -> bool:
        """Whether :meth:`metadata_client` can ask a chosen broker (the leader watch)."""
        ...

    def producer(self, bootstrap: str, options: ProducerOptions, pick: PickBroker) -> Producer: ...

    def metadata_client(
        self, bootstrap: str, request_timeout_ms: int, pick: PickBroker
    ) -> MetadataClient: ...


class Partition(NamedTuple):
    """A consumer's topic-partition (equal to its ``(topic, partition)`` tuple)."""

    topic: str
    partition: int


# What a consumer's rebalance callbacks receive.
Assigned = Callable[[list[Partition]], Awaitable[None]]


class MetadataRefresh(Protocol):
    async def refresh(self) -> bool:
        """Ask the brokers who leads what; True when one answered."""
        ...


class Consumer(Protocol):
    """A group consumer that never commits on its own (auto-commit is off). Its records
    have ``topic``, ``partition``, ``offset``, ``key``, ``value``, ``timestamp`` and
    ``headers``; its partitions are :class:`Partition` values."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def subscribe(self, topics: Sequence[str], assigned: Assigned, revoked: Assigned) -> None:
        """Join the group for ``topics``; the callbacks run around each rebalance."""
        ...

    async def fetch(self, timeout_ms: int, max_records: int) -> dict[Partition, list[Any]]:
        """Records fetched since the last call, per partition (within ``timeout_ms``).
        :class:`~outbox.errors.GroupError` when the group refuses or drops this member."""
        ...

    def assignment(self) -> set[Partition]: ...

    def pause(self, tp: Partition) -> None: ...

    def resume(self, tp: Partition) -> None:
        """Fetch ``tp`` again; nothing when it is no longer assigned."""
        ...

    def paused(self) -> set[Partition]: ...

    def highwater(self, tp: Partition) -> int | None:
        """The partition's end offset as the last fetch brought it back (None: not yet)."""
        ...

    async def position(self, tp: Partition) -> int | None:
        """Where the next fetch of ``tp`` starts (None: not assigned, or being reset)."""
        ...

    async def end_offsets(self, tps: Sequence[Partition]) -> dict[Partition, int]: ...

    async def commit(self, offsets: Mapping[Partition, int]) -> None:
        """Commit ``offsets`` (the next offset to read, per partition) for the group;
        :class:`~outbox.errors.CommitRefused` when the group took them away."""
        ...

    # What a client may offer beyond the above; one that cannot says None or False.
    def metadata_watch(self, topics: Sequence[str], each_seconds: float) -> MetadataRefresh:
        """What keeps the view of the partition leaders fresh when a broker hangs."""
        ...

    def fetch_wait(self) -> tuple[int, int] | None:
        """The fetch's ``(min bytes, max wait ms)``; None when they cannot be changed."""
        ...

    def set_fetch_wait(self, min_bytes: int, max_wait_ms: int) -> bool: ...

    def group_generation(self) -> int | None:
        """The generation of the group this member joined; None when unknown."""
        ...

    def reset_member(self) -> bool:
        """Forget the member id, so that the next join is a fresh one."""
        ...
