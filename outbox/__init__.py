"""outbox-inbox: transactional outbox and inbox for PostgreSQL and Apache Kafka.

Producer side::

    from outbox import Outbox, OutboxSettings

    ob = Outbox(OutboxSettings())           # reads OUTBOX_* once, passed explicitly
    with Session(engine) as session, session.begin():
        session.add(order)
        ob.publish(session, topic="orders", key=str(order.id),
                   event_type="order.created", payload=order_created)
"""

from outbox.breaker import BreakerState, CircuitBreaker, CircuitBreakers, CircuitOpen
from outbox.budget import RetryBudget, RetryBudgetExhausted
from outbox.canonical import canonical_json, idempotency_key
from outbox.envelope import Message, uuid7
from outbox.errors import (
    BrokerUnavailable,
    ConfigurationError,
    DatabaseUnavailable,
    InvalidIdentifier,
    OutboxError,
    PayloadError,
    PayloadMismatch,
    PayloadTooLarge,
    SchemaMissing,
    TopicMissing,
)
from outbox.idempotency import (
    IdempotencyConflict,
    IdempotencyError,
    IdempotencyInProgress,
    IdempotencyKeys,
    InvalidIdempotencyKey,
    Outcome,
    StoredResponse,
    request_hash,
    scope_for,
    strip_fields,
)
from outbox.producer import Outbox
from outbox.retry import (
    HttpStatusError,
    Permanent,
    Retrier,
    Retryable,
    RetryPolicy,
    is_retryable,
    is_retryable_status,
)
from outbox.settings import OutboxSettings, load_settings
from outbox.tables import Tables, build_tables

__all__ = [
    "BreakerState",
    "BrokerUnavailable",
    "CircuitBreaker",
    "CircuitBreakers",
    "CircuitOpen",
    "ConfigurationError",
    "DatabaseUnavailable",
    "HttpStatusError",
    "IdempotencyConflict",
    "IdempotencyError",
    "IdempotencyInProgress",
    "IdempotencyKeys",
    "InvalidIdempotencyKey",
    "InvalidIdentifier",
    "Message",
    "Outbox",
    "OutboxError",
    "OutboxSettings",
    "Outcome",
    "PayloadError",
    "PayloadMismatch",
    "PayloadTooLarge",
    "Permanent",
    "Retrier",
    "RetryBudget",
    "RetryBudgetExhausted",
    "RetryPolicy",
    "Retryable",
    "SchemaMissing",
    "StoredResponse",
    "Tables",
    "TopicMissing",
    "build_tables",
    "canonical_json",
    "idempotency_key",
    "is_retryable",
    "is_retryable_status",
    "load_settings",
    "request_hash",
    "scope_for",
    "strip_fields",
    "uuid7",
]
