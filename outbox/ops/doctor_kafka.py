"""``outbox doctor``'s checks of Kafka: the client's TLS settings, every topic with pending
rows (or named by the caller) present with the expected partition count, consumer groups of
more than one member whose members are dynamic (no group instance id), and dead-letter
topics that take smaller records than their source topics."""

from __future__ import annotations

import contextlib

from aiokafka.errors import KafkaError
from sqlalchemy.ext.asyncio import AsyncConnection

from outbox.errors import OutboxError
from outbox.ops.doctor_base import Checks
from outbox.ops.kafka_probe import KafkaProbe, Member
from outbox.ops.record_limits import header_room


class KafkaChecks(Checks):
    def kafka_tls(self) -> None:
        """Kafka's protection is what the settings ask for: a client that connected at all
        did so with that protocol (the broker refuses anything else on that listener)."""
        k = self.settings.kafka
        how = k.security_protocol + (f" ({k.sasl_mechanism})" if k.uses_sasl else "")
        self.add(
            "tls",
            "ok",
            f"Kafka connections use {how}" + ("" if k.uses_tls else ": not encrypted"),
            service="kafka",
            tls=k.uses_tls,
        )

    async def topics(self, conn: AsyncConnection) -> None:
        wanted: dict[str, int | None] = {
            t: None for t in (await conn.execute(self.store.pending_topics)).scalars()
        }
        wanted.update(self.options.topics)
        bootstrap = self.settings.kafka_bootstrap_servers
        try:
            async with KafkaProbe(self.settings) as probe:
                counts = await probe.partitions(wanted)
                groups = await self._members(conn, probe)
        except OutboxError as exc:
            self.add("kafka", "error", str(exc), "check the broker and kafka_bootstrap_servers")
            return
        self.add("kafka", "ok", f"Kafka at {bootstrap} reachable")
        self.kafka_tls()
        for topic, expected in sorted(wanted.items()):
            have = counts.get(topic)
            if have is None:
                self.add(
                    "topic",
                    "error",
                    f"topic {topic!r} does not exist"
                    + (" but has pending outbox rows" if expected is None else ""),
                    "create it: outbox topics ensure --topic "
                    + (f"{topic}:{expected}" if expected else topic)
                    + " (partitions default to OUTBOX_TOPICS__PARTITIONS, replication to "
                    "OUTBOX_TOPICS__REPLICATION_FACTOR capped by the broker count)",
                    topic=topic,
                )
            elif expected is not None and have != expected:
                self.add(
                    "topic",
                    "warn",
                    f"topic {topic!r} has {have} partitions, expected {expected}",
                    "adding partitions changes which partition a key maps to (per-key order "
                    "breaks across the change); fix the expectation or plan a migration",
                    topic=topic,
                    partitions=have,
                    expected=expected,
                )
            else:
                self.add("topic", "ok", f"topic {topic!r}: {have} partitions", topic=topic)
        self.consumer_groups(groups)

    async def _members(self, conn: AsyncConnection, probe: KafkaProbe) -> dict[str, list[Member]]:
        """The live members of each consumer group the inbox knows (a group whose
        coordinator does not answer now is left out: not this check's finding)."""
        found: dict[str, list[Member]] = {}
        for group in (await conn.execute(self.store.consumer_names)).scalars():
            with contextlib.suppress(OutboxError, KafkaError):
                found[group] = await probe.members(group)
        return found

    def consumer_groups(self, groups: dict[str, list[Member]]) -> None:
        """A group of more than one live member whose members are dynamic (no group
        instance id): each member's restart, and a group coordinator that hangs and comes
        back, is a rebalance that stops every partition of the group; static members keep
        theirs (docs/howto/deploy.md)."""
        for group, members in sorted(groups.items()):
            if len(members) < 2:
                continue
            dynamic = [m for m in members if not m.static]
            if not dynamic:
                self.add(
                    "consumer group",
                    "ok",
                    f"consumer group {group!r}: {len(members)} static members",
                    group=group,
                )
                continue
            self.add(
                "consumer group",
                "warn",
                f"consumer group {group!r}: {len(dynamic)} of {len(members)} live members are "
                "dynamic (no group instance id): each restart of one, and a group "
                "coordinator that hangs and comes back, stops every partition of the group "
                "for a rebalance",
                "give each member a stable, unique OUTBOX_CONSUMER__GROUP_INSTANCE_ID "
                "('{hostname}' in a StatefulSet); see the deploy guide, consumers restart "
                "without a rebalance",
                group=group,
                members=len(members),
                dynamic=len(dynamic),
            )

    async def dead_letter_limits(self, conn: AsyncConnection) -> None:
        """Each existing dead-letter topic of a consumed (or named) topic must take the
        records its source takes: a larger dead letter is kept in the database only."""
        suffix = self.settings.consumer.dlq_suffix
        sources = set((await conn.execute(self.store.consumed_topics)).scalars())
        sources.update(self.options.topics)
        sources = {t for t in sources if not t.endswith(suffix)}
        if not sources:
            return
        try:
            async with KafkaProbe(self.settings) as probe:
                limits = await probe.limits([*sources, *(t + suffix for t in sources)])
        except OutboxError as exc:
            self.add("dead_letter_topic", "warn", f"cannot read topic configs: {exc}")
            return
        room = header_room(self.settings.consumer.error_message_chars)
        pairs = [(t, t + suffix) for t in sorted(sources) if t in limits and t + suffix in limits]
        small = False
        for source, dlq in pairs:
            have, need = limits[dlq].max_message_bytes, limits[source].max_message_bytes
            if have >= need:
                continue
            small = True
            self.add(
                "dead_letter_topic",
                "warn",
                f"dead-letter topic {dlq!r} takes records up to {have} bytes, its source "
                f"{source!r} up to {need}: a larger dead letter is kept in the database only "
                "(a marker without the value goes to the topic)",
                f"kafka-configs.sh --bootstrap-server {self.settings.kafka_bootstrap_servers} "
                f"--alter --entity-type topics --entity-name {dlq} "
                f"--add-config max.message.bytes={need + room}",
                topic=dlq,
                max_message_bytes=have,
                source=source,
                source_max_message_bytes=need,
            )
        if pairs and not small:
            self.add(
                "dead_letter_topic",
                "ok",
                f"{len(pairs)} dead-letter topic(s) take their source topics' records",
            )
