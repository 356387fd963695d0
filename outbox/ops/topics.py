"""Topic provisioning behind ``outbox topics ensure``: create the topics a deployment needs.

The framework never relies on broker-side auto-creation, so someone has to create the
relay's topics and each consumer's topics and dead-letter topics. This does it, idempotently:

* a missing topic is created with the partitions asked for (``NAME:PARTITIONS``, else
  ``topics.partitions``) and a replication factor of ``topics.replication_factor`` capped
  by the number of brokers (a one-broker development cluster gets 1, never an error);
* ``NAME:compact`` (or ``NAME:PARTITIONS:compact``) creates a compacted topic
  (``cleanup.policy=compact``): Kafka keeps the latest record of each key, and a tombstone
  (``payload=outbox.TOMBSTONE``) deletes the key;
* a dead-letter topic gets its source topic's partition count, its ``compression.type``,
  and its ``max.message.bytes`` plus room for the dead-letter headers (see
  ``record_limits``), so that every record of the source fits as a dead letter (never
  compaction: dead letters are kept by time, not by key);
* an existing topic is left alone and reported as ``exists`` — with fewer partitions than
  explicitly asked for it is reported as ``too_few_partitions``, and without compaction
  when it was asked for as ``not_compacted`` (problems, not fixed here: adding partitions
  moves keys to other partitions, which breaks per-key order across the change, and a
  cleanup policy decides which data Kafka deletes; both are an operator's decision).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (
    KafkaError,
    TopicAlreadyExistsError,
    TopicAuthorizationFailedError,
    for_code,
)

from outbox import identifiers
from outbox.errors import BrokerRefused, BrokerUnavailable, ConfigurationError
from outbox.kafka.admin import partition_counts, topic_error
from outbox.kafka.clients import kafka_admin, start_kafka
from outbox.kafka.errors import kafka_refusal
from outbox.ops.record_limits import COMPRESSION, dead_letter_configs, describe_limits
from outbox.settings import OutboxSettings

Status = Literal["created", "exists", "too_few_partitions", "not_compacted", "failed"]
_TIMEOUT_S = 15.0
_POLICY = "cleanup.policy"


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int | None = None  # None: the settings' default (or the source's, for a DLQ)
    dead_letter_of: str | None = None
    compact: bool = False  # cleanup.policy=compact (entity state: the latest value per key)


@dataclass(frozen=True)
class TopicResult:
    topic: str
    status: Status
    partitions: int | None  # what the topic has now (None if it could not be created)
    asked: int | None  # partitions explicitly asked for
    replication_factor: int | None
    detail: str = ""
    compact: bool = False  # compaction was asked for (and is in place when ok)

    @property
    def ok(self) -> bool:
        return self.status in ("created", "exists")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_spec(spec: str) -> TopicSpec:
    """``orders``, ``orders:12``, ``customers:compact`` or ``customers:12:compact``."""
    name, *options = spec.strip().split(":")
    partitions: int | None = None
    compact = False
    for option in options:
        if option.isdigit() and int(option) > 0 and partitions is None and not compact:
            partitions = int(option)
        elif option == "compact" and not compact:
            compact = True
        else:
            raise ConfigurationError(
                f"topic {spec!r}: expected NAME[:PARTITIONS][:compact] (PARTITIONS >= 1)"
            )
    return TopicSpec(identifiers.kafka_name(name), partitions, compact=compact)


def relay_topics(settings: OutboxSettings, extra: Iterable[str] = ()) -> list[TopicSpec]:
    """The topics named in ``topics.names`` and in ``extra`` (later ones win)."""
    configured = [s for s in settings.topics.names.split(",") if s.strip()]
    specs: dict[str, TopicSpec] = {}
    for raw in [*configured, *extra]:
        spec = parse_spec(raw)
        specs[spec.name] = spec
    return list(specs.values())


def consumer_topics(
    settings: OutboxSettings, topics: Iterable[str], partitions: dict[str, int | None]
) -> list[TopicSpec]:
    """A consumer's source topics and their dead-letter topics."""
    suffix = settings.consumer.dlq_suffix
    specs = []
    for topic in topics:
        specs.append(TopicSpec(topic, partitions.get(topic)))
        specs.append(TopicSpec(topic + suffix, dead_letter_of=topic))
    return specs


def _merge(specs: Sequence[TopicSpec]) -> list[TopicSpec]:
    merged: dict[str, TopicSpec] = {}
    for spec in specs:
        old = merged.get(spec.name)
        if old is None or (old.partitions is None and spec.partitions is not None):
            merged[spec.name] = spec
        if old is not None and (old.compact or spec.compact):
            merged[spec.name] = replace(merged[spec.name], compact=True)
    # Sources before their dead-letter topics: a DLQ copies its source's partition count.
    return sorted(merged.values(), key=lambda s: s.dead_letter_of is not None)


