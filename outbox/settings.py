"""The one settings object of outbox-inbox.

``OutboxSettings`` is built once (from ``OUTBOX_*`` environment variables, a ``.env`` file
or keyword arguments) and passed explicitly to every component; no other module reads the
environment. Nested sections use ``__`` in environment names, e.g.
``OUTBOX_RELAY__BATCH_SIZE=2000``. The object is frozen (hashable), and its DSN is a
``SecretStr`` so that printing the settings never shows a password.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError

from outbox import identifiers
from outbox.errors import ConfigurationError


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RetrySettings(_Section):
    """Backoff used wherever the framework retries (full jitter, bounded)."""

    base_seconds: float = Field(0.1, gt=0, description="First backoff step.")
    cap_seconds: float = Field(30.0, gt=0, description="Largest single backoff.")
    max_attempts: int = Field(5, ge=1, le=1000, description="Attempts before giving up.")


class RelaySettings(_Section):
    """The relay daemon (``outbox relay``)."""

    batch_size: int = Field(1000, ge=1, le=50_000, description="Rows claimed per batch.")
    poll_interval_seconds: float = Field(
        1.0, gt=0, description="Longest sleep when idle; NOTIFY wakes the relay sooner."
    )
    max_attempts: int = Field(
        5, ge=1, description="Permanent broker rejections before a row is moved to failed."
    )
    keep_published_hours: float = Field(
        0, ge=0, description="0 deletes rows once Kafka acked them; >0 keeps them marked."
    )


class ConsumerSettings(_Section):
    """Inbox consumers (``outbox consume``)."""

    max_attempts: int = Field(5, ge=1, description="Handler attempts before dead-lettering.")
    dlq_suffix: str = Field(".dlq", description="Dead-letter topic = original topic + suffix.")
    unknown_type_policy: Literal["skip", "dead_letter"] = Field(
        "dead_letter", description="What to do with an event type no handler is registered for."
    )
    dedupe_window_days: float = Field(7, gt=0, description="How long inbox rows are kept.")


class IdempotencySettings(_Section):
    """Idempotent request handling (the Stripe pattern)."""

    ttl_hours: float = Field(24, gt=0, description="How long a key is remembered.")
    lock_timeout_seconds: float = Field(
        60, gt=0, description="After this, an in-flight request is presumed crashed."
    )


class OutboxSettings(BaseSettings):
    """All configuration of outbox-inbox. See the configuration table in the README."""

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
    kafka_bootstrap_servers: str = Field(
        "127.0.0.1:39092", description="Comma-separated host:port list of Kafka brokers."
    )
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
    retry: RetrySettings = RetrySettings()
    relay: RelaySettings = RelaySettings()
    consumer: ConsumerSettings = ConsumerSettings()
    idempotency: IdempotencySettings = IdempotencySettings()

    @field_validator("database_url")
    @classmethod
    def _check_url(cls, value: SecretStr) -> SecretStr:
        try:
            url = make_url(value.get_secret_value())
        except ArgumentError:
            raise ValueError("database_url is not a valid SQLAlchemy URL") from None
        if url.get_backend_name() != "postgresql":
            raise ValueError(
                f"database_url must point to PostgreSQL, not {url.get_backend_name()!r}"
            )
        return value

    @field_validator("db_schema")
    @classmethod
    def _check_schema(cls, value: str) -> str:
        return identifiers.sql_identifier(value, "db_schema")

    @field_validator("table_prefix")
    @classmethod
    def _check_prefix(cls, value: str) -> str:
        return identifiers.table_prefix(value)

    @property
    def sqlalchemy_url(self) -> URL:
        """The DSN with the psycopg 3 driver (works for sync and async engines)."""
        url = make_url(self.database_url.get_secret_value())
        return url.set(drivername="postgresql+psycopg")

    @property
    def safe_database_url(self) -> str:
        """The DSN with its password masked, for logs and error messages."""
        return self.sqlalchemy_url.render_as_string(hide_password=True)

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
