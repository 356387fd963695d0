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


class AmbiguousId(OutboxError):
    """An operator named a record by an id prefix (or without the consumer) that fits more
    than one: the message says how many, and what to add."""


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
    """A schema, table prefix, topic or consumer name is not a safe identifier (the whole
    string is checked: a trailing newline is refused too)."""


class SchemaMissing(ConfigurationError):
    """The framework's tables do not exist in the configured schema. A configuration error
    (daemons exit 2 before joining anything): the same settings fail the same way until
    someone runs ``outbox db upgrade``."""

    action = "to create the outbox tables"

    def __init__(self, detail: str) -> None:
        super().__init__(f"{detail}; run `outbox db upgrade` {self.action}")


class SchemaOutdated(SchemaMissing):
    """The database's schema is at an older revision than this version of the package
    needs (``outbox db current`` says which)."""

    action = "to bring them up to date"


class PayloadError(OutboxError):
    """A message cannot be published as given: ``field`` names the part at fault
    (``topic``, ``key``, ``event_type``, ``source``, ``headers``, ``payload``,
    ``delay_seconds``, ``sequence``, ``event_id``; None when the message as a whole is) and
    the message says why. Raised by ``publish``, ``publish_many`` and their async forms
    before anything is written; the transaction is left as it was."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class InvalidText(PayloadError):
    """A text field (``event_type``, ``source``, a header's name or value; ``key`` when
    given as ``str``) holds what no column or record can carry as text: a NUL character
    (U+0000, refused by PostgreSQL's ``text`` and ``jsonb``, in either source: the relay
    writes the event's text to the ``failed`` table should Kafka refuse it) or a lone
    surrogate (not encodable as UTF-8). Send such data in the payload, or as ``bytes``
    for the key."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field} {reason}", field)
        self.reason = reason


class InvalidTopic(InvalidIdentifier, PayloadError):
    """``publish`` was given a topic that is not a valid Kafka topic name (not a string,
    empty, over 249 characters, or holding anything but ASCII letters, digits, ``.``,
    ``_`` and ``-``, e.g. a trailing newline). Both an :class:`InvalidIdentifier` and a
    :class:`PayloadError` (``field`` is ``topic``)."""

    def __init__(self, message: str) -> None:
        PayloadError.__init__(self, message, "topic")


class PayloadTooLarge(PayloadError):
    """The encoded record exceeds ``max_payload_bytes``: payload, key and user headers
    (names and values), counted in bytes (UTF-8 for text)."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(
            f"record is {size} bytes, over the limit of {limit} bytes "
            "(OUTBOX_MAX_PAYLOAD_BYTES; Kafka's default max.message.bytes is 1 MiB)",
            "payload",
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
            "published as soon as they commit); publish without it, or use the table source",
            option,
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


class PrivilegeMissing(ConfigurationError):
    """The role a daemon logs in as may not read or write the framework's tables (SQLSTATE
    42501) at start-up: a login user that is not yet a member of its job's role. ``outbox db
    sql --roles`` prints the grants; daemons exit 2."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


class BrokerUnavailable(OutboxError):
    """Kafka could not be reached or did not acknowledge in time."""

    retriable = True


class RecordRejected(OutboxError):
    """Kafka refuses this record permanently (too large, invalid topic, not authorized).

    Retrying cannot help by itself, so the event's attempts are counted and, after
    ``relay.max_attempts``, it is moved to the failed table.
    """

    retriable = False


class RecordUnreadable(OutboxError):
    """The Kafka client cannot read a fetched record at all (a header name that is not
    UTF-8, with an aiokafka the framework cannot read it with: said at start), so the
    inbox cannot dead-letter it; the consumer stops rather than skip it silently."""

    retriable = False


class ProducerBroken(OutboxError):
    """The Kafka producer must be recreated (lost idempotence state, fenced, closed)."""

    retriable = True


class GroupError(OutboxError):
    """The consumer group refused or dropped this member (``name``: Kafka's error, as the
    client reported it: ``FencedInstanceIdError``, ``InvalidSessionTimeoutError``...)."""

    def __init__(self, name: str, detail: str) -> None:
        super().__init__(f"Kafka consumer group error: {detail}")
        self.name = name


class CommitRefused(OutboxError):
    """The group took an offset commit away from this member: its partitions moved (a
    rebalance) or are no longer assigned. Nothing is lost: whoever reads them next starts
    at the last committed offset, and the inbox skips what was applied."""


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


class WalSlotMissing(WalSlotUnavailable):
    """``publish`` in WAL mode (``source = "wal"``) while the slot the relay reads does not
    exist in this database, or is lost: a logical slot decodes only WAL written after its
    creation, so the event could never be read. Nothing was written; raised inside the
    caller's transaction so that it does not commit (domain rows included) unless the
    caller catches this and commits anyway."""

    def __init__(self, slot: str) -> None:
        super().__init__(
            f"replication slot {slot!r} does not exist in this database or is lost: an event "
            "published now would never be read, so none was written; run `outbox wal setup` "
            "(after a lost slot: docs/operations/wal-slot.md), or publish with "
            "OUTBOX_SOURCE=table"
        )
        self.slot = slot


class WalRecordInvalid(ConfigurationError):
    """pgoutput sent a record the WAL source cannot parse (not protocol version 1?)."""


class ReplicationRefused(ConfigurationError):
    """The database refused the WAL source's replication connection for good: a role
    without REPLICATION, or a connection pooler that does not pass replication connections
    (the WAL relay needs a direct connection to PostgreSQL: ``relay.database_url``)."""
