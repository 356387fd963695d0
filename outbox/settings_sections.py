"""The components' sections of the settings: one class per ``OUTBOX_<SECTION>__*`` group
(the relay, consumers, the WAL source, retries, topics, idempotency, the console, the status
line), each the only part of the settings its component is given. Parts of
:class:`outbox.settings.OutboxSettings`, which holds one of each (imported from there, as
every settings class is); the Kafka section is ``outbox/settings_kafka.py``."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import NoDecode
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from outbox import identifiers
from outbox.dsn import MultiHostError, hosts_and_ports
from outbox.errors import ConfigurationError


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def postgres_url(value: SecretStr, field: str) -> SecretStr:
    """``value`` if it is a PostgreSQL URL SQLAlchemy and libpq can read (its hosts too);
    else a ValueError naming ``field``, for pydantic (every database URL setting)."""
    try:
        url = make_url(value.get_secret_value())
    except ArgumentError:
        raise ValueError(f"{field} is not a valid SQLAlchemy URL") from None
    if url.get_backend_name() != "postgresql":
        raise ValueError(f"{field} must point to PostgreSQL, not {url.get_backend_name()!r}")
    try:
        hosts_and_ports(url)
    except MultiHostError as exc:
        raise ValueError(f"{field}: {exc}") from None
    return value


class RetrySettings(_Section):
    """Backoff used wherever the framework retries (full jitter, bounded)."""

    base_seconds: float = Field(0.1, gt=0, description="First backoff step.")
    cap_seconds: float = Field(30.0, gt=0, description="Largest single backoff.")
    max_attempts: int = Field(5, ge=1, le=1000, description="Attempts before giving up.")
    max_total_delay_seconds: float | None = Field(
        None, gt=0, description="Give up once this much time has passed (unset: no limit)."
    )


class RelaySettings(_Section):
    """The relay daemon (``outbox relay``)."""

    database_url: SecretStr | None = Field(
        None,
        description="SQLAlchemy URL the relay uses instead of database_url (unset: "
        "database_url): a direct connection or session pooling, never a transaction pooler "
        "(lane ownership lives in session advisory locks).",
    )

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else postgres_url(value, "relay.database_url")

    @model_validator(mode="after")
    def _check_takeover(self) -> RelaySettings:
        # Fewer heartbeats than this and one slow beat would look like a frozen relay; a
        # relay stops beating when it starts shutting down, and its draining must end first.
        least = max(3 * self.heartbeat_seconds, self.shutdown_grace_seconds + 1)
        if "takeover_seconds" not in self.model_fields_set:
            # Unset: the default, or what the other settings need (the model is frozen).
            object.__setattr__(self, "takeover_seconds", max(self.takeover_seconds, least))
        elif self.takeover_seconds < least:
            raise ValueError(
                f"relay.takeover_seconds ({self.takeover_seconds:g}) must be at least three "
                f"heartbeats (relay.heartbeat_seconds = {self.heartbeat_seconds:g}) and "
                "longer than relay.shutdown_grace_seconds "
                f"({self.shutdown_grace_seconds:g}) by a second"
            )
        return self

    batch_size: int = Field(2000, ge=1, le=50_000, description="Rows claimed per batch.")
    pipelines: int = Field(
        2,
        ge=1,
        le=16,
        description="Concurrent claim->publish->ack loops per relay, each on its own share "
        "of the owned lanes under a backlog (one claims while another waits for Kafka acks); "
        "while claims are small the first one claims every lane and the others wait, so a "
        "light stream costs one claim per poll, not one per pipeline.",
    )
    poll_interval_seconds: float = Field(
        0.2, gt=0, description="Longest sleep between polls when the outbox is empty."
    )
    min_poll_interval_seconds: float = Field(
        0.005,
        gt=0,
        description="Shortest time between the starts of two claims while rows keep "
        "coming; once the outbox has been empty for 1 s the sleep doubles on each empty poll "
        "up to poll_interval_seconds.",
    )
    max_attempts: int = Field(
        5, ge=1, description="Permanent broker rejections before a row is moved to failed."
    )
    keep_published_hours: float = Field(
        0, ge=0, description="0 deletes rows once Kafka acked them; >0 keeps them marked."
    )
    ack_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="Longest wait for Kafka acks before the batch is released and Kafka is "
        "treated as unavailable (no attempts are counted).",
    )
    partition_grace_seconds: float = Field(
        0.5,
        gt=0,
        description="Once part of a batch is acknowledged, how long the other partitions may "
        "take before they count as unavailable (a sick broker): their rows go back to the "
        "outbox, no attempt counted, and wait until Kafka answers for them, while the other "
        "partitions keep flowing.",
    )
    producers: int = Field(
        16,
        ge=1,
        le=256,
        description="Kafka producers per relay, partitions spread over them. Kafka answers one "
        "request per connection at a time, when all its partitions are acknowledged: "
        "partitions sharing a producer also share a partition's wait for a sick broker.",
    )
    heartbeat_seconds: float = Field(
        1.0, gt=0, description="Lane rebalance and heartbeat period; bounds takeover time."
    )
    takeover_seconds: float = Field(
        10.0,
        gt=0,
        description="A relay silent this long (no heartbeat: frozen, SIGSTOPped, a stuck "
        "host) has its idle database sessions ended by the others, which take over its "
        "lanes or the WAL slot; a relay publishes nothing more than half of this after "
        "its last round trip on the session that holds them. At least three heartbeats "
        "and longer than shutdown_grace_seconds (unset: 10, or that much when longer).",
    )
    cleanup_interval_seconds: float = Field(
        0,
        ge=0,
        description="Run retention (what `outbox cleanup` does) inside the relay every N "
        "seconds, a few bounded batches at a time; 0 = off (run `outbox cleanup` instead).",
    )
    stats_interval_seconds: float = Field(
        5.0, gt=0, description="Period of the pending-count / oldest-age metrics query."
    )
    shutdown_grace_seconds: float = Field(
        5.0, gt=0, description="On SIGTERM, how long an in-flight batch may take to finish."
    )
    linger_ms: int = Field(
        0,
        ge=0,
        description="Kafka producer linger. Batches are built whole from each claim, so a "
        "linger only delays them; 0 sends at once.",
    )
    max_batch_bytes: int = Field(
        512 * 1024,
        ge=16 * 1024,
        description="Largest Kafka record batch per partition; keep below the broker's "
        "message.max.bytes.",
    )
    max_inflight_bytes: int = Field(
        48 * 1024 * 1024,
        ge=1024 * 1024,
        description="Payload bytes one relay holds at once, whatever the row sizes: each "
        "pipeline's claim stops adding rows past its share (this / pipelines; always at "
        "least one row), and batches handed to Kafka but not yet answered (timed-out ones "
        "included) count against it until Kafka answers. Peak memory is about the idle "
        "footprint plus twice this.",
    )


HOSTNAME_FIELD = "{hostname}"
# Kafka takes any string as a group instance id; a template is checked against this so that
# a mistyped field (`{host}`, a lone brace) or a space is refused before anything starts.
_INSTANCE_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
_INSTANCE_ID_MAX = 249  # like a topic name: fits in logs, metrics and Kafka's tools


def check_instance_id(value: str, where: str = "group_instance_id") -> None:
    """Refuse an empty, too long or oddly spelled instance id (ValueError, for pydantic)."""
    if not value:
        raise ValueError(f"{where} makes an empty group instance id")
    if len(value) > _INSTANCE_ID_MAX:
        raise ValueError(f"group instance id is longer than {_INSTANCE_ID_MAX} characters")
    bad = sorted(set(value) - _INSTANCE_ID_CHARS)
    if bad:
        shown = " ".join(repr(c) for c in bad)
        raise ValueError(
            f"group instance id may use letters, digits, '.', '_' and '-' only ({where} "
            f"brings {shown})"
        )


def check_instance_template(template: str) -> None:
    """A group_instance_id value: literal characters and at most the field ``{hostname}``."""
    rest = template.replace(HOSTNAME_FIELD, "")
    if "{" in rest or "}" in rest:
        raise ValueError(
            "group_instance_id may contain only the field {hostname} (e.g. "
            "'{hostname}' or 'orders-{hostname}'); other braces are not allowed"
        )
    # The host name is checked once known (instance_id()); here only the literal part.
    check_instance_id(template.replace(HOSTNAME_FIELD, "h"), "group_instance_id")


class ConsumerSettings(_Section):
    """Inbox consumers (``outbox consume``)."""

    database_url: SecretStr | None = Field(
        None,
        description="SQLAlchemy URL consumers use instead of database_url (unset: "
        "database_url), e.g. a direct one while applications go through a pooler.",
    )

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, value: SecretStr | None) -> SecretStr | None:
        return None if value is None else postgres_url(value, "consumer.database_url")

    max_attempts: int = Field(
        5, ge=1, description="Handler attempts before dead-lettering (a handler may override)."
    )
    dlq_suffix: str = Field(".dlq", description="Dead-letter topic = original topic + suffix.")
    dlq_create: bool = Field(
        True,
        description="Create a missing dead-letter topic at start-up (else fail with TopicMissing).",
    )
    unknown_type_policy: Literal["skip", "dead_letter"] = Field(
        "skip",
        description="What to do with an event type no handler is registered for: skip "
        "(counted, logged at debug; a topic usually carries types other consumers handle) or "
        "dead_letter.",
    )
    malformed_policy: Literal["skip", "dead_letter"] = Field(
        "dead_letter",
        description="What to do with a record its envelope cannot read (the default, "
        "CloudEvents: one without `ce_id`/`ce_type` headers or a valid structured event): "
        "dead_letter (with the envelope's reason) or skip. Envelopes are chosen in code: "
        "`inbox.Consumer(envelope=...)`.",
    )
    dedupe_window_days: float = Field(7, gt=0, description="How long inbox rows are kept.")
    transaction_per: Literal["batch", "event"] = Field(
        "batch",
        description="One database transaction per partition batch (fast) or per event.",
    )
    max_batch_records: int = Field(
        500, ge=1, le=100_000, description="Records handled in one partition transaction."
    )
    handler_max_batch: int = Field(
        500,
        ge=1,
        le=100_000,
        description="Most events in one call of a batch handler (`@app.handler(..., "
        "batch=True)`), unless it sets its own `max_batch`. A call never spans more than one "
        "transaction, so max_batch_records bounds it too for one partition (and "
        "transaction_per=event makes every list one event).",
    )
    max_fetched_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024 * 1024,
        description="Payload bytes fetched but not yet finished per partition above which "
        "its fetching pauses (as it does past 4 x max_batch_records records), so large "
        "records cannot fill the consumer's memory; it resumes below half.",
    )
    max_concurrent_partitions: int = Field(
        8,
        ge=1,
        le=1024,
        description="Partitions processed at once in their own transactions (each holds a "
        "connection; more that wait take turns, one transaction each). The shared "
        "transaction of the partitions that are caught up has a connection of its own, so "
        "partitions with a backlog never hold them back.",
    )
    fetch_timeout_ms: int = Field(
        100, ge=1, description="Longest wait for records in one fetch; bounds shutdown latency."
    )
    linger_ms: int = Field(
        5,
        ge=0,
        le=1000,
        description="While records flow, a fetch waits up to this long for more (the broker "
        "holds it), so that one fetch and one transaction carry several events: less CPU per "
        "event at steady rates (see the consumer's performance page), at most this much added "
        "latency (half on average). The first "
        "record after a quiet spell is fetched at once; 0 = never wait. Off when the app sets "
        "fetch_min_bytes or fetch_max_wait_ms itself.",
    )
    offset_commit_interval_ms: int = Field(
        100,
        ge=0,
        description="Shortest gap between Kafka offset commits (finished offsets are "
        "coalesced meanwhile). Effects are deduped by the inbox, so this only bounds how "
        "much is re-read after a crash; revocation and shutdown commit at once.",
    )
    disarm_idle_seconds: float = Field(
        1.0,
        ge=0,
        description="A partition idle this long disarms the attempt marker its last commit "
        "armed ahead, so that a crash elsewhere in the process is not charged to its next "
        "records; 0 = keep it armed (no write when a stream pauses).",
    )
    error_message_chars: int = Field(
        500, ge=16, description="Error messages in dead-letter headers are cut to this length."
    )
    stats_seconds: float = Field(
        15.0,
        ge=0,
        le=3600,
        description="How often each consumer process adds what it counted (events "
        "processed, handler time, dead letters, retries) to its group's row of the minute in "
        "the consumer_stats table, which the console charts; nothing is written while "
        "nothing happened. 0 = never.",
    )
    group_instance_id: str | None = Field(
        None,
        description="Static group membership (KIP-345): this member's id in the consumer "
        "group, unique per process and stable across its restarts. A member that stops and "
        "returns under the same id within static_session_timeout_ms triggers no rebalance: "
        "the other members never stop. `{hostname}` is replaced by the host name, so one "
        "value serves every pod of a StatefulSet (`{hostname}` -> `orders-consumer-2`). "
        "Unset: dynamic membership (every start and stop rebalances the group).",
    )
    static_session_timeout_ms: int = Field(
        45_000,
        ge=1000,
        le=3_600_000,
        description="Group session timeout while group_instance_id is set: how long a "
        "stopped member keeps its partitions (unread) before Kafka gives them to others. "
        "Longer than a restart; at most the brokers' group.max.session.timeout.ms "
        "(checked at start). Dynamic members keep aiokafka's 10 s.",
    )

    @field_validator("group_instance_id")
    @classmethod
    def _check_instance_id(cls, value: str | None) -> str | None:
        if value is None:
            return None
        check_instance_template(value)
        return value

    def instance_id(self, hostname: str) -> str | None:
        """group_instance_id with ``{hostname}`` replaced (None: dynamic membership)."""
        if self.group_instance_id is None:
            return None
        resolved = self.group_instance_id.replace(HOSTNAME_FIELD, hostname)
        try:
            check_instance_id(resolved, f"the host name {hostname!r}")
        except ValueError as exc:
            raise ConfigurationError(
                f"consumer.group_instance_id: {exc}; set OUTBOX_CONSUMER__GROUP_INSTANCE_ID "
                "without {hostname}"
            ) from None
        return resolved


class TopicSettings(_Section):
    """Topic provisioning (``outbox topics ensure``)."""

    names: str = Field(
        "",
        description="Comma-separated topics the relay publishes to, as "
        "`NAME[:PARTITIONS][:compact]`, created by `outbox topics ensure` (with any "
        "--topic/--app given); `:compact` sets cleanup.policy=compact.",
    )
    partitions: int = Field(
        6, ge=1, le=10_000, description="Partitions of a topic created without a count."
    )
    replication_factor: int = Field(
        3,
        ge=1,
        le=32,
        description="Replication factor of created topics, capped by the brokers in the "
        "cluster (a one-broker cluster gets 1).",
    )


class ConsoleSettings(_Section):
    """The operator console (``outbox console``)."""

    token: SecretStr | None = Field(
        None,
        description="Bearer token the console requires (header `Authorization: Bearer ...` "
        "or the login form); mandatory to bind anything but 127.0.0.1/localhost. At least "
        "16 characters: the console refuses to start with a shorter or empty one.",
    )
    session_hours: float = Field(
        8.0,
        gt=0,
        le=720,
        description="How long a login lasts: the session then expires and the login form "
        "asks for the token again (logging out or restarting the console ends it sooner).",
    )
    refresh_seconds: float = Field(
        5.0,
        ge=1,
        le=3600,
        description="How often an open page refreshes its figures (the page's own switch "
        "turns it off).",
    )
    show_payloads: bool = Field(
        False,
        description="Show dead letters' payloads, and only in a console started with "
        "`--allow-actions` (the operator's); hidden otherwise, as the CLI does: payloads "
        "may hold personal data.",
    )
    token_name: str = Field(
        "operator",
        min_length=1,
        max_length=64,
        pattern=r"^[A-Za-z0-9_.@-]+$",
        description="Who holds the token: the name audit lines give for its actions.",
    )
    sample_seconds: float = Field(
        15.0, gt=0, le=3600, description="How often the console samples lag for its chart."
    )


class StatusSettings(_Section):
    """The daemons' periodic status line (``relay status``, ``consumer status``): what an
    operator tailing a log sees of them without a metrics scraper."""

    interval_seconds: float = Field(
        30.0,
        gt=0,
        le=86_400,
        description="How often the relay and the consumer look at "
        "their figures for the status line.",
    )
    mode: Literal["changed", "always"] = Field(
        "changed",
        description="changed: the line is written at INFO only when a count or a state "
        "differs from the last line (ages and WAL positions, which move by themselves, do not "
        "count), else at DEBUG: an idle daemon is quiet; always: at INFO every interval.",
    )


class IdempotencySettings(_Section):
    """Idempotent request handling (the Stripe pattern)."""

    ttl_hours: float = Field(24, gt=0, description="How long a key is remembered.")
    lock_timeout_seconds: float = Field(
        60, gt=0, description="After this, an in-flight request is presumed crashed."
    )
    purge_batch_size: int = Field(
        1000, ge=1, le=100_000, description="Expired keys deleted per cleanup transaction."
    )


class WalSettings(_Section):
    """The relay's WAL source (``source = "wal"``): events carried by logical-decoding
    messages instead of outbox rows (docs/howto/wal-source.md)."""

    slot: str = Field(
        "outbox_relay", description="Logical replication slot the relay reads (pgoutput)."
    )
    publication: str = Field(
        "outbox", description="Publication named to pgoutput; it needs no tables."
    )
    prefix: str = Field("outbox", description="Prefix of the logical messages that carry events.")
    batch_changes: int = Field(
        10_000,
        ge=1,
        le=1_000_000,
        description="Most records streamed from the slot before the relay marks a position to "
        "confirm (at the next transaction end) while a backlog keeps coming.",
    )
    heartbeat_seconds: float = Field(
        10.0,
        gt=0,
        description="How often an idle relay writes a transactional heartbeat so the slot's "
        "confirmed position (and the WAL it holds) keeps moving.",
    )

    standby_urls: Annotated[tuple[SecretStr, ...], NoDecode] = Field(
        (),
        description="SQLAlchemy URLs of the primary's physical standbys, separated by spaces "
        "(or a JSON list): `outbox doctor` checks that each would keep the slot through a "
        "failover (PostgreSQL 17+), `outbox wal setup --wait-synced` waits for them.",
    )

    @field_validator("slot", "publication")
    @classmethod
    def _check_name(cls, value: str, info: Any) -> str:
        return identifiers.sql_identifier(value, f"wal.{info.field_name}")

    @field_validator("standby_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> Any:
        # A URL may hold commas (several hosts), so a list in one variable is split on
        # whitespace, or given as JSON.
        if isinstance(value, str):
            text = value.strip()
            return json.loads(text) if text.startswith("[") else text.split()
        return value

    @field_validator("standby_urls")
    @classmethod
    def _check_urls(cls, value: tuple[SecretStr, ...]) -> tuple[SecretStr, ...]:
        for url in value:
            postgres_url(url, "wal.standby_urls")
        return value
