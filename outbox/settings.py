"""The one settings object of outbox-inbox.

``OutboxSettings`` is built once (from ``OUTBOX_*`` environment variables, a ``.env`` file
or keyword arguments) and passed explicitly to every component; no other module reads the
environment. Nested sections use ``__`` in environment names, e.g.
``OUTBOX_RELAY__BATCH_SIZE=2000``. The object is frozen (hashable), and its DSN is a
``SecretStr`` so that printing the settings never shows a password.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from outbox import identifiers
from outbox.errors import ConfigurationError


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


PoolerMode = Literal["none", "session", "transaction"]


def _postgres_url(value: SecretStr, field: str) -> SecretStr:
    try:
        url = make_url(value.get_secret_value())
    except ArgumentError:
        raise ValueError(f"{field} is not a valid SQLAlchemy URL") from None
    if url.get_backend_name() != "postgresql":
        raise ValueError(f"{field} must point to PostgreSQL, not {url.get_backend_name()!r}")
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
        return None if value is None else _postgres_url(value, "relay.database_url")

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
        return None if value is None else _postgres_url(value, "consumer.database_url")

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
        8, ge=1, le=1024, description="Partitions processed at once (each holds a connection)."
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
        "or the login form); mandatory to bind anything but 127.0.0.1/localhost.",
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


class IdempotencySettings(_Section):
    """Idempotent request handling (the Stripe pattern)."""

    ttl_hours: float = Field(24, gt=0, description="How long a key is remembered.")
    lock_timeout_seconds: float = Field(
        60, gt=0, description="After this, an in-flight request is presumed crashed."
    )
    purge_batch_size: int = Field(
        1000, ge=1, le=100_000, description="Expired keys deleted per cleanup transaction."
    )


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"]

# Options the dedicated fields own: an extra option may not set them (secrets stay in
# SecretStr fields, so they are masked wherever settings are shown).
_OWNED_OPTIONS = ("bootstrap_servers", "security_protocol", "client_id")
_OWNED_PREFIXES = ("sasl_", "ssl_")


class KafkaSettings(_Section):
    """How every Kafka client of the project connects (TLS, SASL, client id).

    The broker list stays ``OUTBOX_KAFKA_BOOTSTRAP_SERVERS``. OAUTHBEARER takes its tokens
    from the deployment's own code, named as ``MODULE:ATTR`` (an environment variable cannot
    hold a token provider, and a fixed token would expire).
    """

    security_protocol: SecurityProtocol = Field(
        "PLAINTEXT",
        description="PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL (managed clusters: SASL_SSL).",
    )
    sasl_mechanism: SaslMechanism = Field(
        "SCRAM-SHA-512",
        description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER (SASL_* only).",
    )
    sasl_username: str | None = Field(None, description="SASL user (API key on Confluent Cloud).")
    sasl_password: SecretStr | None = Field(
        None, description="SASL password (API secret); never shown or logged."
    )
    sasl_oauth_token_provider: str | None = Field(
        None,
        description="OAUTHBEARER: `MODULE:ATTR` of an aiokafka `AbstractTokenProvider` (an "
        "instance, or a class or function returning one), e.g. for MSK IAM or OIDC.",
    )
    ssl_ca_file: Path | None = Field(
        None,
        description="PEM file of the CA(s) that signed the brokers' certificates "
        "(unset: the system's trust store).",
    )
    ssl_cert_file: Path | None = Field(
        None, description="PEM client certificate, for brokers that require mutual TLS."
    )
    ssl_key_file: Path | None = Field(None, description="PEM private key of ssl_cert_file.")
    ssl_key_password: SecretStr | None = Field(
        None, description="Password of an encrypted ssl_key_file; never shown or logged."
    )
    ssl_check_hostname: bool = Field(
        True, description="Check that a broker's certificate names the host connected to."
    )
    client_id: str | None = Field(
        None, description="Kafka client id of every client (quotas, ACL audit); unset: per role."
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Further aiokafka client options as JSON, e.g. "
        '`{"metadata_max_age_ms": 60000}`; each client takes those it knows.',
    )

    @field_validator("ssl_ca_file", "ssl_cert_file", "ssl_key_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not value.is_file():
            raise ValueError("file not found")  # the path itself may be revealing; not echoed
        return value

    @field_validator("options")
    @classmethod
    def _not_owned(cls, value: dict[str, Any]) -> dict[str, Any]:
        owned = sorted(k for k in value if k in _OWNED_OPTIONS or k.startswith(_OWNED_PREFIXES))
        if owned:
            raise ValueError(f"{', '.join(owned)} must be set by its own setting")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KafkaSettings:
        oauth = self.sasl_mechanism == "OAUTHBEARER"
        if self.uses_sasl and oauth and not self.sasl_oauth_token_provider:
            raise ValueError(
                "sasl_mechanism OAUTHBEARER needs sasl_oauth_token_provider "
                "(OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER=MODULE:ATTR)"
            )
        if self.uses_sasl and not oauth and (not self.sasl_username or self.sasl_password is None):
            raise ValueError(
                f"security_protocol {self.security_protocol} needs sasl_username and "
                "sasl_password (OUTBOX_KAFKA__SASL_USERNAME, OUTBOX_KAFKA__SASL_PASSWORD)"
            )
        module, _, attribute = (self.sasl_oauth_token_provider or "").partition(":")
        if self.sasl_oauth_token_provider is not None and (
            not oauth or not module or not attribute
        ):
            raise ValueError(
                "sasl_oauth_token_provider is MODULE:ATTR, used with sasl_mechanism OAUTHBEARER"
            )
        if (self.ssl_cert_file is None) != (self.ssl_key_file is None):
            raise ValueError("ssl_cert_file and ssl_key_file go together")
        return self

    def __hash__(self) -> int:
        # Settings are hashable (frozen); the free-form options are a dict, so hash the
        # JSON form (secrets show masked there, which only makes hashes collide more).
        return hash(self.model_dump_json())

    @property
    def uses_tls(self) -> bool:
        return self.security_protocol in ("SSL", "SASL_SSL")

    @property
    def uses_sasl(self) -> bool:
        return self.security_protocol.startswith("SASL_")


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

    @field_validator("slot", "publication")
    @classmethod
    def _check_name(cls, value: str, info: Any) -> str:
        return identifiers.sql_identifier(value, f"wal.{info.field_name}")


class OutboxSettings(BaseSettings):
    """All configuration of outbox-inbox, read from ``OUTBOX_*`` environment variables
    (nested sections with ``__``: ``OUTBOX_RELAY__BATCH_SIZE``), a ``.env`` file or keyword
    arguments. Every variable is listed in the settings reference of the documentation."""

    model_config = SettingsConfigDict(
        env_prefix="OUTBOX_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
    )

    database_url: SecretStr = Field(
        SecretStr("postgresql+psycopg://outbox:outbox@127.0.0.1:54329/outbox"),
        description="SQLAlchemy URL of the PostgreSQL database (psycopg 3 driver).",
    )
    db_pooler: PoolerMode = Field(
        "none",
        description="What database_url goes through: none (PostgreSQL itself), session or "
        "transaction pooling (PgBouncer, Supavisor, RDS Proxy...). transaction turns psycopg's "
        "server-side prepared statements off; the relay refuses it (see relay.database_url).",
    )
    kafka_bootstrap_servers: str = Field(
        "127.0.0.1:39092", description="Comma-separated host:port list of Kafka brokers."
    )
    kafka: KafkaSettings = KafkaSettings()
    db_schema: str = Field("public", description="PostgreSQL schema holding the tables.")
    table_prefix: str = Field("outbox_", description="Prefix of every table name.")
    lanes: int = Field(
        64,
        ge=1,
        le=4096,
        description="Ordering lanes; fixed for the life of a deployment (keys hash onto lanes).",
    )
    max_payload_bytes: int = Field(
        1_048_576, ge=1, description="Largest record (key + payload + headers) accepted."
    )
    default_source: str = Field(
        "urn:outbox-inbox", description="CloudEvents `source` when publish() is given none."
    )
    source: Literal["table", "wal"] = Field(
        "table",
        description="Where producers put events and the relay reads them: the outbox table, "
        "or the WAL as logical-decoding messages (see wal).",
    )
    wal: WalSettings = WalSettings()
    retry: RetrySettings = RetrySettings()
    relay: RelaySettings = RelaySettings()
    consumer: ConsumerSettings = ConsumerSettings()
    topics: TopicSettings = TopicSettings()
    idempotency: IdempotencySettings = IdempotencySettings()
    console: ConsoleSettings = ConsoleSettings()

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, value: SecretStr) -> SecretStr:
        return _postgres_url(value, "database_url")

    @field_validator("db_schema")
    @classmethod
    def _check_schema(cls, value: str) -> str:
        return identifiers.sql_identifier(value, "db_schema")

    @field_validator("table_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return identifiers.table_prefix(value)

    def for_relay(self) -> OutboxSettings:
        """The settings the relay runs with: ``relay.database_url`` when set (the relay
        checks that it is a session of its own: ``db_pooler`` describes database_url only)."""
        return self._with_database(self.relay.database_url)

    def for_consumer(self) -> OutboxSettings:
        """The settings consumers run with: ``consumer.database_url`` when set (they probe
        what that URL goes through at start: ``db_pooler`` describes database_url only)."""
        return self._with_database(self.consumer.database_url)

    def _with_database(self, url: SecretStr | None) -> OutboxSettings:
        if url is None:
            return self
        return self.model_copy(update={"database_url": url, "db_pooler": "none"})

    @property
    def sqlalchemy_url(self) -> URL:
        """The DSN with the psycopg 3 driver (works for sync and async engines)."""
        url = make_url(self.database_url.get_secret_value())
        return url.set(drivername="postgresql+psycopg")

    @property
    def safe_database_url(self) -> str:
        """The DSN with its passwords masked (the user's, and a TLS key's ``sslpassword``),
        for logs and error messages."""
        url = self.sqlalchemy_url
        if "sslpassword" in url.query:
            url = url.update_query_dict({"sslpassword": "***"})
        return url.render_as_string(hide_password=True)

    @property
    def libpq_dsn(self) -> str:
        """The DSN in libpq form, for raw psycopg connections (LISTEN, COPY)."""
        return self.sqlalchemy_url.set(drivername="postgresql").render_as_string(
            hide_password=False
        )


def load_settings(**overrides: object) -> OutboxSettings:
    """Build settings from the environment, turning validation errors into one typed error."""
    from pydantic import ValidationError

    try:
        return OutboxSettings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        # pydantic echoes offending input values; a DSN may hold a password, so only
        # field locations and messages are reported.
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in exc.errors()
        )
        raise ConfigurationError(f"invalid outbox settings: {problems}") from None
