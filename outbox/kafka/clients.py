"""Every Kafka client of the project, built from the settings in one place: producers,
consumers and admin clients of the daemons and the operator tools get the same brokers, TLS
context and SASL (OAUTHBEARER included), and a start a broker refuses for its security
settings becomes :class:`~outbox.errors.BrokerRefused` with what to check.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import ssl
from collections.abc import Mapping
from typing import Any, Protocol

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.conn import create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.helpers import create_ssl_context
from pydantic import SecretStr

from outbox.errors import BrokerRefused, ConfigurationError
from outbox.kafka.oauthbearer import TokenUnavailable, token_provider
from outbox.settings import KafkaSettings, OutboxSettings

_PROBE_SECONDS = 10.0  # the one diagnostic connection after a failed start


def kafka_options(settings: OutboxSettings) -> dict[str, Any]:
    """Connection options every Kafka client of the project shares: brokers, TLS, SASL."""
    k = settings.kafka
    options: dict[str, Any] = {
        "bootstrap_servers": settings.kafka_bootstrap_servers,
        "security_protocol": k.security_protocol,
    }
    if k.uses_tls:
        options["ssl_context"] = _ssl_context(k)
    if k.uses_sasl:
        options["sasl_mechanism"] = k.sasl_mechanism
        if k.sasl_oauth_token_provider is not None:
            options["sasl_oauth_token_provider"] = token_provider(k.sasl_oauth_token_provider)
        else:
            assert k.sasl_password is not None  # KafkaSettings refuses SASL without one
            options["sasl_plain_username"] = k.sasl_username
            options["sasl_plain_password"] = k.sasl_password.get_secret_value()
    return options


def kafka_environment(settings: OutboxSettings) -> dict[str, str]:
    """The ``OUTBOX_KAFKA*`` variables that make a child process (a daemon started by a
    tool or a test) connect like ``settings``. Secrets are in clear: this is the child's
    configuration, to be passed as its environment, never printed."""
    env = {"OUTBOX_KAFKA_BOOTSTRAP_SERVERS": settings.kafka_bootstrap_servers}
    for name, value in settings.kafka:
        if value is None:
            continue
        if isinstance(value, SecretStr):
            value = value.get_secret_value()
        elif isinstance(value, dict):
            value = json.dumps(value)
        env[f"OUTBOX_KAFKA__{name.upper()}"] = str(value)
    return env


def _ssl_context(k: KafkaSettings) -> ssl.SSLContext:
    try:
        context = create_ssl_context(
            cafile=str(k.ssl_ca_file) if k.ssl_ca_file else None,
            certfile=str(k.ssl_cert_file) if k.ssl_cert_file else None,
            keyfile=str(k.ssl_key_file) if k.ssl_key_file else None,
            password=k.ssl_key_password.get_secret_value() if k.ssl_key_password else None,
        )
    except (OSError, ssl.SSLError) as exc:
        # Which file is named by the setting; the SSL library's reason says what is wrong.
        reason = getattr(exc, "reason", None) or type(exc).__name__
        raise ConfigurationError(
            "OUTBOX_KAFKA__SSL_CA_FILE / SSL_CERT_FILE / SSL_KEY_FILE (/ SSL_KEY_PASSWORD) "
            f"cannot be loaded: {reason}"
        ) from None
    context.check_hostname = k.ssl_check_hostname
    return context  # type: ignore[no-any-return]  # aiokafka is untyped


def _accepted(kind: type[Any]) -> frozenset[str]:
    return frozenset(inspect.signature(kind).parameters)


def _build(kind: type[Any], role: str, settings: OutboxSettings, options: dict[str, Any]) -> Any:
    k = settings.kafka
    # Extra options go beneath the caller's (acks, auto-commit... are correctness, not
    # tuning); each client takes the extras it knows. A client id set by the operator wins.
    extra = {name: v for name, v in k.options.items() if name in _accepted(kind)}
    chosen = {**kafka_options(settings), **extra, **options}
    if k.client_id:
        chosen["client_id"] = k.client_id
    try:
        return kind(**chosen)
    except (TypeError, ValueError) as exc:  # an unknown or impossible option
        raise ConfigurationError(f"invalid Kafka {role} option: {exc}") from None


def with_client_options(settings: OutboxSettings, options: Mapping[str, Any]) -> OutboxSettings:
    """``settings`` whose Kafka extras include ``options`` (e.g. a consumer's
    ``kafka_options``), so that they reach every client built from it — the consumer, its
    admin client and its dead-letter producer — each taking those it knows."""
    if not options:
        return settings
    k = settings.kafka
    kafka = k.model_copy(update={"options": {**k.options, **options}})
    return settings.model_copy(update={"kafka": kafka})


class _Startable(Protocol):
    async def start(self) -> None: ...


async def start_kafka(client: _Startable, settings: OutboxSettings) -> None:
    """``client.start()``; when it fails because a broker refused this client's security
    settings (credentials, certificate, protocol), :class:`BrokerRefused` instead of
    the generic connection error aiokafka raises after logging the reason."""
    try:
        await client.start()
    except (KafkaError, OSError, TimeoutError):
        refused = await security_refusal(settings)
        if refused is not None:
            raise refused from None
        raise


async def security_refusal(settings: OutboxSettings) -> BrokerRefused | None:
    """Connect once to the first bootstrap broker with the client's settings and tell a
    refusal for security reasons (None: connected, or failed for another reason, such as
    nobody listening)."""
    k = settings.kafka
    host, _, port = settings.kafka_bootstrap_servers.split(",")[0].strip().rpartition(":")
    options = kafka_options(settings)
    del options["bootstrap_servers"]
    timeout = _PROBE_SECONDS
    try:
        conn = await asyncio.wait_for(
            create_conn(host, int(port), request_timeout_ms=int(timeout * 1000), **options),
            timeout,
        )
    except (SaslAuthenticationFailed, AuthenticationFailedError):
        if k.sasl_oauth_token_provider is not None:
            return _refused(
                f"authentication failed (OAUTHBEARER, token from {k.sasl_oauth_token_provider})",
                "check the token it returns (expired? audience, scope, subject) and "
                "OUTBOX_KAFKA__SASL_OAUTH_TOKEN_PROVIDER",
            )
        return _refused(
            f"authentication failed ({k.sasl_mechanism} as user {k.sasl_username!r})",
            "check OUTBOX_KAFKA__SASL_USERNAME / SASL_PASSWORD / SASL_MECHANISM",
        )
    except UnsupportedSaslMechanismError:
        return _refused(
            f"SASL mechanism {k.sasl_mechanism} is not enabled on this listener",
            "check OUTBOX_KAFKA__SASL_MECHANISM",
        )
    except ssl.SSLCertVerificationError as exc:
        return _refused(
            f"certificate verify failed ({exc.verify_message})",
            "check OUTBOX_KAFKA__SSL_CA_FILE (the CA that signed the brokers' certificates) "
            "and OUTBOX_KAFKA__SSL_CHECK_HOSTNAME",
        )
    except ssl.SSLError as exc:
        return _refused(
            f"TLS handshake failed ({exc.reason or type(exc).__name__}): wrong protocol?",
            f"OUTBOX_KAFKA__SECURITY_PROTOCOL is {k.security_protocol}; the port may not speak TLS",
        )
    except TokenUnavailable:  # the identity provider's trouble, not a refusal: retried
        return None
    except TimeoutError:
        # Connected, and no answer at all: a broker that hangs (GC pause, stuck disk). Both
        # protocol mismatches get the connection closed at once (docs/performance/relay.md).
        return None
    except (KafkaConnectionError, ConnectionResetError):
        # Connected, then the broker hung up on the first bytes: a plaintext client
        # talking to a TLS listener, or the other way round.
        need = "a plaintext listener needs PLAINTEXT or SASL_PLAINTEXT"
        if not k.uses_tls:
            need = "a TLS listener needs SSL or SASL_SSL"
        return _refused(
            "the broker closed the connection on the first request: wrong protocol?",
            f"OUTBOX_KAFKA__SECURITY_PROTOCOL is {k.security_protocol}; {need}",
        )
    except (KafkaError, OSError):  # nobody listening, name not resolved...: not security
        return None
    conn.close()
    return None


def _refused(cause: str, hint: str) -> BrokerRefused:
    return BrokerRefused(f"Kafka refused the connection: {cause}; {hint}")


def kafka_producer(settings: OutboxSettings, **options: Any) -> AIOKafkaProducer:
    """An ``AIOKafkaProducer`` for ``settings`` (not started)."""
    producer: AIOKafkaProducer = _build(AIOKafkaProducer, "producer", settings, options)
    return producer


# A consumer's requests to a broker that hangs (a long GC pause, a stuck disk) wait this
# long, aiokafka's 40 s default being longer than the group session (10 s): a heartbeat
# stuck on a hung group coordinator for 40 s gets the member thrown out of the group by
# the new coordinator, and every partition stops for a rebalance. OUTBOX_KAFKA__OPTIONS
# (or the app's kafka_options) may set another.
CONSUMER_REQUEST_TIMEOUT_MS = 10_000


def kafka_consumer(settings: OutboxSettings, **options: Any) -> AIOKafkaConsumer:
    """An ``AIOKafkaConsumer`` for ``settings`` (not started); auto-commit is the caller's
    choice to refuse."""
    if "request_timeout_ms" not in settings.kafka.options:
        options.setdefault("request_timeout_ms", CONSUMER_REQUEST_TIMEOUT_MS)
    consumer: AIOKafkaConsumer = _build(AIOKafkaConsumer, "consumer", settings, options)
    return consumer


def kafka_admin(settings: OutboxSettings, **options: Any) -> AIOKafkaAdminClient:
    """An ``AIOKafkaAdminClient`` for ``settings`` (not started)."""
    admin: AIOKafkaAdminClient = _build(AIOKafkaAdminClient, "admin", settings, options)
    return admin
