"""outbox-inbox: transactional outbox and inbox for PostgreSQL and Apache Kafka.

Producer side::

    from outbox import Outbox, OutboxSettings

    ob = Outbox(OutboxSettings())           # reads OUTBOX_* once, passed explicitly
    with Session(engine) as session, session.begin():
        session.add(order)
        ob.publish(session, topic="orders", key=str(order.id),
                   event_type="order.created", payload=order_created)

The root package is the producer core. The tools around it live in subpackages:
``outbox.resilience`` (retry policy, budget, breaker), ``outbox.idempotency`` (idempotent
requests and their ASGI middleware), ``outbox.ops`` (lag, doctor, cleanup).
"""

from outbox.canonical import canonical_json, idempotency_key
from outbox.envelope import TOMBSTONE, Message, Tombstone, uuid7
from outbox.errors import (
    BrokerUnavailable,
    ConfigurationError,
    DatabaseUnavailable,
    InvalidIdentifier,
    InvalidText,
    InvalidTopic,
    OutboxError,
    PayloadError,
    PayloadMismatch,
    PayloadTooLarge,
    SchemaMissing,
    TopicMissing,
    UnsupportedInWalMode,
    WalSlotMissing,
)
from outbox.producer import Outbox
from outbox.settings import OutboxSettings, load_settings
from outbox.tables import Tables, build_tables

__all__ = [
    "TOMBSTONE",
    "BrokerUnavailable",
    "ConfigurationError",
    "DatabaseUnavailable",
    "InvalidIdentifier",
    "InvalidText",
    "InvalidTopic",
    "Message",
    "Outbox",
    "OutboxError",
    "OutboxSettings",
    "PayloadError",
    "PayloadMismatch",
    "PayloadTooLarge",
    "SchemaMissing",
    "Tables",
    "Tombstone",
    "TopicMissing",
    "UnsupportedInWalMode",
    "WalSlotMissing",
    "build_tables",
    "canonical_json",
    "idempotency_key",
    "load_settings",
    "uuid7",
]
