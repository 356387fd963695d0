"""The one settings object of outbox-inbox.

``OutboxSettings`` is built once (from ``OUTBOX_*`` environment variables, a ``.env`` file
or keyword arguments) and passed explicitly to every component; no other module reads the
environment. Nested sections use ``__`` in environment names, e.g.
``OUTBOX_RELAY__BATCH_SIZE=2000``. The object is frozen (hashable), and its DSN is a
``SecretStr`` so that printing the settings never shows a password.

This module is the root object (its general fields, the per-component views of the database
URL, loading); each component's section is a class of ``outbox/settings_sections.py`` (the
Kafka one: ``outbox/settings_kafka.py``), and a component is given only its section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import URL, make_url

from outbox import identifiers
from outbox.dsn import libpq_conninfo, normalized
from outbox.errors import ConfigurationError
from outbox.settings_kafka import KafkaSettings
from outbox.settings_sections import (
    ConsoleSettings,
    ConsumerSettings,
    IdempotencySettings,
    RelaySettings,
    RetrySettings,
    StatusSettings,
    TopicSettings,
    WalSettings,
    postgres_url,
)

# Every settings class is imported from here, wherever it is defined (its sections are
# modules of their own, this module stays the one place a component names them from).
__all__ = [
    "ConsoleSettings",
    "ConsumerSettings",
    "IdempotencySettings",
    "KafkaSettings",
    "OutboxSettings",
    "PoolerMode",
    "RelaySettings",
    "RetrySettings",
    "StatusSettings",
    "TopicSettings",
    "WalSettings",
    "load_settings",
]

PoolerMode = Literal["none", "session", "transaction"]


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
    status: StatusSettings = StatusSettings()

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, value: SecretStr) -> SecretStr:
        return postgres_url(value, "database_url")

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
        """The DSN with the psycopg 3 driver (works for sync and async engines); several
        hosts in the one form SQLAlchemy and libpq both read (outbox/dsn.py)."""
        url = make_url(self.database_url.get_secret_value())
        return normalized(url.set(drivername="postgresql+psycopg"))

    @property
    def safe_database_url(self) -> str:
        """The DSN with its passwords masked (the user's, and a TLS key's ``sslpassword``),
        for logs and error messages."""
        url = self.sqlalchemy_url
        if "sslpassword" in url.query:
            url = url.update_query_dict({"sslpassword": "***"})
        # Host and port lists read as written (the comma is escaped in a URL's query).
        return url.render_as_string(hide_password=True).replace("%2C", ",")

    @property
    def libpq_dsn(self) -> str:
        """The DSN as a libpq connection string, for raw psycopg connections (the relay's,
        replication, the consumer's hot path): every host and parameter of the URL."""
        return libpq_conninfo(self.sqlalchemy_url)


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
