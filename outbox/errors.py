"""The one exception tree of outbox-inbox.

Every error the framework raises derives from :class:`OutboxError`. Each carries a
``retriable`` flag (as aiokafka's errors do) so callers and the retry toolkit can tell a
transient failure (broker down, serialization conflict) from one that will fail the same
way forever (bad payload, bad config). Messages never include secrets or payload bytes.
"""

from __future__ import annotations

import uuid


class OutboxError(Exception):
    """Base of every error raised by outbox-inbox."""

    retriable: bool = False


class NotFound(OutboxError):
    """An operator named something that does not exist (a dead letter, an effect)."""


class ConfigurationError(OutboxError):
    """Settings are invalid (bad DSN, bad identifier, impossible limits)."""


class ConnectionRefused(ConfigurationError):
    """A service refused this configuration for good: bad credentials, an untrusted
    certificate, the wrong protocol for the port, an unknown database. Retrying cannot
    help, so daemons stop (exit code 2) instead of retrying forever. The message names the
    cause and the setting to check, never a password. ``service`` says which one refused:
    see :class:`DatabaseRefused` and :class:`BrokerRefused`."""

    service = "a service"


class PoolerUnsupported(ConfigurationError):
    """A component that needs a database session of its own (the relay: lane ownership
    lives in session advisory locks) was pointed at a transaction pooler. Daemons exit 2;
    the message names the pooler and the setting of the component's own URL."""


class InvalidIdentifier(ConfigurationError):
    """A schema, table prefix, topic or consumer name is not a safe identifier."""


class SchemaMissing(OutboxError):
    """The framework's tables do not exist in the configured schema."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{detail}; run `outbox db upgrade` to create the outbox tables")


class PayloadError(OutboxError):
    """A payload, key or header cannot be published as given."""


class PayloadTooLarge(PayloadError):
    """The encoded record exceeds ``max_payload_bytes``."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"record is {size} bytes, over the limit of {limit} bytes "
            "(OUTBOX_MAX_PAYLOAD_BYTES; Kafka's default max.message.bytes is 1 MiB)"
        )
        self.size = size
        self.limit = limit


class UnsupportedInWalMode(PayloadError):
    """A publish option the WAL source cannot honour (``source = "wal"``): a delay
    (``delay_seconds``) needs a row that waits; the relay publishes a WAL message as soon
    as it reads it. Refused rather than ignored: the event would go out early."""

    def __init__(self, option: str) -> None:
        super().__init__(
            f"{option} is not supported with OUTBOX_SOURCE=wal (events in the WAL are "
            "published as soon as they commit); publish without it, or use the table source"
        )
        self.option = option


class PayloadMismatch(OutboxError):
    """An ``event_id`` was reused with a different topic, key, type or payload."""

    def __init__(self, event_id: uuid.UUID | str) -> None:
        super().__init__(
            f"event_id {event_id} was already published with a different payload; "
            "an event_id must identify exactly one event"
        )
        self.event_id = str(event_id)


class DatabaseUnavailable(OutboxError):
    """The database could not be reached or the connection dropped (worth retrying)."""

    retriable = True

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class DatabaseRefused(ConnectionRefused):
    """The database answered and refused this configuration for good: authentication
    (SQLSTATE 28P01/28000), an unknown database (3D000), TLS refused, a host name that does
    not resolve. Retrying cannot help; daemons exit with code 2 at start-up."""

    service = "PostgreSQL"

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class BrokerUnavailable(OutboxError):
    """Kafka could not be reached or did not acknowledge in time."""

    retriable = True


class BrokerRefused(ConnectionRefused):
    """Kafka refused this client for good (SASL authentication, TLS handshake or the wrong
    protocol for the port, not authorized); daemons exit with code 2 at start-up."""

    service = "Kafka"


class TopicMissing(ConfigurationError):
    """A topic does not exist; the framework never relies on auto-creation."""

    # What a row's last_error looks like, as SQL LIKE (a relay taking over a lane looks for
    # rows put back for a missing topic).
    PATTERN = "Kafka topic % does not exist;%"

    def __init__(self, topic: str) -> None:
        super().__init__(
            f"Kafka topic {topic!r} does not exist; create it with `outbox topics ensure` "
            "(the framework never relies on topic auto-creation)"
        )
        self.topic = topic


class WalSetupError(ConfigurationError):
    """The WAL source (``source = "wal"``) cannot be set up or read as configured.

    ``sql`` is the script an administrator can run to fix it (empty when no SQL can: a
    server setting that needs a restart), printed by ``outbox wal setup`` instead of a
    traceback. Daemons and one-shot commands exit 2.
    """

    def __init__(self, message: str, sql: str = "", sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sql = sql
        self.sqlstate = sqlstate


class WalPrivilegeMissing(WalSetupError):
    """This role may not create the publication (it needs CREATE on the database) or the
    replication slot (REPLICATION or superuser; SQLSTATE 42501): ``sql`` is what an
    administrator runs instead."""


class WalLevelNotLogical(WalSetupError):
    """The server's ``wal_level`` is not ``logical``: logical decoding is impossible until
    it is set and PostgreSQL restarted."""


class WalSlotMismatch(WalSetupError):
    """A replication slot of the configured name exists but is not a logical ``pgoutput``
    slot of this database (physical, another plugin, or another database: slot names are
    server-wide)."""


class WalSlotUnavailable(WalSetupError):
    """The replication slot is missing or invalidated (``wal_status`` lost), where a
    command needs it: nothing can be waited for or read from it."""


class WalRecordInvalid(ConfigurationError):
    """pgoutput sent a record the WAL source cannot parse (not protocol version 1?)."""


class ReplicationRefused(ConfigurationError):
    """The database refused the WAL source's replication connection for good: a role
    without REPLICATION, or a connection pooler that does not pass replication connections
    (the WAL relay needs a direct connection to PostgreSQL: ``relay.database_url``)."""
