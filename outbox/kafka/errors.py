"""aiokafka's errors mapped to the framework's tree (outbox/errors.py), at the border of the
Kafka client interface (outbox/kafka/client.py): a refusal no retry can fix (credentials,
TLS, permissions) is a configuration error; a record Kafka refuses for good counts an
attempt; a producer whose idempotence state is gone is replaced; the rest is retried."""

from __future__ import annotations

import asyncio
import ssl
from typing import NoReturn

from aiokafka import errors as kerr

from outbox.errors import (
    BrokerRefused,
    BrokerUnavailable,
    ConfigurationError,
    OutboxError,
    ProducerBroken,
    RecordRejected,
)

# Broker answers that concern the record itself: retrying the same bytes cannot succeed.
_REJECTIONS = (
    kerr.MessageSizeTooLargeError,
    kerr.RecordListTooLargeError,
    kerr.InvalidTopicError,
    kerr.TopicAuthorizationFailedError,
    kerr.CorruptRecordException,
    kerr.InvalidTimestampError,
    kerr.PolicyViolationError,
    kerr.UnsupportedForMessageFormatError,
)
# Answers after which this producer instance is unusable (idempotence state lost/fenced).
_BROKEN = (
    kerr.OutOfOrderSequenceNumber,
    kerr.UnknownProducerId,
    kerr.InvalidProducerEpoch,
    kerr.ProducerFenced,
    kerr.ProducerClosed,
)

# Answers after which retrying cannot help: wrong credentials or TLS setup, no permission.
_REFUSALS = (
    kerr.AuthenticationFailedError,
    kerr.AuthenticationMethodNotSupported,
    kerr.SaslAuthenticationFailed,
    kerr.UnsupportedSaslMechanismError,
    kerr.IllegalSaslStateError,
    kerr.ClusterAuthorizationFailedError,
    kerr.GroupAuthorizationFailedError,
    ssl.SSLError,
)


def kafka_refusal(exc: BaseException) -> BrokerRefused | None:
    """A :class:`BrokerRefused` (configuration: exit 2) when ``exc`` — or what caused it —
    is an authentication, authorization or TLS failure; None for anything worth retrying."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, _REFUSALS):
            detail = str(seen).splitlines()[0] if str(seen) else ""
            return BrokerRefused(
                f"Kafka refused the client: {type(seen).__name__}"
                + (f" ({detail})" if detail else "")
                + "; check the Kafka security settings"
            )
        seen = seen.__cause__ or seen.__context__
    return None


def raise_admin_failure(exc: BaseException) -> NoReturn:
    """Raise a failed admin request as the framework's error: the refusal it carries
    (configuration: exit 2, without aiokafka's chain), else Kafka unavailable (retried)."""
    refused = kafka_refusal(exc)
    if refused is not None:
        raise refused from None
    raise BrokerUnavailable(f"Kafka admin request failed: {type(exc).__name__}") from exc


def producer_failure(exc: BaseException) -> Exception:
    """What a producer's failure (aiokafka's, or the framework's already) means: the
    record's fault (:class:`RecordRejected`), the producer's (:class:`ProducerBroken`), a
    refusal of the client (:class:`BrokerRefused`), or Kafka unavailable."""
    if isinstance(exc, asyncio.CancelledError):
        return BrokerUnavailable("send cancelled")
    if isinstance(exc, OutboxError) and isinstance(
        exc, RecordRejected | ProducerBroken | BrokerUnavailable | ConfigurationError
    ):
        return exc
    refused = kafka_refusal(exc)
    if refused is not None:
        return refused
    name = type(exc).__name__
    if isinstance(exc, _REJECTIONS):
        return RecordRejected(f"Kafka rejected the record: {name}")
    if isinstance(exc, _BROKEN):
        return ProducerBroken(f"Kafka producer must be recreated: {name}")
    return BrokerUnavailable(f"Kafka unavailable: {name}")