async def ensure(settings: OutboxSettings, specs: Sequence[TopicSpec]) -> list[TopicResult]:
    """Create what is missing; report every topic (see the module docstring)."""
    wanted = _merge(specs)
    if not wanted:
        return []
    admin = kafka_admin(settings, request_timeout_ms=int(_TIMEOUT_S * 1000))
    try:
        try:
            # (a refusal — credentials, TLS, protocol — is BrokerRefused: exit 2)
            await asyncio.wait_for(start_kafka(admin, settings), _TIMEOUT_S * 3)
            brokers = len((await admin.describe_cluster())["brokers"])
            existing = await _partitions(admin, [s.name for s in wanted])
            policies = await _policies(
                admin, [s.name for s in wanted if s.compact and existing.get(s.name)]
            )
        except (KafkaError, OSError, TimeoutError) as exc:
            raise BrokerUnavailable(
                f"Kafka at {settings.kafka_bootstrap_servers} unreachable ({type(exc).__name__})"
            ) from None
        replication = max(1, min(settings.topics.replication_factor, brokers))
        results = []
        for spec in wanted:
            result = await _ensure_one(admin, settings, spec, existing, replication, policies)
            existing[spec.name] = result.partitions
            results.append(result)
        return results
    finally:
        await admin.close()


async def _ensure_one(
    admin: AIOKafkaAdminClient,
    settings: OutboxSettings,
    spec: TopicSpec,
    existing: dict[str, int | None],
    replication: int,
    policies: dict[str, str],
) -> TopicResult:
    have = existing.get(spec.name)
    if have is not None:
        policy = policies.get(spec.name, "")
        if spec.compact and "compact" not in policy.split(","):
            return TopicResult(
                spec.name,
                "not_compacted",
                have,
                spec.partitions,
                None,
                f"exists with {_POLICY}={policy or 'delete'}, compact asked: a tombstone would "
                "not delete its key. Changing the policy changes what Kafka deletes: do it "
                f"deliberately (kafka-configs.sh --alter --entity-type topics --entity-name "
                f"{spec.name} --add-config {_POLICY}=compact)",
                compact=True,
            )
        if spec.partitions is not None and have < spec.partitions:
            return TopicResult(
                spec.name,
                "too_few_partitions",
                have,
                spec.partitions,
                None,
                f"has {have} partitions, {spec.partitions} asked; adding partitions moves "
                "keys (per-key order breaks across the change): "
                "add them deliberately with kafka-topics.sh --alter, or ask for fewer",
            )
        return TopicResult(spec.name, "exists", have, spec.partitions, None, compact=spec.compact)
    count = spec.partitions
    if count is None and spec.dead_letter_of is not None:
        count = existing.get(spec.dead_letter_of)
    count = count or settings.topics.partitions
    configs, detail = await _dead_letter_configs(admin, settings, spec)
    if spec.compact:
        configs[_POLICY] = "compact"
    try:
        response = await admin.create_topics(
            [NewTopic(spec.name, count, replication, topic_configs=configs)]
        )
        error = topic_error(response, spec.name)
    except KafkaError as exc:
        error = exc
    if isinstance(error, TopicAlreadyExistsError):  # created meanwhile by someone else
        now = (await _partitions(admin, [spec.name])).get(spec.name)
        return TopicResult(spec.name, "exists", now, spec.partitions, None, compact=spec.compact)
    if error is not None:
        # Not allowed to create topics: no other topic will do either.
        if isinstance(error, TopicAuthorizationFailedError):
            raise BrokerRefused(
                f"Kafka refused to create topic {spec.name!r}: {type(error).__name__}; grant "
                "this client CREATE on it (or create it another way)"
            )
        refused = kafka_refusal(error)
        if refused is not None:
            raise refused
        return TopicResult(
            spec.name, "failed", None, spec.partitions, replication, _describe(error)
        )
    return TopicResult(
        spec.name, "created", count, spec.partitions, replication, detail, compact=spec.compact
    )


async def _dead_letter_configs(
    admin: AIOKafkaAdminClient, settings: OutboxSettings, spec: TopicSpec
) -> tuple[dict[str, str], str]:
    """A dead-letter topic's configs from its source's limits, and a word about them."""
    if spec.dead_letter_of is None:
        return {}, ""
    try:
        limits, unreadable = await describe_limits(admin, [spec.dead_letter_of])
    except KafkaError as exc:
        limits, unreadable = {}, {spec.dead_letter_of: exc}
    source = limits.get(spec.dead_letter_of)
    if source is None:
        error = type(unreadable.get(spec.dead_letter_of, KafkaError())).__name__
        return {}, (
            f"the broker's default record size limit: {spec.dead_letter_of}'s "
            f"max.message.bytes unreadable ({error})"
        )
    configs = dead_letter_configs(source, settings.consumer.error_message_chars)
    shown = {k: v for k, v in configs.items() if (k, v) != (COMPRESSION, "producer")}
    return configs, ", ".join(f"{k}={v}" for k, v in sorted(shown.items()))


async def _partitions(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, int | None]:
    return partition_counts(await admin.describe_topics(names), names)


async def _policies(admin: AIOKafkaAdminClient, names: list[str]) -> dict[str, str]:
    """``cleanup.policy`` of existing topics (e.g. ``delete``, ``compact,delete``)."""
    if not names:
        return {}
    resources = [ConfigResource(ConfigResourceType.TOPIC, n, {_POLICY: None}) for n in names]
    found: dict[str, str] = {}
    for response in await admin.describe_configs(resources):
        for error_code, _, _, name, entries in response.resources:
            if error_code != 0:  # e.g. no DESCRIBE_CONFIGS permission: say so, do not guess
                found[name] = f"unknown ({type(for_code(error_code)()).__name__})"
            for key, value, *_ in entries:
                if key == _POLICY:
                    found[name] = str(value)
    return found


def _describe(error: BaseException) -> str:
    name = type(error).__name__
    message = str(error.args[0]) if error.args and error.args[0] else ""
    return f"{name}: {message}" if message else name
